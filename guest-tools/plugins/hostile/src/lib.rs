//! The `hostile` plugin: every way an untrusted tool can misbehave, for testing containment.
//! Each tool first writes a marker to the `scratch` namespace (its policy grants it), so a
//! test can check that the failed call left nothing behind.

use std::hint::black_box;

use sagabox_toolkit::{Args, Context, FieldIs, Plugin, Store, StoreExt, ToolError, ToolSpec, Value, json};

pub struct Hostile;

fn tool(name: &'static str, description: &'static str, properties: Value) -> ToolSpec {
    ToolSpec::query(name, description, json!({ "type": "object", "properties": properties }))
}

impl Plugin for Hostile {
    fn manifest() -> Vec<ToolSpec> {
        vec![
            tool("echo", "Returns its arguments; a well-behaved call.", json!({})),
            tool(
                "chatter",
                "Writes a lot to stderr, then succeeds.",
                json!({ "bytes": { "type": "integer", "minimum": 0 } }),
            ),
            tool("spin", "Loops forever.", json!({})),
            tool("grow", "Allocates memory without bound.", json!({})),
            tool("recurse", "Recurses without bound.", json!({})),
            tool("trap", "Panics.", json!({})),
            tool("flood", "Returns a huge string.", json!({ "bytes": { "type": "integer", "minimum": 0 } })),
            tool("read_file", "Tries to read a host file.", json!({ "path": { "type": "string" } })),
            tool("env", "Tries to read the host's environment variables.", json!({ "name": { "type": "string" } })),
            tool("connect", "Tries to open a TCP connection.", json!({ "address": { "type": "string" } })),
            tool(
                "sleep",
                "Blocks in a host call for a long time.",
                json!({ "seconds": { "type": "integer", "minimum": 0 } }),
            ),
            tool(
                "snoop",
                "Finds documents by conditions, in any namespace (`find`), and returns their keys.",
                json!({ "namespace": { "type": "string" }, "conditions": { "type": "array" } }),
            ),
            ToolSpec::undo(
                "trespass",
                "Writes a namespace its policy does not grant.",
                json!({ "type": "object", "properties": { "namespace": { "type": "string" } } }),
            ),
        ]
    }

    fn call(store: &mut dyn Store, tool: &str, args: &Value, _ctx: &Context) -> Result<Value, ToolError> {
        let a = Args(args);
        if tool != "echo" && tool != "chatter" {
            store.put_doc("scratch", tool, &json!({ "started": true }))?;
        }
        match tool {
            "echo" => Ok(args.clone()),
            "chatter" => {
                let bytes = args.get("bytes").and_then(Value::as_u64).unwrap_or(64 << 10);
                for _ in 0..bytes / 64 {
                    eprintln!("{}", "x".repeat(63));
                }
                Ok(json!({ "wrote": bytes }))
            }
            "spin" => {
                let mut n: u64 = 0;
                loop {
                    n = black_box(n.wrapping_add(1));
                }
            }
            "grow" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![black_box(1u8); 1 << 20]);
                    black_box(&hoard);
                }
            }
            "recurse" => Ok(json!(depth(0))),
            "trap" => panic!("hostile plugin panicked on purpose"),
            "flood" => {
                let bytes = args.get("bytes").and_then(Value::as_u64).unwrap_or(4 << 20);
                Ok(Value::String("x".repeat(bytes as usize)))
            }
            "read_file" => {
                let path = a.opt_str("path").unwrap_or("/etc/passwd");
                match std::fs::read_to_string(path) {
                    Ok(text) => Ok(json!({ "read": path, "contents": text })),
                    Err(e) => Err(ToolError::Rejected(format!("could not read {path}: {e}"))),
                }
            }
            "env" => {
                let seen: serde_json::Map<String, Value> =
                    std::env::vars().map(|(k, v)| (k, Value::String(v))).collect();
                match a.opt_str("name").map(std::env::var) {
                    Some(Ok(value)) => Ok(json!({ "value": value, "all": seen })),
                    Some(Err(e)) => Err(ToolError::Rejected(format!("{e}; the plugin sees {} variables", seen.len()))),
                    None => Ok(json!({ "all": seen })),
                }
            }
            "connect" => {
                let address = a.opt_str("address").unwrap_or("127.0.0.1:22");
                match std::net::TcpStream::connect(address) {
                    Ok(_) => Ok(json!({ "connected": address })),
                    Err(e) => Err(ToolError::Rejected(format!("could not connect to {address}: {e}"))),
                }
            }
            "sleep" => {
                let seconds = args.get("seconds").and_then(Value::as_u64).unwrap_or(3600);
                std::thread::sleep(std::time::Duration::from_secs(seconds));
                Ok(json!({ "slept": seconds }))
            }
            "snoop" => {
                let namespace = a.opt_str("namespace").unwrap_or("flights");
                let conditions: Vec<FieldIs> = args["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|c| FieldIs {
                        path: c["path"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .filter_map(Value::as_str)
                            .map(str::to_string)
                            .collect(),
                        value: c["value"].as_str().unwrap_or_default().to_string(),
                    })
                    .collect();
                let found = store.find(namespace, "", &conditions)?;
                Ok(json!(found.into_iter().map(|(key, _)| key).collect::<Vec<_>>()))
            }
            "trespass" => {
                let namespace = a.opt_str("namespace").unwrap_or("flights");
                store.put_doc(namespace, "HAT001", &json!({ "hijacked": true }))?;
                Ok(json!({ "wrote": namespace }))
            }
            other => Err(ToolError::InvalidInput(format!("no tool named '{other}'"))),
        }
    }
}

/// Recursion the optimizer cannot turn into a loop: every frame lives on the wasm stack.
#[inline(never)]
fn depth(n: u64) -> u64 {
    if black_box(n) == u64::MAX { 0 } else { black_box(depth(n + 1)) + 1 }
}

sagabox_toolkit::export_plugin!(Hostile, "../../../wit");
