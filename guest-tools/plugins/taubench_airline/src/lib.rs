//! The `taubench_airline` plugin: tau2-bench's airline tools, a thin component shell around
//! [`sagabox_toolkit::taubench_airline`].
sagabox_toolkit::export_plugin!(sagabox_toolkit::taubench_airline::TaubenchAirline, "../../../wit");
