//! The `agents` plugin: a thin component shell around [`sagabox_toolkit::agents`].
sagabox_toolkit::export_plugin!(sagabox_toolkit::agents::Agents, "../../../wit");
