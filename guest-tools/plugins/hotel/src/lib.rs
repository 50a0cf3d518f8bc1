//! The `hotel` plugin: a thin component shell around [`sagabox_toolkit::hotel`].
sagabox_toolkit::export_plugin!(sagabox_toolkit::hotel::Hotel, "../../../wit");
