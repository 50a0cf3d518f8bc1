//! Canonical JSON: the one text form of a document that the store keeps, hashes and compares.
//!
//! Object keys are sorted by their UTF-8 bytes, there is no insignificant white space, and a
//! number with no fractional part is written as an integer (`200.0` and `200` are the same
//! amount, so they must be the same text, or a refund that restores the amount would look
//! like a change).

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The largest integer an f64 holds exactly.
const EXACT_F64_INT: f64 = 9_007_199_254_740_992.0;

/// `value` as canonical JSON text.
pub fn canonical(value: &Value) -> String {
    if has_whole_floats(value) {
        let mut normalized = value.clone();
        normalize_numbers(&mut normalized);
        return to_text(&normalized);
    }
    to_text(value)
}

/// Parses `text` and returns its canonical form.
pub fn canonicalize(text: &str) -> Result<String, serde_json::Error> {
    let mut value: Value = serde_json::from_str(text)?;
    normalize_numbers(&mut value);
    Ok(to_text(&value))
}

/// serde_json's compact writer: with its default (sorted) maps this is already canonical
/// for everything but whole-number floats, which `normalize_numbers` turns into integers.
fn to_text(value: &Value) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

fn whole(n: &serde_json::Number) -> Option<i64> {
    let f = n.as_f64()?;
    (n.is_f64() && f.fract() == 0.0 && f.abs() < EXACT_F64_INT).then_some(f as i64)
}

fn has_whole_floats(value: &Value) -> bool {
    match value {
        Value::Number(n) => whole(n).is_some(),
        Value::Array(items) => items.iter().any(has_whole_floats),
        Value::Object(map) => map.values().any(has_whole_floats),
        _ => false,
    }
}

fn normalize_numbers(value: &mut Value) {
    match value {
        Value::Number(n) => {
            if let Some(i) = whole(n) {
                *value = Value::from(i);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(normalize_numbers),
        Value::Object(map) => map.values_mut().for_each(normalize_numbers),
        _ => {}
    }
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_are_sorted_and_space_removed() {
        let text = r#"{ "b": 1, "a": { "d": [1, 2], "c": null } }"#;
        assert_eq!(canonicalize(text).unwrap(), r#"{"a":{"c":null,"d":[1,2]},"b":1}"#);
    }

    #[test]
    fn whole_floats_become_integers_and_fractions_stay() {
        assert_eq!(canonical(&json!(200.0)), "200");
        assert_eq!(canonical(&json!(-3.0)), "-3");
        assert_eq!(canonical(&json!(100.1)), "100.1");
        assert_eq!(canonical(&json!(1e300)), json!(1e300).to_string());
    }

    #[test]
    fn strings_are_escaped() {
        assert_eq!(canonical(&json!({"k\"": "a\nb"})), r#"{"k\"":"a\nb"}"#);
    }

    #[test]
    fn invalid_json_is_an_error() {
        assert!(canonicalize("{").is_err());
    }
}
