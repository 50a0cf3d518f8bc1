//! Canonical JSON: the one text form of a document that the store keeps, hashes and compares.
//!
//! Object keys are sorted by their UTF-8 bytes, there is no insignificant white space, and a
//! number with no fractional part is written as an integer (`200.0` and `200` are the same
//! amount, so they must be the same text, or a refund that restores the amount would look
//! like a change).

use std::borrow::Cow;

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

/// Parses `text` and returns its canonical form: `text` itself when it already is.
pub fn canonicalize(text: &str) -> Result<Cow<'_, str>, serde_json::Error> {
    // Tools mostly write what a serializer with sorted maps produced: checking that costs one
    // scan, where parsing and printing again builds and frees a tree. A number written
    // otherwise than canonically (Python's `71.0` for a whole amount) is rewritten in place.
    // Borrowed, so that a store write copies the text once, into the document it keeps.
    match scan(text) {
        Some(fixes) if fixes.is_empty() => Ok(Cow::Borrowed(text)),
        Some(fixes) => Ok(Cow::Owned(splice(text, &fixes))),
        None => reprint(text).map(Cow::Owned),
    }
}

/// Parses `text` and prints it canonically: what `canonicalize` means.
fn reprint(text: &str) -> Result<String, serde_json::Error> {
    let mut value: Value = serde_json::from_str(text)?;
    normalize_numbers(&mut value);
    Ok(to_text(&value))
}

/// Nesting deeper than this is left to the parser (which refuses past 128 levels).
const MAX_SCANNED_DEPTH: usize = 64;

/// A number to rewrite: its byte range in the text and its canonical form.
type Fix = (std::ops::Range<usize>, String);

/// Whether `text` is canonical but for the numbers to rewrite, checked in one pass that
/// builds nothing. `None` means only "not proven": escapes, unsorted keys, white space or
/// invalid JSON all go to [`reprint`], which decides.
fn scan(text: &str) -> Option<Vec<Fix>> {
    let mut scan = Scanner { bytes: text.as_bytes(), at: 0, fixes: Vec::new() };
    (scan.value(0) && scan.at == scan.bytes.len()).then_some(scan.fixes)
}

/// Whether `text` is already canonical.
#[cfg(test)]
fn is_canonical(text: &str) -> bool {
    scan(text).is_some_and(|fixes| fixes.is_empty())
}

/// `text` with each fixed range replaced (the fixes in text order).
fn splice(text: &str, fixes: &[Fix]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut from = 0;
    for (range, number) in fixes {
        out.push_str(&text[from..range.start]);
        out.push_str(number);
        from = range.end;
    }
    out.push_str(&text[from..]);
    out
}

struct Scanner<'a> {
    bytes: &'a [u8],
    at: usize,
    fixes: Vec<Fix>,
}

impl<'a> Scanner<'a> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn eat(&mut self, byte: u8) -> bool {
        let found = self.peek() == Some(byte);
        self.at += usize::from(found);
        found
    }

    fn value(&mut self, depth: usize) -> bool {
        match self.peek() {
            Some(b'{') => depth < MAX_SCANNED_DEPTH && self.object(depth + 1),
            Some(b'[') => depth < MAX_SCANNED_DEPTH && self.array(depth + 1),
            Some(b'"') => self.string().is_some(),
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => false,
        }
    }

    fn object(&mut self, depth: usize) -> bool {
        self.at += 1;
        if self.eat(b'}') {
            return true;
        }
        let mut previous: Option<&[u8]> = None;
        loop {
            let Some(key) = self.string() else { return false };
            // Strictly increasing: a repeated key is one the parse would drop.
            if previous.is_some_and(|p| p >= key) {
                return false;
            }
            previous = Some(key);
            if !self.eat(b':') || !self.value(depth) {
                return false;
            }
            if self.eat(b'}') {
                return true;
            }
            if !self.eat(b',') {
                return false;
            }
        }
    }

    fn array(&mut self, depth: usize) -> bool {
        self.at += 1;
        if self.eat(b']') {
            return true;
        }
        loop {
            if !self.value(depth) {
                return false;
            }
            if self.eat(b']') {
                return true;
            }
            if !self.eat(b',') {
                return false;
            }
        }
    }

    /// The contents of a string with no escape and no control character (the printer writes
    /// those verbatim; anything else is left to the parse).
    fn string(&mut self) -> Option<&'a [u8]> {
        if !self.eat(b'"') {
            return None;
        }
        let start = self.at;
        // Sixteen bytes at a time: most of a document's text is in its strings.
        let end = sagabox_toolkit::json_text::next_quote_escape_or_control(self.bytes, start);
        self.at = end;
        self.eat(b'"').then(|| &self.bytes[start..end])
    }

    fn literal(&mut self, word: &[u8]) -> bool {
        let found = self.bytes[self.at..].starts_with(word);
        self.at += if found { word.len() } else { 0 };
        found
    }

    /// An integer the parse reads into an i64 or u64 prints as written, unless it has a
    /// leading zero or is `-0`; any other number is canonical if printing it again gives it
    /// back, and is noted for rewriting if that gives another valid number. A number's
    /// canonical form does not depend on where it stands, so rewriting it alone is what a
    /// parse and print of the whole document does to it.
    fn number(&mut self) -> bool {
        let start = self.at;
        let length =
            self.bytes[start..].iter().position(|b| !matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'));
        self.at = start + length.unwrap_or(self.bytes.len() - start);
        // Cannot fail: the token is ASCII.
        let token = std::str::from_utf8(&self.bytes[start..self.at]).unwrap_or_default();
        let digits = token.strip_prefix('-').unwrap_or(token);
        let plain = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit());
        if plain {
            let leading_zero = digits.len() > 1 && digits.starts_with('0');
            let fits = if token.starts_with('-') { token.parse::<i64>().is_ok() } else { token.parse::<u64>().is_ok() };
            if fits && !leading_zero && token != "-0" {
                return true;
            }
        }
        match reprint(token) {
            Ok(printed) if printed == token => true,
            Ok(printed) => {
                self.fixes.push((start..self.at, printed));
                true
            }
            Err(_) => false,
        }
    }
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

/// A stored document as its canonical text, shared with the store rather than parsed: a run
/// report carries every document its run changed, and most readers only need which ones.
/// It serializes as the JSON it holds (an object, not a string of one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DocText(std::sync::Arc<str>);

impl DocText {
    /// `text` must be canonical JSON, as the store keeps it.
    pub fn new(text: impl Into<std::sync::Arc<str>>) -> DocText {
        DocText(text.into())
    }

    pub fn text(&self) -> &str {
        &self.0
    }

    /// The document as a tree.
    pub fn parse(&self) -> Result<Value, serde_json::Error> {
        serde_json::from_str(&self.0)
    }
}

/// `text` (a document) to be written out as the JSON it holds, borrowed: validated without
/// building a tree or copying it (serde_json skips nesting without recursing).
pub fn as_raw<E: serde::ser::Error>(text: &str) -> Result<&serde_json::value::RawValue, E> {
    serde_json::from_str(text).map_err(E::custom)
}

impl serde::Serialize for DocText {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        as_raw::<S::Error>(&self.0)?.serialize(serializer)
    }
}

impl<'de> serde::Deserialize<'de> for DocText {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<DocText, D::Error> {
        let raw = Box::<serde_json::value::RawValue>::deserialize(deserializer)?;
        Ok(DocText(std::sync::Arc::from(raw.get())))
    }
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    lower_hex(&Sha256::digest(bytes))
}

/// Lower-case hex of `bytes`. `hex::encode` collects one `char` at a time: 209 ns for a
/// 32-byte digest, two fifths of a step's idempotency key (BENCHMARKS item 35).
pub fn lower_hex(bytes: &[u8]) -> String {
    let mut text = vec![0; bytes.len() * 2];
    // Neither can fail: `text` is twice as long as `bytes`, and hex digits are ASCII.
    let _ = hex::encode_to_slice(bytes, &mut text);
    String::from_utf8(text).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn hex_is_lower_case_two_digits_a_byte() {
        assert_eq!(lower_hex(&[]), "");
        assert_eq!(lower_hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        assert_eq!(sha256_hex(b""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    }

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
    fn a_canonical_text_comes_back_borrowed_and_any_other_rewritten() {
        let text = r#"{"a":[1,"bé"],"c":{"d":null}}"#;
        assert!(matches!(canonicalize(text).unwrap(), Cow::Borrowed(t) if std::ptr::eq(t, text)));
        for other in [r#"{"b":1,"a":2}"#, r#"{"a":1.0}"#, r#"{"a":"x\ny"}"#, "{\"a\": 1}"] {
            assert!(matches!(canonicalize(other).unwrap(), Cow::Owned(_)), "{other}");
        }
        // A raw control byte in a string is not JSON, wherever it stands in a long string.
        let long = "x".repeat(40);
        for at in [0, 7, 8, 15, 16, 39] {
            let text = format!("[\"{}\u{1f}{}\"]", &long[..at], &long[at..]);
            assert!(canonicalize(&text).is_err(), "{text:?}");
        }
    }

    #[test]
    fn numbers_printed_otherwise_are_rewritten_without_a_parse() {
        let text = r#"{"a":71.0,"b":[1.50,2E2,-0,3],"c":"7.0"}"#;
        let fixes = scan(text).expect("one scan suffices");
        assert_eq!(fixes.len(), 4, "{fixes:?}");
        assert_eq!(canonicalize(text).unwrap(), r#"{"a":71,"b":[1.5,200,0,3],"c":"7.0"}"#);
        assert_eq!(canonicalize(text).unwrap(), reprint(text).unwrap());
        for invalid in ["[01]", "[1.]", "[1e]", "[1-2]", "[1e400]"] {
            assert!(scan(invalid).is_none() && canonicalize(invalid).is_err(), "{invalid}");
        }
    }

    #[test]
    fn a_doc_text_is_written_as_the_json_it_holds_and_read_back_from_text_or_a_tree() {
        let doc = DocText::new(r#"{"a":[1,{"b":"x\"y"}],"n":2.5}"#);
        let report = json!({ "after": doc });
        assert_eq!(report, json!({ "after": { "a": [1, { "b": "x\"y" }], "n": 2.5 } }));
        assert_eq!(serde_json::to_string(&doc).unwrap(), doc.text());
        assert_eq!(serde_json::from_str::<DocText>(doc.text()).unwrap(), doc);
        assert_eq!(serde_json::from_value::<DocText>(report["after"].clone()).unwrap(), doc);
        assert_eq!(doc.parse().unwrap()["n"], 2.5);
        // Deeper than serde_json builds a tree: still written out whole.
        let deep = DocText::new(format!("{}{}", "[".repeat(300), "]".repeat(300)));
        assert_eq!(serde_json::to_string(&deep).unwrap(), deep.text());
    }

    #[test]
    fn invalid_json_is_an_error() {
        assert!(canonicalize("{").is_err());
    }

    #[test]
    fn canonical_text_is_recognised_without_a_parse() {
        let doc = json!({"a": [1, -2, 18446744073709551615u64, 2.5, 1e300, true, null], "b": {"": "é x"}, "c": []});
        assert!(is_canonical(&canonical(&doc)), "{}", canonical(&doc));
        for text in [
            "[1.0]",
            "[1e2]",
            "-0",
            "[01]",
            r#"{"b":1,"a":2}"#,
            r#"{"a":1,"a":2}"#,
            "[1, 2]",
            r#"["\u0041"]"#,
            "1 ",
            "[1,]",
        ] {
            assert!(!is_canonical(text), "{text} taken as canonical");
        }
    }

    /// Any JSON value, including what canonical printing rewrites: whole floats, escapes,
    /// integers past i64.
    fn any_value() -> impl Strategy<Value = Value> {
        let text = "[ab\"\\\\\n\u{1}\u{e9}\u{7f}/]{0,3}";
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
            (-1000i32..1000).prop_map(|i| Value::from(f64::from(i) / 4.0)),
            text.prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 32, 4, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                proptest::collection::btree_map(text, inner, 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// JSON-ish texts: values printed canonically, pretty or with one character cut or
    /// added, and objects whose keys come in any order (repeats included).
    fn any_text() -> impl Strategy<Value = String> {
        // Pretty, canonical, or compact as serde_json (and Python) print it: whole floats as `2.0`.
        let printed = || {
            (any_value(), 0..3u8).prop_map(|(v, how)| match how {
                0 => serde_json::to_string_pretty(&v).unwrap(),
                1 => canonical(&v),
                _ => serde_json::to_string(&v).unwrap(),
            })
        };
        let edited = (
            printed(),
            any::<usize>(),
            proptest::option::of(proptest::sample::select(vec![
                ' ', ',', '0', '-', '"', '}', ']', '.', 'e', '\\', ':', '1',
            ])),
        )
            .prop_map(|(text, at, insert)| {
                let mut chars: Vec<char> = text.chars().collect();
                let at = at % (chars.len() + 1);
                match insert {
                    Some(c) => chars.insert(at, c),
                    None if at < chars.len() => drop(chars.remove(at)),
                    None => {}
                }
                chars.into_iter().collect()
            });
        let keyed = proptest::collection::vec(("[abc]{0,2}", any_value()), 0..5).prop_map(|fields| {
            let fields: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\":{}", canonical(v))).collect();
            format!("{{{}}}", fields.join(","))
        });
        prop_oneof![printed(), edited, keyed]
    }

    proptest::proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// The shortcut for canonical text changes nothing: every text canonicalizes (or is
        /// refused) exactly as a full parse and print does.
        #[test]
        fn canonicalize_agrees_with_parsing_and_printing(text in any_text()) {
            proptest::prop_assert_eq!(canonicalize(&text).ok().map(Cow::into_owned), reprint(&text).ok());
        }

        /// Everything the store writes is recognised as canonical, so it takes the shortcut.
        #[test]
        fn canonical_text_without_escapes_takes_the_shortcut(value in any_value()) {
            let text = canonical(&value);
            if !text.bytes().any(|b| b == b'\\' || b < 0x20) {
                proptest::prop_assert!(is_canonical(&text), "{}", text);
            }
        }
    }
}
