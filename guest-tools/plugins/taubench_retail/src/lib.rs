//! The `taubench_retail` plugin: tau2-bench's retail tools, a thin component shell around
//! [`sagabox_toolkit::taubench_retail`].
sagabox_toolkit::export_plugin!(sagabox_toolkit::taubench_retail::TaubenchRetail, "../../../wit");
