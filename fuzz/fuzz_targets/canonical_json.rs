//! Canonical JSON (`sagabox::json`): the canonical text of a value is a fixpoint
//! (canonical(parse(canonical(x))) == canonical(x)), `canonicalize(text)` agrees with
//! `canonical(parse(text))`, and equal values have equal text.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sagabox::json::{canonical, canonicalize};
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(value) = serde_json::from_str::<Value>(text) else {
        assert!(canonicalize(text).is_err(), "canonicalize accepted what serde_json refuses");
        return;
    };
    let once = canonical(&value);
    let reparsed: Value = serde_json::from_str(&once).expect("canonical text is JSON");
    let twice = canonical(&reparsed);
    assert_eq!(once, twice, "canonical text is not a fixpoint");
    assert_eq!(canonicalize(text).expect("canonicalize parses what serde_json parses"), once);
    assert_eq!(canonicalize(&once).unwrap(), once);
});
