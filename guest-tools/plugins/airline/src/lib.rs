//! The `airline` plugin: a thin component shell around [`sagabox_toolkit::airline`].
sagabox_toolkit::export_plugin!(sagabox_toolkit::airline::Airline, "../../../wit");
