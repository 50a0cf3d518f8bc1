//! Binding paths and templates: `BindingPath::parse`, `lookup`, `resolve` and `references`.
//! The input is a path on its first line and a JSON template (or anything) after it; both are
//! resolved against a fixed scope. Never a panic; a parsed path keeps its text, a path of
//! plain names renders back to itself, and a template without bindings resolves to itself.
#![no_main]

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock};

use libfuzzer_sys::fuzz_target;
use sagabox::saga::binding::{self, BindingPath, Root, Scope, Segment};
use serde_json::{Value, json};

static INPUT: LazyLock<Value> = LazyLock::new(|| {
    json!({ "flight": { "number": "HAT001", "legs": [ { "to": "JFK" }, [1, 2, { "x": null }] ] },
            "odd.key": { "a[0]": true }, "": 0, "list": [[[]]] })
});
static STEPS: LazyLock<BTreeMap<String, Arc<Value>>> = LazyLock::new(|| {
    BTreeMap::from([
        ("hotel".to_string(), Arc::new(json!({ "address": "1 Main St", "rooms": [101, 102] }))),
        ("s0".to_string(), Arc::new(json!([{ "op_id": "K1" }]))),
        ("".to_string(), Arc::new(json!("empty id"))),
    ])
});

fn plain(name: &str) -> bool {
    !name.is_empty() && !name.contains(['.', '[', ']', '"', '\''])
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (path_text, rest) = text.split_once('\n').unwrap_or((&text, ""));
    let scope = Scope { input: &INPUT, steps: &STEPS };

    if let Ok(path) = BindingPath::parse(path_text) {
        assert_eq!(path.to_string(), path_text);
        let _ = path.lookup(&scope);
        // Re-rendered from its parts, a path of plain names parses to the same parts.
        let root = match &path.root {
            Root::Input => Some("$.input".to_string()),
            Root::Step(id) if plain(id) => Some(format!("$.steps.{id}")),
            Root::Step(_) => None,
        };
        let segments: Option<String> = path
            .segments
            .iter()
            .map(|s| match s {
                Segment::Field(f) if plain(f) => Some(format!(".{f}")),
                Segment::Field(_) => None,
                Segment::Index(i) => Some(format!("[{i}]")),
            })
            .collect();
        if let (Some(root), Some(segments)) = (root, segments) {
            let again = BindingPath::parse(&format!("{root}{segments}")).expect("a rendered path parses");
            assert_eq!((again.root, again.segments), (path.root.clone(), path.segments.clone()));
        }
        let _ = binding::resolve(&json!({ "path": path_text }), &scope);
    }

    let template: Value = serde_json::from_str(rest).unwrap_or_else(|_| Value::String(rest.to_string()));
    let references = binding::references(&template);
    let resolved = binding::resolve(&template, &scope);
    if references.is_empty() && !template_has_literal(&template) {
        // Nothing to replace: the template comes back as written.
        assert_eq!(resolved.as_ref().ok(), Some(&template), "a template without bindings changed");
    }
    if resolved.is_err() {
        assert!(!references.is_empty(), "a template without bindings failed to resolve");
    }
});

/// Whether `v` holds a `{"$literal": ...}` (which may pass a binding-shaped value through).
fn template_has_literal(v: &Value) -> bool {
    match v {
        Value::Object(m) => m.contains_key("$literal") || m.values().any(template_has_literal),
        Value::Array(a) => a.iter().any(template_has_literal),
        _ => false,
    }
}
