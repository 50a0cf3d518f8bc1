//! Canonical JSON: the one text form of a document that the store keeps, hashes and compares.
//!
//! Object keys are sorted by their UTF-8 bytes, there is no insignificant white space, and a
//! number with no fractional part is written as an integer (`200.0` and `200` are the same
//! amount, so they must be the same text, or a refund that restores the amount would look
//! like a change).

use std::fmt::Write as _;

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The largest integer an f64 holds exactly.
const EXACT_F64_INT: f64 = 9_007_199_254_740_992.0;

/// `value` as canonical JSON text.
pub fn canonical(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

/// Parses `text` and returns its canonical form.
pub fn canonicalize(text: &str) -> Result<String, serde_json::Error> {
    Ok(canonical(&serde_json::from_str::<Value>(text)?))
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Null | Value::Bool(_) | Value::String(_) => out.push_str(&value.to_string()),
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < EXACT_F64_INT => {
                let _ = write!(out, "{}", f as i64);
            }
            _ => out.push_str(&n.to_string()),
        },
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            // serde_json's default map is a BTreeMap: iteration is already in key order.
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                write_canonical(item, out);
            }
            out.push('}');
        }
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
