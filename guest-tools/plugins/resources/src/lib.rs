//! The `resources` plugin: a thin component shell around [`sagabox_toolkit::resources`].
sagabox_toolkit::export_plugin!(sagabox_toolkit::resources::Resources, "../../../wit");
