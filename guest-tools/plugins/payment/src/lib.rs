//! The `payment` plugin: a thin component shell around [`sagabox_toolkit::payment`].
sagabox_toolkit::export_plugin!(sagabox_toolkit::payment::Payment, "../../../wit");
