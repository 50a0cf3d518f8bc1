//! The `rental` plugin: a thin component shell around [`sagabox_toolkit::rental`].
sagabox_toolkit::export_plugin!(sagabox_toolkit::rental::Rental, "../../../wit");
