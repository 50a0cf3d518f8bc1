//! The `inventory` plugin: a thin component shell around [`sagabox_toolkit::inventory`].
sagabox_toolkit::export_plugin!(sagabox_toolkit::inventory::Inventory, "../../../wit");
