//! What every tool shares: the store seen by a tool, its errors, argument access, record ids,
//! money and dates.

use serde_json::{Map, Value, json};

/// Why a tool did not do what it was asked (mirrors `tool-error` in the WIT).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolError {
    InvalidInput(String),
    Rejected(String),
    Transient(String),
}

/// Why the host's store refused an operation (mirrors `store-error` in the WIT).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreErrorKind {
    InvalidDocument,
    QuotaExceeded,
    Unavailable,
}

impl ToolError {
    /// How a tool reports a store refusal it does not handle itself: the one mapping the
    /// sandboxed plugins and their native build share.
    pub fn from_store(kind: StoreErrorKind, message: String) -> ToolError {
        match kind {
            StoreErrorKind::InvalidDocument => ToolError::InvalidInput(message),
            StoreErrorKind::QuotaExceeded => ToolError::Rejected(message),
            StoreErrorKind::Unavailable => ToolError::Transient(message),
        }
    }
}

/// Who is calling (mirrors `call-context` in the WIT).
#[derive(Debug, Clone, Default)]
pub struct Context {
    pub saga_id: String,
    pub step_id: String,
    pub attempt: u32,
    pub idempotency_key: String,
}

/// The host's document store (mirrors the `store` interface in the WIT).
pub trait Store {
    fn get(&mut self, ns: &str, key: &str) -> Result<Option<String>, ToolError>;
    fn put(&mut self, ns: &str, key: &str, doc: &str) -> Result<(), ToolError>;
    fn delete(&mut self, ns: &str, key: &str) -> Result<bool, ToolError>;
    fn list(&mut self, ns: &str, prefix: &str) -> Result<Vec<String>, ToolError>;
    /// The documents of `ns` whose keys start with `prefix` and that hold every condition,
    /// as (key, document) pairs in key order: the host filters, so only matches come back.
    fn find(&mut self, ns: &str, prefix: &str, conditions: &[FieldIs]) -> Result<Vec<(String, String)>, ToolError>;
}

/// A condition of [`Store::find`]: the value at `path` (field names from the top) is `value`
/// (JSON text).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldIs {
    pub path: Vec<String>,
    pub value: String,
}

impl FieldIs {
    /// The string at `path` is `value`.
    pub fn string(path: &[&str], value: &str) -> FieldIs {
        FieldIs { path: path.iter().map(|p| p.to_string()).collect(), value: to_json(&Value::from(value)) }
    }
}

/// Documents by (namespace, key), as JSON text, in a map: the store that tests and the native
/// peer benchmark run the tools on outside the host (documents are stored as given).
#[derive(Clone, Debug, Default)]
pub struct MapStore(pub std::collections::HashMap<(String, String), String>);

impl Store for MapStore {
    fn get(&mut self, ns: &str, key: &str) -> Result<Option<String>, ToolError> {
        Ok(self.0.get(&(ns.to_string(), key.to_string())).cloned())
    }
    fn put(&mut self, ns: &str, key: &str, doc: &str) -> Result<(), ToolError> {
        self.0.insert((ns.to_string(), key.to_string()), doc.to_string());
        Ok(())
    }
    fn delete(&mut self, ns: &str, key: &str) -> Result<bool, ToolError> {
        Ok(self.0.remove(&(ns.to_string(), key.to_string())).is_some())
    }
    fn list(&mut self, ns: &str, prefix: &str) -> Result<Vec<String>, ToolError> {
        let mut keys: Vec<String> =
            self.0.keys().filter(|(n, k)| n == ns && k.starts_with(prefix)).map(|(_, k)| k.clone()).collect();
        keys.sort();
        Ok(keys)
    }
    fn find(&mut self, ns: &str, prefix: &str, conditions: &[FieldIs]) -> Result<Vec<(String, String)>, ToolError> {
        find_by_reading(self, ns, prefix, conditions)
    }
}

/// [`Store::find`] by listing and reading every document: for stores that cannot filter
/// themselves (tests, benchmarks). Documents must be canonical, as the host keeps them.
pub fn find_by_reading(
    store: &mut (impl Store + ?Sized),
    ns: &str,
    prefix: &str,
    conditions: &[FieldIs],
) -> Result<Vec<(String, String)>, ToolError> {
    let mut found = Vec::new();
    for key in store.list(ns, prefix)? {
        let Some(text) = store.get(ns, &key)? else { continue };
        if conditions.iter().all(|c| crate::json_text::holds(&text, &c.path, &c.value)) {
            found.push((key, text));
        }
    }
    Ok(found)
}

/// JSON documents on top of [`Store`].
pub trait StoreExt: Store {
    /// The document at `key`, parsed.
    fn doc(&mut self, ns: &str, key: &str) -> Result<Option<Value>, ToolError> {
        match self.get(ns, key)? {
            None => Ok(None),
            Some(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| ToolError::Transient(format!("{ns}/{key} is not JSON: {e}"))),
        }
    }

    /// The document at `key`, or a rejection naming what is missing.
    fn existing(&mut self, ns: &str, key: &str, what: &str) -> Result<Value, ToolError> {
        self.doc(ns, key)?.ok_or_else(|| ToolError::Rejected(format!("no {what} '{key}'")))
    }

    fn put_doc(&mut self, ns: &str, key: &str, doc: &Value) -> Result<(), ToolError> {
        self.put(ns, key, &to_json(doc))
    }
}

impl<S: Store + ?Sized> StoreExt for S {}

/// `value` as JSON text. (`serde_json::to_string` writes straight into a buffer; `Display`
/// goes through `core::fmt` a token at a time, several times slower in wasm.)
pub fn to_json(value: &Value) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

/// One tool as its plugin's manifest describes it.
#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub name: &'static str,
    pub description: &'static str,
    pub schema: Value,
    pub compensator: Option<&'static str>,
    pub side_effects: bool,
}

impl ToolSpec {
    /// A tool that only reads.
    pub fn query(name: &'static str, description: &'static str, schema: Value) -> Self {
        ToolSpec { name, description, schema, compensator: None, side_effects: false }
    }

    /// A tool that changes state and is undone by `compensator`.
    pub fn action(name: &'static str, description: &'static str, schema: Value, compensator: &'static str) -> Self {
        ToolSpec { name, description, schema, compensator: Some(compensator), side_effects: true }
    }

    /// A compensator: it changes state, and nothing undoes it.
    pub fn undo(name: &'static str, description: &'static str, schema: Value) -> Self {
        ToolSpec { name, description, schema, compensator: None, side_effects: true }
    }
}

/// A plugin: a manifest and a dispatcher.
pub trait Plugin {
    fn manifest() -> Vec<ToolSpec>;
    fn call(store: &mut dyn Store, tool: &str, args: &Value, ctx: &Context) -> Result<Value, ToolError>;
}

/// Calls `tool` of plugin `P` on `store` with the idempotency key `key` (the tools' tests).
#[cfg(test)]
pub(crate) fn call_with_key<P: Plugin>(
    store: &mut dyn Store,
    tool: &str,
    args: Value,
    key: &str,
) -> Result<Value, ToolError> {
    let ctx = Context { idempotency_key: key.into(), ..Context::default() };
    P::call(store, tool, &args, &ctx)
}

/// The error for a tool name the plugin does not have.
pub(crate) fn unknown_tool(tool: &str) -> ToolError {
    ToolError::InvalidInput(format!("no tool named '{tool}'"))
}

/// Typed access to a call's arguments object.
pub struct Args<'a>(pub &'a Value);

impl<'a> Args<'a> {
    pub fn str(&self, field: &str) -> Result<&'a str, ToolError> {
        self.opt_str(field).ok_or_else(|| ToolError::InvalidInput(format!("'{field}' must be a string")))
    }

    pub fn opt_str(&self, field: &str) -> Option<&'a str> {
        self.0.get(field).and_then(Value::as_str)
    }

    pub fn count(&self, field: &str, default: u64) -> Result<u64, ToolError> {
        match self.0.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_u64()
                .filter(|n| *n > 0)
                .ok_or_else(|| ToolError::InvalidInput(format!("'{field}' must be a positive integer"))),
        }
    }

    pub fn cents(&self, field: &str) -> Result<i64, ToolError> {
        self.0
            .get(field)
            .and_then(to_cents)
            .filter(|c| *c > 0)
            .ok_or_else(|| ToolError::InvalidInput(format!("'{field}' must be a positive amount")))
    }
}

/// Characters of the idempotency key a record id keeps: 24 hex digits are 96 bits, so among
/// 10^9 records of a long-lived database two ids collide with probability below 10^-11.
pub const RECORD_ID_KEY_CHARS: usize = 24;

/// The id of the record a call creates: `prefix` and the start of its idempotency key.
pub fn record_id(prefix: &str, idempotency_key: &str) -> String {
    // By characters, not bytes: a key given by hand may hold any character. Built with
    // slices rather than `chars().collect()` and `format!`, whose char-at-a-time `fmt::Write`
    // took 14 % of a small call in the guest.
    let end = idempotency_key.char_indices().nth(RECORD_ID_KEY_CHARS).map_or(idempotency_key.len(), |(at, _)| at);
    let mut id = String::with_capacity(prefix.len() + end);
    id.push_str(prefix);
    id.push_str(&idempotency_key[..end]);
    id[prefix.len()..].make_ascii_uppercase();
    id
}

/// The record a compensator must undo: named in its arguments (`id_field`), in the forward
/// step's output, or, when the forward reply was lost, derived from the forward call's
/// idempotency key exactly as the forward tool derived it.
pub fn undo_target(args: &Value, id_field: &str, prefix: &str) -> Result<String, ToolError> {
    let forward = args.get("forward");
    let named = args
        .get(id_field)
        .or_else(|| forward.and_then(|f| f.get("output")).and_then(|o| o.get(id_field)))
        .and_then(Value::as_str);
    if let Some(id) = named {
        return Ok(id.to_string());
    }
    forward
        .and_then(|f| f.get("idempotency_key"))
        .and_then(Value::as_str)
        .map(|key| record_id(prefix, key))
        .ok_or_else(|| ToolError::InvalidInput(format!("need '{id_field}' or the forward call it undoes")))
}

/// The result of a compensator that found nothing to undo (a repeat, or a forward call
/// that never took effect).
pub fn nothing_to_undo(id: &str) -> Value {
    json!({ "undone": false, "id": id, "reason": "nothing to undo" })
}

/// The JSON Schema of a compensator's arguments: the record's id, or the `forward` envelope
/// the host passes to compensators.
pub fn compensator_schema(id_field: &str) -> Value {
    let mut properties = Map::new();
    properties.insert(id_field.to_string(), json!({ "type": "string" }));
    properties.insert(
        "forward".to_string(),
        json!({
            "type": "object",
            "properties": {
                "arguments": { "type": "object" },
                "output": {},
                "idempotency_key": { "type": "string" }
            }
        }),
    );
    json!({
        "type": "object",
        "properties": properties,
        "anyOf": [ { "required": [id_field] }, { "required": ["forward"] } ]
    })
}

/// An amount of money as whole cents, so that charging and refunding restore it exactly.
pub fn to_cents(amount: &Value) -> Option<i64> {
    if let Some(i) = amount.as_i64() {
        return i.checked_mul(100);
    }
    let f = amount.as_f64()?;
    (f.is_finite() && f.abs() < 1e13).then(|| (f * 100.0).round() as i64)
}

/// Cents back to a JSON number: an integer when whole, else a two-decimal float.
pub fn from_cents(cents: i64) -> Value {
    if cents % 100 == 0 { json!(cents / 100) } else { json!(cents as f64 / 100.0) }
}

/// A field holding a count, as u64 (absent or malformed counts as 0).
pub fn count_of(doc: &Value, field: &str) -> u64 {
    doc.get(field).and_then(Value::as_u64).unwrap_or(0)
}

/// `date` (YYYY-MM-DD) plus `days`, or None when `date` is not a date.
pub fn add_days(date: &str, days: i64) -> Option<String> {
    let mut parts = date.splitn(3, '-');
    let y: i64 = parts.next()?.parse().ok()?;
    let m: i64 = parts.next()?.parse().ok()?;
    let d: i64 = parts.next()?.parse().ok()?;
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return None;
    }
    let (y, m, d) = civil_from_days(days_from_civil(y, m, d) + days);
    Some(format!("{y:04}-{m:02}-{d:02}"))
}

// Howard Hinnant's algorithms for the proleptic Gregorian calendar.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146097 + doe - 719468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_roll_over_months_and_leap_years() {
        assert_eq!(add_days("2024-02-28", 1).as_deref(), Some("2024-02-29"));
        assert_eq!(add_days("2023-02-28", 1).as_deref(), Some("2023-03-01"));
        assert_eq!(add_days("2024-12-31", 1).as_deref(), Some("2025-01-01"));
        assert_eq!(add_days("2024-05-16", 0).as_deref(), Some("2024-05-16"));
        assert_eq!(add_days("not-a-date", 1), None);
    }

    #[test]
    fn cents_round_trip_keeps_integers_integral() {
        assert_eq!(to_cents(&json!(200)), Some(20000));
        assert_eq!(to_cents(&json!(100.1)), Some(10010));
        assert_eq!(from_cents(20000), json!(200));
        assert_eq!(from_cents(10010), json!(100.1));
        let restored = from_cents(to_cents(&json!(100.1)).unwrap() - 3333 + 3333);
        assert_eq!(restored, json!(100.1));
    }

    #[test]
    fn undo_target_prefers_named_id_then_output_then_key() {
        let key = "abcdef0123456789";
        assert_eq!(undo_target(&json!({"id": "X"}), "id", "R").unwrap(), "X");
        let envelope = json!({"forward": {"output": {"id": "Y"}, "idempotency_key": key}});
        assert_eq!(undo_target(&envelope, "id", "R").unwrap(), "Y");
        let lost = json!({"forward": {"output": null, "idempotency_key": key}});
        assert_eq!(undo_target(&lost, "id", "R").unwrap(), "RABCDEF0123456789");
        assert!(undo_target(&json!({}), "id", "R").is_err());
    }

    #[test]
    fn record_ids_keep_enough_of_the_key_that_a_collision_is_negligible_at_a_billion_records() {
        let key = "0123456789abcdef".repeat(4);
        let id = record_id("R", &key);
        let kept = &id[1..];
        assert!(kept.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
        assert_eq!(kept.len(), RECORD_ID_KEY_CHARS, "{id}");
        assert_eq!(RECORD_ID_KEY_CHARS, 24);
        // Birthday bound: n records with b random bits collide with probability <= n^2 / 2^(b+1).
        let (records, bits) = (1e9_f64, 4 * kept.len() as i32);
        let bound = records * records / 2f64.powi(bits + 1);
        assert!(bound < 1e-9, "{bits} bits: collision probability up to {bound:e} at 10^9 records");
    }

    #[test]
    fn record_ids_never_split_a_character_of_an_unusual_key() {
        let key = format!("a{}", "é".repeat(30));
        assert_eq!(record_id("R", &key), format!("RA{}", "é".repeat(23)).to_ascii_uppercase());
        assert_eq!(record_id("R", "short"), "RSHORT");
    }
}
