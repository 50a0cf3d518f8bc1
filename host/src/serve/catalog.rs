//! What the server offers: every plugin tool, every saga of `--sagas`, and the control
//! tools of transactions, as MCP tool descriptions (JSON, as the protocol writes them).
//!
//! Names: `<plugin>.<tool>` is served as `<plugin>__<tool>`. MCP allows dots, but the
//! function-calling APIs most agents sit on (OpenAI's, among others) allow only
//! `[A-Za-z0-9_-]`; plugin and tool names never contain `__`, so the mapping is one to one.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::{Map, Value, json};

use crate::runtime::Runtime;
use crate::saga::Saga;
use crate::saga::binding::{self, Root, Segment};

/// The argument that names the transaction a call belongs to.
pub const TRANSACTION_ARG: &str = "transaction";

/// A control tool of transactions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Begin,
    Commit,
    Abort,
    Status,
}

/// What a served tool name stands for.
#[derive(Clone, Debug)]
pub enum Entry {
    /// A plugin tool, by its `<plugin>.<tool>` name; `takes_handle`: whether its arguments
    /// may carry [`TRANSACTION_ARG`] (its own schema does not use that name).
    Plugin {
        qualified: String,
        side_effects: bool,
        takes_handle: bool,
    },
    Saga(Arc<Saga>),
    Control(Control),
}

/// The served tools.
pub struct Catalog {
    /// MCP `Tool` objects, in listing order.
    pub tools: Vec<Value>,
    entries: HashMap<String, Entry>,
}

/// The served name of a plugin tool.
pub fn served_name(qualified: &str) -> String {
    qualified.replacen('.', "__", 1)
}

impl Catalog {
    pub fn new(runtime: &Runtime, sagas: &[Arc<Saga>], expose_compensators: bool) -> Catalog {
        let mut catalog = Catalog { tools: Vec::new(), entries: HashMap::new() };
        for control in [Control::Begin, Control::Commit, Control::Abort, Control::Status] {
            let (name, tool) = control_tool(control);
            catalog.add(name, tool, Entry::Control(control));
        }
        for plugin in runtime.plugins() {
            let compensators: Vec<&str> = plugin.tools.values().filter_map(|t| t.info.compensator.as_deref()).collect();
            for (name, tool) in &plugin.tools {
                if !expose_compensators && compensators.contains(&name.as_str()) {
                    continue;
                }
                let qualified = format!("{}.{name}", plugin.name);
                let info = &tool.info;
                let (schema, takes_handle) = with_transaction_arg(&info.args_schema);
                let described = json!({
                    "name": served_name(&qualified),
                    "title": qualified,
                    "description": info.description,
                    "inputSchema": schema,
                    "annotations": {
                        "readOnlyHint": !info.side_effects,
                        // A repeated side-effecting call is a new step with a new effect.
                        "idempotentHint": !info.side_effects,
                        // Undone by its compensator when the transaction rolls back.
                        "destructiveHint": info.side_effects && info.compensator.is_none(),
                    },
                });
                let entry =
                    Entry::Plugin { qualified: qualified.clone(), side_effects: info.side_effects, takes_handle };
                catalog.add(served_name(&qualified), described, entry);
            }
        }
        for saga in sagas {
            let name = saga_tool_name(&saga.name);
            let description = format!(
                "Runs the saga '{}' as one unit: every step, and on failure the compensation of the completed ones. {}",
                saga.name,
                saga.definition.description.as_deref().unwrap_or("")
            );
            let described = json!({
                "name": name,
                "title": format!("saga {}", saga.name),
                "description": description.trim_end(),
                "inputSchema": saga_input_schema(saga),
                "annotations": { "readOnlyHint": false, "idempotentHint": false, "destructiveHint": false },
            });
            catalog.add(name, described, Entry::Saga(Arc::clone(saga)));
        }
        catalog
    }

    fn add(&mut self, name: String, tool: Value, entry: Entry) {
        if self.entries.contains_key(&name) {
            tracing::warn!(tool = %name, "two tools are served under one name; the first is kept");
            return;
        }
        self.tools.push(tool);
        self.entries.insert(name, entry);
    }

    pub fn entry(&self, name: &str) -> Option<&Entry> {
        self.entries.get(name)
    }

    /// Served names, for error messages.
    pub fn names(&self) -> Vec<&str> {
        self.tools.iter().filter_map(|t| t["name"].as_str()).collect()
    }
}

/// `saga_<name>`, with characters outside `[A-Za-z0-9_-]` as `_`.
pub fn saga_tool_name(saga: &str) -> String {
    let clean: String = saga.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
    format!("saga_{clean}")
}

/// A plugin's argument schema with the optional transaction handle added, and whether it
/// could be added (not when the plugin uses that argument name itself).
fn with_transaction_arg(schema: &Value) -> (Value, bool) {
    let mut schema = match schema {
        Value::Object(map) => map.clone(),
        _ => Map::new(),
    };
    schema.entry("type").or_insert_with(|| json!("object"));
    let properties = schema.entry("properties").or_insert_with(|| json!({}));
    let Some(properties) = properties.as_object_mut() else { return (Value::Object(schema), false) };
    if properties.contains_key(TRANSACTION_ARG) {
        return (Value::Object(schema), false);
    }
    properties.insert(TRANSACTION_ARG.into(), handle_property());
    (Value::Object(schema), true)
}

fn handle_property() -> Value {
    json!({
        "type": "string",
        "description": "The transaction (from saga_begin) this call belongs to. Leave it out to use the connection's \
                        transaction, which opens at the first call."
    })
}

/// The input schema of a saga tool: one property per top-level field its `$.input`
/// bindings read, all required.
fn saga_input_schema(saga: &Saga) -> Value {
    let def = &saga.definition;
    let mut templates: Vec<&Value> = Vec::new();
    for step in &def.steps {
        templates.push(&step.action.arguments);
        templates.extend(step.input.as_ref());
        templates.extend(step.compensate.as_ref().map(|c| &c.arguments));
    }
    templates.extend(def.output.as_ref());
    let mut fields: Vec<String> = templates
        .into_iter()
        .flat_map(binding::references)
        .filter_map(Result::ok)
        .filter(|path| path.root == Root::Input)
        .filter_map(|path| match path.segments.first() {
            Some(Segment::Field(field)) => Some(field.clone()),
            _ => None,
        })
        .collect();
    fields.sort();
    fields.dedup();
    let properties: Map<String, Value> =
        fields.iter().map(|f| (f.clone(), json!({ "description": format!("$.input.{f} of the saga") }))).collect();
    json!({ "type": "object", "properties": properties, "required": fields })
}

fn control_tool(control: Control) -> (String, Value) {
    let handle = json!({ "type": "string", "description": "The transaction [default: the connection's]." });
    let (name, description, properties) = match control {
        Control::Begin => (
            "saga_begin",
            "Opens a transaction: every tool call made in it is recorded with its compensator, and undone if it \
             fails or is aborted. Returns its handle; pass it as `transaction` to later calls (over a stdio \
             connection it also becomes the connection's transaction).",
            json!({
                "name": { "type": "string", "description": "A name for the transaction, shown in `sagabox runs`." },
                "timeout": {
                    "type": ["string", "integer"],
                    "description": "Time for the whole transaction, as \"30s\", \"5m\" or milliseconds; past it, it is rolled back."
                }
            }),
        ),
        Control::Commit => (
            "saga_commit",
            "Commits the transaction: its effects stay. A later call opens a new one.",
            json!({ "transaction": handle }),
        ),
        Control::Abort => (
            "saga_abort",
            "Aborts the transaction: every recorded effect is compensated, the latest first. Returns what was undone.",
            json!({ "transaction": handle, "reason": { "type": "string" } }),
        ),
        Control::Status => (
            "saga_status",
            "The transaction's recorded calls (arguments, output, idempotency key, compensator) and calls in flight.",
            json!({ "transaction": handle }),
        ),
    };
    let read_only = control == Control::Status;
    let tool = json!({
        "name": name,
        "description": description,
        "inputSchema": { "type": "object", "properties": properties },
        "annotations": { "readOnlyHint": read_only, "idempotentHint": read_only, "destructiveHint": false },
    });
    (name.to_string(), tool)
}
