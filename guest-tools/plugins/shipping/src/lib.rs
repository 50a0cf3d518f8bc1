//! The `shipping` plugin: a thin component shell around [`sagabox_toolkit::shipping`].
sagabox_toolkit::export_plugin!(sagabox_toolkit::shipping::Shipping, "../../../wit");
