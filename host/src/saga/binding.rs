//! Bindings: how a step's arguments, a compensator's arguments and a saga's output draw on
//! the saga's input and on earlier steps' outputs.
//!
//! A template is any JSON value. Inside it, an object of exactly one field `path` holding a
//! string is a binding, replaced by the value at that path: `$.input…` reads the saga's
//! input, `$.steps.<id>…` the output of step `<id>`; fields are `.name` or `["name"]`,
//! array items `[0]`. `{"$literal": v}` stands for `v` itself (to pass an object that looks
//! like a binding). Everything else is kept as written, with bindings inside it resolved.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde_json::{Map, Value};

/// One step of a path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Segment {
    Field(String),
    Index(usize),
}

/// What a path starts from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Root {
    Input,
    /// The output of this step.
    Step(String),
}

/// A parsed binding path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindingPath {
    pub text: String,
    pub root: Root,
    pub segments: Vec<Segment>,
}

impl fmt::Display for BindingPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// A binding that could not be resolved.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("binding {path}: {reason}")]
pub struct BindingError {
    pub path: String,
    pub reason: String,
}

impl BindingPath {
    pub fn parse(text: &str) -> Result<BindingPath, BindingError> {
        let fail = |reason: &str| BindingError { path: text.to_string(), reason: reason.to_string() };
        let rest = text.strip_prefix('$').ok_or_else(|| fail("a path starts with '$'"))?;
        let segments = parse_segments(rest).map_err(|r| fail(&r))?;
        let mut segments = segments.into_iter();
        let root = match segments.next() {
            Some(Segment::Field(f)) if f == "input" => Root::Input,
            Some(Segment::Field(f)) if f == "steps" => match segments.next() {
                Some(Segment::Field(id)) => Root::Step(id),
                _ => return Err(fail("'$.steps' must be followed by a step id")),
            },
            _ => return Err(fail("a path starts with '$.input' or '$.steps.<id>'")),
        };
        Ok(BindingPath { text: text.to_string(), root, segments: segments.collect() })
    }

    /// The value at this path, or why there is none.
    pub fn lookup<'a>(&self, scope: &'a Scope) -> Result<&'a Value, BindingError> {
        let fail = |reason: String| BindingError { path: self.text.clone(), reason };
        let mut at = match &self.root {
            Root::Input => scope.input,
            Root::Step(id) => &**scope.steps.get(id).ok_or_else(|| fail(format!("step '{id}' has no output")))?,
        };
        for (walked, segment) in self.segments.iter().enumerate() {
            let next = match segment {
                Segment::Field(name) => at.get(name.as_str()),
                Segment::Index(i) => at.get(*i),
            };
            at = next.ok_or_else(|| {
                let what = match segment {
                    Segment::Field(name) => format!("no field '{name}'"),
                    Segment::Index(i) => format!("no item [{i}]"),
                };
                fail(format!("{} has {what} (it is {})", self.first_segments(walked), kind_of(at)))
            })?;
        }
        Ok(at)
    }

    /// The root and the first `n` segments, as an error names where a lookup stopped; written
    /// only when one does, not on every lookup.
    fn first_segments(&self, n: usize) -> String {
        let mut text = match &self.root {
            Root::Input => "$.input".to_string(),
            Root::Step(id) => format!("$.steps.{id}"),
        };
        for segment in &self.segments[..n] {
            match segment {
                Segment::Field(name) => {
                    text.push('.');
                    text.push_str(name);
                }
                Segment::Index(i) => text.push_str(&format!("[{i}]")),
            }
        }
        text
    }
}

fn kind_of(value: &Value) -> String {
    match value {
        Value::Object(map) => {
            let keys: Vec<&str> = map.keys().map(String::as_str).take(8).collect();
            format!("an object with {}", if keys.is_empty() { "no fields".into() } else { keys.join(", ") })
        }
        Value::Array(items) => format!("an array of {}", items.len()),
        Value::Null => "null".into(),
        other => format!("the value {other}"),
    }
}

fn parse_segments(mut rest: &str) -> Result<Vec<Segment>, String> {
    let mut out = Vec::new();
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix('.') {
            let end = after.find(['.', '[']).unwrap_or(after.len());
            if end == 0 {
                return Err("empty field name".into());
            }
            out.push(Segment::Field(after[..end].to_string()));
            rest = &after[end..];
        } else if let Some(after) = rest.strip_prefix('[') {
            let end = after.find(']').ok_or("unclosed '['")?;
            let inner = &after[..end];
            let quoted = inner
                .strip_prefix('"')
                .and_then(|s| s.strip_suffix('"'))
                .or_else(|| inner.strip_prefix('\'').and_then(|s| s.strip_suffix('\'')));
            out.push(match quoted {
                Some(name) => Segment::Field(name.to_string()),
                None => Segment::Index(inner.parse().map_err(|_| format!("'[{inner}]' is not an index"))?),
            });
            rest = &after[end + 1..];
        } else {
            return Err(format!("unexpected '{}'", rest.chars().next().unwrap_or(' ')));
        }
    }
    Ok(out)
}

/// What bindings read.
pub struct Scope<'a> {
    pub input: &'a Value,
    pub steps: &'a BTreeMap<String, Arc<Value>>,
}

/// The path of a binding object, if `value` is one.
fn binding_of(value: &Value) -> Option<&str> {
    match value {
        Value::Object(map) if map.len() == 1 => map.get("path")?.as_str(),
        _ => None,
    }
}

/// `template` with every binding replaced by its value.
pub fn resolve(template: &Value, scope: &Scope) -> Result<Value, BindingError> {
    if let Some(text) = binding_of(template) {
        return BindingPath::parse(text)?.lookup(scope).cloned();
    }
    match template {
        Value::Object(map) if map.len() == 1 && map.contains_key("$literal") => Ok(map["$literal"].clone()),
        Value::Object(map) => {
            let mut out = Map::new();
            for (key, value) in map {
                out.insert(key.clone(), resolve(value, scope)?);
            }
            Ok(Value::Object(out))
        }
        Value::Array(items) => items.iter().map(|v| resolve(v, scope)).collect::<Result<_, _>>().map(Value::Array),
        other => Ok(other.clone()),
    }
}

/// A template that stands for `value` itself: `value` with every object that would read as
/// a binding (or a `$literal`) wrapped in `$literal`, and nothing else changed.
pub fn literal(value: &Value) -> Value {
    let special =
        |map: &Map<String, Value>| map.len() == 1 && (map.contains_key("$literal") || binding_of(value).is_some());
    match value {
        Value::Object(map) if special(map) => serde_json::json!({ "$literal": value }),
        Value::Object(map) => Value::Object(map.iter().map(|(k, v)| (k.clone(), literal(v))).collect()),
        Value::Array(items) => Value::Array(items.iter().map(literal).collect()),
        other => other.clone(),
    }
}

/// Every binding in `template`, parsed (or the error of one that does not parse).
pub fn references(template: &Value) -> Vec<Result<BindingPath, BindingError>> {
    let mut out = Vec::new();
    collect(template, &mut out);
    out
}

fn collect(template: &Value, out: &mut Vec<Result<BindingPath, BindingError>>) {
    if let Some(text) = binding_of(template) {
        out.push(BindingPath::parse(text));
        return;
    }
    match template {
        Value::Object(map) if map.len() == 1 && map.contains_key("$literal") => {}
        Value::Object(map) => map.values().for_each(|v| collect(v, out)),
        Value::Array(items) => items.iter().for_each(|v| collect(v, out)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn scope_values() -> (Value, BTreeMap<String, Arc<Value>>) {
        let input = json!({ "flight": { "number": "HAT001", "legs": [ { "to": "JFK" } ] } });
        let steps = BTreeMap::from([("hotel".to_string(), Arc::new(json!({ "address": "1 Main St", "odd.key": 7 })))]);
        (input, steps)
    }

    #[test]
    fn paths_parse_fields_indices_and_quoted_names() {
        let p = BindingPath::parse("$.input.flight.legs[0][\"to\"]").unwrap();
        assert_eq!(p.root, Root::Input);
        assert_eq!(
            p.segments,
            [
                Segment::Field("flight".into()),
                Segment::Field("legs".into()),
                Segment::Index(0),
                Segment::Field("to".into())
            ]
        );
        assert_eq!(BindingPath::parse("$.steps.hotel.address").unwrap().root, Root::Step("hotel".into()));
        assert!(BindingPath::parse("input.x").is_err());
        assert!(BindingPath::parse("$.outputs.x").is_err());
        assert!(BindingPath::parse("$.steps").is_err());
        assert!(BindingPath::parse("$.input[x]").is_err());
    }

    #[test]
    fn templates_resolve_nested_bindings_and_keep_literals() {
        let (input, steps) = scope_values();
        let scope = Scope { input: &input, steps: &steps };
        let template = json!({
            "flight": { "path": "$.input.flight.number" },
            "where": [{ "path": "$.steps.hotel.address" }, "literal"],
            "odd": { "path": "$.steps.hotel['odd.key']" },
            "escaped": { "$literal": { "path": "$.not.a.binding" } },
            "count": 2
        });
        assert_eq!(
            resolve(&template, &scope).unwrap(),
            json!({ "flight": "HAT001", "where": ["1 Main St", "literal"], "odd": 7,
                    "escaped": { "path": "$.not.a.binding" }, "count": 2 })
        );
        assert_eq!(references(&template).len(), 3);
    }

    #[test]
    fn literals_stand_for_themselves_however_they_look() {
        let value = json!({ "a": { "path": "$.input.x" }, "b": [{ "$literal": 1 }, { "path": 3 }], "c": "$.input.y" });
        let template = literal(&value);
        let (input, steps) = scope_values();
        assert_eq!(resolve(&template, &Scope { input: &input, steps: &steps }).unwrap(), value);
        assert!(references(&template).is_empty());
        // Nothing that needs no escape is wrapped.
        assert_eq!(literal(&json!({ "flight": "HAT001", "n": 2 })), json!({ "flight": "HAT001", "n": 2 }));
    }

    #[test]
    fn missing_values_say_what_was_there() {
        let (input, steps) = scope_values();
        let scope = Scope { input: &input, steps: &steps };
        let e = resolve(&json!({ "path": "$.steps.hotel.arrival" }), &scope).unwrap_err();
        assert!(
            e.to_string().contains("$.steps.hotel has no field 'arrival' (it is an object with address, odd.key)"),
            "{e}"
        );
        let e = resolve(&json!({ "path": "$.steps.car.x" }), &scope).unwrap_err();
        assert!(e.reason.contains("step 'car' has no output"));
        let e = resolve(&json!({ "path": "$.input.flight.legs[3]" }), &scope).unwrap_err();
        assert!(e.reason.contains("no item [3]"));
        let e = resolve(&json!({ "path": "$.input.flight.legs[0].from" }), &scope).unwrap_err();
        assert_eq!(e.reason, "$.input.flight.legs[0] has no field 'from' (it is an object with to)");
    }
}
