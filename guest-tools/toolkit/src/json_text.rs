//! Reading JSON documents as the store keeps them (canonical text: sorted keys, no white
//! space) without parsing them whole: where the value at a path sits, an object's members,
//! and whether a document holds a value at a path, the test behind `store.find`.

use serde_json::Value;

use crate::common::to_json;

/// Whether `text`, a document as the store keeps it, holds `value` at `path` (field names
/// from the top; empty: the whole document). Both are canonical JSON text (the host makes a
/// condition's value canonical before it compares), so equal values are equal texts.
pub fn holds(text: &str, path: &[impl AsRef<str>], value: &str) -> bool {
    match span_at(text, path) {
        Span::At(range) => text[range] == *value,
        Span::Missing => false,
        Span::Unreadable => {
            let Ok(doc) = serde_json::from_str::<Value>(text) else { return false };
            let found = path.iter().try_fold(&doc, |v, p| v.get(p.as_ref()));
            found.is_some_and(|v| to_json(v) == value)
        }
    }
}

/// Where a value sits in a document's text (see [`span_at`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Span {
    /// The value's text.
    At(std::ops::Range<usize>),
    /// Nothing there: a field is missing, or what should hold it is not an object.
    Missing,
    /// The text is not what the scanner reads (escaped keys, not JSON): parse it whole.
    Unreadable,
}

/// Where the value at `path` (field names from the top) sits in `text`, a JSON document as the
/// store keeps it (canonical, so no key appears twice in an object), without parsing it.
pub(crate) fn span_at(text: &str, path: &[impl AsRef<str>]) -> Span {
    span_within(text, Scan(text).space(0)..text.trim_end().len(), path)
}

/// [`span_at`] from the value at `range` of `text` (a span found before) rather than from the top.
pub(crate) fn span_within(text: &str, mut range: std::ops::Range<usize>, path: &[impl AsRef<str>]) -> Span {
    let scan = Scan(text);
    for field in path {
        if text.as_bytes().get(range.start) != Some(&b'{') {
            return Span::Missing;
        }
        let mut found = None;
        let complete = scan.each_member(range.start, |key, value| {
            let hit = key == field.as_ref();
            if hit {
                found = Some(value);
            }
            !hit
        });
        match (found, complete) {
            (Some(value), _) => range = value,
            (None, Some(())) => return Span::Missing,
            (None, None) => return Span::Unreadable,
        }
    }
    Span::At(range)
}

/// The members of the JSON object `text` (valid JSON, as the store keeps it): each key and
/// the text of its value, in order. None when `text` is not an object or a key has escapes.
pub fn members(text: &str) -> Option<Vec<(&str, &str)>> {
    let scan = Scan(text);
    let mut found = Vec::new();
    scan.each_member(scan.space(0), |key, value| {
        found.push((key, &text[value]));
        true
    })?;
    Some(found)
}

/// Where the top-level fields `names` of `text` (as the store keeps it) sit, in one pass;
/// None when the scanner does not read `text` (not an object, escaped keys).
pub(crate) fn top_fields(text: &str, names: &[&str]) -> Option<Vec<Option<std::ops::Range<usize>>>> {
    let scan = Scan(text);
    let mut found = vec![None; names.len()];
    scan.each_member(scan.space(0), |field, value| {
        for (name, slot) in names.iter().zip(found.iter_mut()) {
            if *name == field {
                *slot = Some(value.clone());
            }
        }
        true
    })?;
    Some(found)
}

/// The first index from `i` of a `"` or a `\\` in `bytes` (`bytes.len()` if none): where a
/// string's text stops.
fn next_quote_or_escape(bytes: &[u8], i: usize) -> usize {
    next_string_stop::<false>(bytes, i)
}

/// The first index from `i` of a `"`, a `\\` or a control byte (below 0x20) in `bytes`
/// (`bytes.len()` if none): where a string that JSON allows unescaped stops. The host's
/// canonical check reads strings with it.
pub fn next_quote_escape_or_control(bytes: &[u8], i: usize) -> usize {
    next_string_stop::<true>(bytes, i)
}

/// The first index from `i` of a `"` or a `\\` (and a control byte, with `CONTROLS`) in
/// `bytes`, `bytes.len()` if none. Sixteen bytes at a time on wasm32 with `simd128` (the
/// plugins build with it) and on x86-64 (a twin with SSE2: the native build, whose tests check
/// this loop; the wasm twin is checked only through the plugins' own tests), eight elsewhere:
/// most of a document's text is inside strings, and a byte loop costs several WebAssembly
/// instructions per byte. (A search for the next bracket outside strings burned more fuel
/// than the byte loop: they are too close together. `Scan::container_end` reads all of a
/// chunk's brackets at once instead.)
#[inline(always)]
fn next_string_stop<const CONTROLS: bool>(bytes: &[u8], mut i: usize) -> usize {
    #[cfg(any(all(target_arch = "wasm32", target_feature = "simd128"), target_arch = "x86_64"))]
    // `get(i..i + 16)` and a conversion that cannot fail: `get(i..)` with `first_chunk`
    // reads better but took back most of the fuel this loop saves (tried).
    while let Some(chunk) = bytes.get(i..i + 16) {
        let found = stop_mask16::<CONTROLS>(chunk.try_into().unwrap_or(&[0; 16]));
        if found != 0 {
            return i + found.trailing_zeros() as usize;
        }
        i += 16;
    }
    while let Some(chunk) = bytes.get(i..i + 8) {
        let found = stop_mask8::<CONTROLS>(u64::from_le_bytes(chunk.try_into().unwrap_or_default()));
        if found != 0 {
            return i + (found.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while bytes.get(i).is_some_and(|&b| !(b == b'"' || b == b'\\' || (CONTROLS && b < 0x20))) {
        i += 1;
    }
    i.min(bytes.len())
}

/// Bit `n` set when byte `n` of `chunk` is a `"` or a `\\` (or, with `CONTROLS`, below 0x20).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn stop_mask16<const CONTROLS: bool>(chunk: &[u8; 16]) -> u32 {
    use core::arch::wasm32::{u8x16_bitmask, u8x16_eq, u8x16_lt, u8x16_splat, v128, v128_or};
    // SAFETY: `chunk` is 16 readable bytes, read unaligned.
    let x = unsafe { core::ptr::read_unaligned(chunk.as_ptr().cast::<v128>()) };
    let mut found = v128_or(u8x16_eq(x, u8x16_splat(b'"')), u8x16_eq(x, u8x16_splat(b'\\')));
    if CONTROLS {
        found = v128_or(found, u8x16_lt(x, u8x16_splat(0x20)));
    }
    u32::from(u8x16_bitmask(found))
}

/// Bit `n` set when byte `n` of `chunk` is a `"` or a `\\` (or, with `CONTROLS`, below 0x20).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn stop_mask16<const CONTROLS: bool>(chunk: &[u8; 16]) -> u32 {
    use core::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi8,
    };
    // SAFETY: SSE2 is part of x86-64; `chunk` is 16 readable bytes, read unaligned.
    unsafe {
        let x = _mm_loadu_si128(chunk.as_ptr().cast::<__m128i>());
        let mut found =
            _mm_or_si128(_mm_cmpeq_epi8(x, _mm_set1_epi8(b'"' as i8)), _mm_cmpeq_epi8(x, _mm_set1_epi8(b'\\' as i8)));
        if CONTROLS {
            // Unsigned `x <= 0x1f`: SSE2 compares bytes as signed, but has an unsigned minimum.
            found = _mm_or_si128(found, _mm_cmpeq_epi8(_mm_min_epu8(x, _mm_set1_epi8(0x1f)), x));
        }
        _mm_movemask_epi8(found) as u32
    }
}

/// The high bit of each byte of `x` that is a `"` or a `\\` (or, with `CONTROLS`, below
/// 0x20): exact for the lowest byte set, the only one read (a borrow may also set it in bytes
/// above a match).
#[inline(always)]
fn stop_mask8<const CONTROLS: bool>(x: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = ONES << 7;
    let equal = |b: u8| {
        let y = x ^ (ONES * b as u64);
        y.wrapping_sub(ONES) & !y & HIGH
    };
    let found = equal(b'"') | equal(b'\\');
    if !CONTROLS {
        return found;
    }
    // Bytes below 0x20 borrow when 0x20 is taken from them; `!x` keeps out bytes of 0x80 and
    // more, whose high bit is already set.
    found | (x.wrapping_sub(ONES * 0x20) & !x & HIGH)
}

/// Where a 16-byte chunk holds a `"`, a `\\`, a `{` or `[`, and a `}` or `]`: bit `n` for byte `n`.
#[cfg(any(all(target_arch = "wasm32", target_feature = "simd128"), target_arch = "x86_64"))]
struct Marks {
    quotes: u32,
    escapes: u32,
    opens: u32,
    closes: u32,
}

/// `[` and `{` (`]` and `}`) differ only in bit 0x20: setting it folds each pair into one
/// comparison, and no other byte folds onto them.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn marks16(chunk: &[u8; 16]) -> Marks {
    use core::arch::wasm32::{u8x16_bitmask, u8x16_eq, u8x16_splat, v128, v128_or};
    // SAFETY: `chunk` is 16 readable bytes, read unaligned.
    let x = unsafe { core::ptr::read_unaligned(chunk.as_ptr().cast::<v128>()) };
    let folded = v128_or(x, u8x16_splat(0x20));
    let mask = |v, b: u8| u32::from(u8x16_bitmask(u8x16_eq(v, u8x16_splat(b))));
    Marks { quotes: mask(x, b'"'), escapes: mask(x, b'\\'), opens: mask(folded, b'{'), closes: mask(folded, b'}') }
}

/// [`marks16`] with SSE2, for the native build (whose tests check it).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn marks16(chunk: &[u8; 16]) -> Marks {
    use core::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi8,
    };
    // SAFETY: SSE2 is part of x86-64; `chunk` is 16 readable bytes, read unaligned.
    unsafe {
        let x = _mm_loadu_si128(chunk.as_ptr().cast::<__m128i>());
        let folded = _mm_or_si128(x, _mm_set1_epi8(0x20));
        let mask = |v, b: u8| _mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(b as i8))) as u32;
        Marks { quotes: mask(x, b'"'), escapes: mask(x, b'\\'), opens: mask(folded, b'{'), closes: mask(folded, b'}') }
    }
}

/// Bit `n` of the result: the parity of the bits `0..=n` of `bits` (16 of them), i.e. whether
/// byte `n` of a chunk whose quotes `bits` marks is inside a string that opened in it.
#[cfg(any(all(target_arch = "wasm32", target_feature = "simd128"), target_arch = "x86_64"))]
#[inline(always)]
fn prefix_xor16(mut bits: u32) -> u32 {
    bits ^= bits << 1;
    bits ^= bits << 2;
    bits ^= bits << 4;
    bits ^= bits << 8;
    bits & 0xffff
}

/// What a chunk does to the value being skipped.
#[cfg(any(all(target_arch = "wasm32", target_feature = "simd128"), target_arch = "x86_64"))]
enum Chunk {
    /// It ends there: the index in the chunk just past its last bracket.
    Ends(usize),
    /// It goes on, this deep, in a string or not, after the chunk.
    Goes { depth: usize, in_string: bool },
}

/// What a chunk without backslashes (`marks`) does to a value `depth` deep. Only brackets
/// outside strings count; they are taken one by one only when there are enough closing ones
/// to end the value.
#[cfg(any(all(target_arch = "wasm32", target_feature = "simd128"), target_arch = "x86_64"))]
#[inline(always)]
fn end_in_chunk(marks: &Marks, mut depth: usize, in_string: bool) -> Chunk {
    let inside = prefix_xor16(marks.quotes) ^ if in_string { 0xffff } else { 0 };
    let (opens, closes) = (marks.opens & !inside, marks.closes & !inside);
    if (closes.count_ones() as usize) < depth {
        depth = depth + opens.count_ones() as usize - closes.count_ones() as usize;
    } else {
        let mut brackets = opens | closes;
        while brackets != 0 {
            let at = brackets.trailing_zeros();
            if closes & (1 << at) == 0 {
                depth += 1;
            } else {
                depth -= 1;
                if depth == 0 {
                    return Chunk::Ends(at as usize + 1);
                }
            }
            brackets &= brackets - 1;
        }
    }
    Chunk::Goes { depth, in_string: inside & 0x8000 != 0 }
}

/// Reads the structure of JSON text without building anything.
struct Scan<'t>(&'t str);

impl<'t> Scan<'t> {
    fn bytes(&self) -> &'t [u8] {
        self.0.as_bytes()
    }

    /// The first index from `i` that is not white space.
    fn space(&self, mut i: usize) -> usize {
        while self.bytes().get(i).is_some_and(u8::is_ascii_whitespace) {
            i += 1;
        }
        i
    }

    /// The index just past the string that starts at `i` (its opening quote).
    fn string_end(&self, mut i: usize) -> Option<usize> {
        i += 1;
        loop {
            i = next_quote_or_escape(self.bytes(), i);
            match self.bytes().get(i)? {
                b'\\' => i += 2,
                _ => return Some(i + 1),
            }
        }
    }

    /// The index just past the value that starts at `i`.
    fn value_end(&self, i: usize) -> Option<usize> {
        match self.bytes().get(i)? {
            b'"' => self.string_end(i),
            b'{' | b'[' => self.container_end(i),
            _ => {
                let mut j = i;
                while self.bytes().get(j).is_some_and(|b| !matches!(b, b',' | b'}' | b']') && !b.is_ascii_whitespace())
                {
                    j += 1;
                }
                Some(j)
            }
        }
    }

    /// The index just past the object or array that starts at `i`. Sixteen bytes at a time
    /// where a chunk holds no backslash: its quotes' running parity says which of its brackets
    /// are inside strings, and only the others are counted, one set bit each. A byte loop
    /// (with a call per string) cost several WebAssembly instructions per byte, and skipping
    /// what a lookup does not want is most of reading a large document (tau2's flights).
    fn container_end(&self, i: usize) -> Option<usize> {
        let bytes = self.bytes();
        let (mut depth, mut in_string, mut j) = (1usize, false, i + 1);
        loop {
            #[cfg(any(all(target_arch = "wasm32", target_feature = "simd128"), target_arch = "x86_64"))]
            if let Some(marks) = bytes.get(j..j + 16).map(|c| marks16(c.try_into().unwrap_or(&[0; 16])))
                && marks.escapes == 0
            {
                match end_in_chunk(&marks, depth, in_string) {
                    Chunk::Ends(end) => return Some(j + end),
                    Chunk::Goes { depth: after, in_string: inside } => (depth, in_string) = (after, inside),
                }
                j += 16;
                continue;
            }
            // A byte at a time to the end of this chunk (and past it by an escape's second byte).
            let until = j + 16;
            while j < until {
                match (in_string, *bytes.get(j)?) {
                    (true, b'\\') => j += 1,
                    (true, b'"') => in_string = false,
                    (false, b'"') => in_string = true,
                    (false, b'{' | b'[') => depth += 1,
                    (false, b'}' | b']') => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
    }

    /// Calls `visit` with each key of the object that starts at `i` and its value's range,
    /// in order, while it returns true. None when there is no object there or a key has
    /// escapes (before `visit` stopped).
    fn each_member(&self, i: usize, mut visit: impl FnMut(&'t str, std::ops::Range<usize>) -> bool) -> Option<()> {
        let bytes = self.bytes();
        if bytes.get(i) != Some(&b'{') {
            return None;
        }
        let mut i = self.space(i + 1);
        if bytes.get(i) == Some(&b'}') {
            return Some(());
        }
        loop {
            if bytes.get(i) != Some(&b'"') {
                return None;
            }
            let key_end = self.string_end(i)?;
            let key = &self.0[i + 1..key_end - 1];
            if key.contains('\\') {
                return None;
            }
            i = self.space(key_end);
            if bytes.get(i) != Some(&b':') {
                return None;
            }
            let start = self.space(i + 1);
            let end = self.value_end(start)?;
            if !visit(key, start..end) {
                return Some(());
            }
            i = self.space(end);
            match bytes.get(i)? {
                b',' => i = self.space(i + 1),
                b'}' => return Some(()),
                _ => return None,
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;
    use crate::taubench::float;

    /// Keys of a few documents' objects: plain ones, one that sorts first, and ones whose JSON
    /// text has escapes, which the scanner leaves to a full parse.
    pub(crate) const KEYS: [&str; 7] = ["a", "b", "da", "dates", "z", "q\"uote", "back\\slash"];

    pub(crate) fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i32>().prop_map(|n| json!(n)),
            (-1e6f64..1e6).prop_map(float),
            "[a-z{}\\[\\]\",:\\\\ ]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 48, 5, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(prop::sample::select(&KEYS[..]), inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
            ]
        })
    }

    /// A document and a path: mostly one that leads into the document (picking among the
    /// keys each object has), sometimes with a key it lacks at the end.
    pub(crate) fn doc_and_path() -> impl Strategy<Value = (Value, Vec<&'static str>)> {
        let picks = prop::collection::vec(any::<prop::sample::Index>(), 0..4);
        let stray = prop::option::of(prop::sample::select(&KEYS[..]));
        (json_value(), picks, stray).prop_map(|(doc, picks, stray)| {
            let mut path = Vec::new();
            let mut at = &doc;
            for pick in picks {
                let Some(fields) = at.as_object().filter(|f| !f.is_empty()) else { break };
                let (key, value) = fields.iter().nth(pick.index(fields.len())).unwrap();
                path.push(*KEYS.iter().find(|k| *k == key).unwrap());
                at = value;
            }
            path.extend(stray);
            (doc, path)
        })
    }

    pub(crate) fn lookup<'v>(doc: &'v Value, path: &[&str]) -> Option<&'v Value> {
        path.iter().try_fold(doc, |v, p| v.get(*p))
    }

    /// What `Scan::container_end` must give: the byte loop it replaced, with a call per string.
    fn container_end_bytewise(text: &str, i: usize) -> Option<usize> {
        let scan = Scan(text);
        let (mut depth, mut j) = (0usize, i);
        loop {
            match text.as_bytes().get(j)? {
                b'"' => {
                    j = scan.string_end(j)?;
                    continue;
                }
                b'{' | b'[' => depth += 1,
                b'}' | b']' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(j + 1);
                    }
                }
                _ => {}
            }
            j += 1;
        }
    }

    /// Text that starts a container: brackets, quotes and commas close together (as in
    /// tau2's flights), backslashes rare or absent, so that many chunks take the fast path.
    fn container_text() -> impl Strategy<Value = String> {
        const SYMBOLS: [char; 16] = ['{', '}', '[', ']', '{', '}', '"', '"', '"', 'a', 'b', ' ', ',', ':', '7', '\\'];
        let body = prop::collection::vec(prop::sample::select(&SYMBOLS[..]), 0..400);
        (prop::bool::ANY, prop::bool::ANY, body).prop_map(|(array, escapes, body)| {
            let open = if array { '[' } else { '{' };
            std::iter::once(open).chain(body.into_iter().filter(|&c| escapes || c != '\\')).collect()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

        /// Sixteen bytes at a time, a container ends exactly where the byte loop said, or
        /// nowhere (unclosed, or a string running off the end) as it said.
        #[test]
        fn a_container_ends_where_the_byte_loop_said(text in container_text()) {
            prop_assert_eq!(Scan(&text).container_end(0), container_end_bytewise(&text, 0), "{}", text);
        }

        /// The same on documents: every prefix of one's text, canonical or pretty-printed.
        #[test]
        fn a_document_ends_where_the_byte_loop_said(doc in json_value(), pretty: bool) {
            let text = if pretty { serde_json::to_string_pretty(&doc).unwrap() } else { to_json(&doc) };
            if text.starts_with(['{', '[']) {
                prop_assert_eq!(Scan(&text).container_end(0), Some(text.len()));
                for cut in (1..text.len()).filter(|&cut| text.is_char_boundary(cut)) {
                    prop_assert_eq!(Scan(&text[..cut]).container_end(0), container_end_bytewise(&text[..cut], 0));
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

        /// The scanner finds, in canonical or pretty-printed text, exactly what a parse finds,
        /// and gives up only where a key has escapes.
        #[test]
        fn a_span_holds_what_a_parse_finds_at_the_path((doc, path) in doc_and_path(), pretty: bool) {
            let text = if pretty { serde_json::to_string_pretty(&doc).unwrap() } else { to_json(&doc) };
            let found = lookup(&doc, &path);
            match span_at(&text, &path) {
                Span::At(range) => {
                    let part: Value = serde_json::from_str(&text[range]).unwrap();
                    prop_assert_eq!(Some(&part), found);
                }
                Span::Missing => prop_assert_eq!(found, None),
                Span::Unreadable => prop_assert!(text.contains('\\'), "gave up on {}", text),
            }
        }

        /// `holds` says exactly what a parse and a comparison say, on canonical texts, for
        /// values there, values not there and paths that lead nowhere.
        #[test]
        fn holds_is_what_a_parse_finds((doc, path) in doc_and_path(), other in json_value(), take_found: bool) {
            let text = to_json(&doc);
            let found = lookup(&doc, &path);
            let value = match found {
                Some(found) if take_found => found.clone(),
                _ => other,
            };
            prop_assert_eq!(holds(&text, &path, &to_json(&value)), found == Some(&value), "{} at {:?}", text, path);
        }
    }

    #[test]
    fn holds_looks_only_at_the_field_at_the_path() {
        let flight = to_json(&json!({
            "origin": "SFO",
            "destination": "JFK",
            "dates": { "2024-05-17": { "origin": "JFK", "note": "{\"destination\":\"SFO\"}" } }
        }));
        assert!(holds(&flight, &["origin"], r#""SFO""#));
        assert!(!holds(&flight, &["origin"], r#""JFK""#), "a nested field of the same name");
        assert!(!holds(&flight, &["destination"], r#""SFO""#), "a field named inside a string");
        assert!(holds(&flight, &["dates", "2024-05-17", "origin"], r#""JFK""#));
        assert!(!holds(&flight, &["origin", "x"], r#""SFO""#));
        assert!(holds(r#"{"q\"uote":1}"#, &["q\"uote"], "1"), "an escaped key, read by a parse");
    }

    #[test]
    fn a_string_stops_at_its_first_quote_or_escape_wherever_it_stands() {
        // Every length up to three vectors and a tail, every position of the stop, from every
        // start: in ASCII and in multi-byte text whose bytes are a quote or a backslash but for
        // the high bit (`¢` is C2 A2, `ܐ` is DC 90). A `#` or `]` just after the stop is what
        // makes the eight-byte test set a false bit above a match.
        for filler in ["a", "é", "¢", "ܐ"] {
            for len in 0..56 {
                let plain = filler.repeat(len);
                for from in (0..=plain.len()).filter(|from| plain.is_char_boundary(*from)) {
                    assert_eq!(next_quote_or_escape(plain.as_bytes(), from), plain.len(), "{plain:?} from {from}");
                }
                for stop in ["\"", "\\", "\"#", "\\]"] {
                    for at in (0..=plain.len()).filter(|at| plain.is_char_boundary(*at)) {
                        let text = format!("{}{stop}{}\"", &plain[..at], &plain[at..]);
                        for from in (0..=at).filter(|from| text.is_char_boundary(*from)) {
                            assert_eq!(next_quote_or_escape(text.as_bytes(), from), at, "{text:?} from {from}");
                        }
                    }
                }
            }
        }
        // Past the end (after a backslash that ends the text): the end.
        assert_eq!(next_quote_or_escape(b"ab", 3), 2);
    }

    /// Bytes where stops are common: quotes, backslashes, control bytes, the bytes just past
    /// each, and high bytes (which the eight-byte test must not take for small ones).
    fn stop_heavy_byte() -> impl Strategy<Value = u8> {
        prop_oneof![
            6 => any::<u8>(),
            1 => Just(b'"'),
            1 => Just(b'\\'),
            1 => Just(b'#'),
            1 => Just(b']'),
            1 => Just(b' '),
            1 => 0u8..0x20,
            1 => 0x7fu8..=0xff,
        ]
    }

    proptest! {
        #[test]
        fn a_string_stops_at_the_first_stop_byte_from_any_start(
            bytes in proptest::collection::vec(stop_heavy_byte(), 0..80),
            from in 0usize..81,
            controls: bool,
        ) {
            let from = from.min(bytes.len());
            let stop = |b: u8| b == b'"' || b == b'\\' || (controls && b < 0x20);
            let expected = bytes[from..].iter().position(|&b| stop(b)).map_or(bytes.len(), |p| from + p);
            let found =
                if controls { next_quote_escape_or_control(&bytes, from) } else { next_quote_or_escape(&bytes, from) };
            prop_assert_eq!(found, expected);
        }

        /// The eight-byte test alone (the loop above runs it only on tails here, where
        /// sixteen-byte chunks come first): its lowest set byte is the first stop.
        #[test]
        fn eight_bytes_at_a_time_find_the_first_stop(bytes in proptest::array::uniform8(stop_heavy_byte()), controls: bool) {
            let stop = |b: u8| b == b'"' || b == b'\\' || (controls && b < 0x20);
            let x = u64::from_le_bytes(bytes);
            let mask = if controls { stop_mask8::<true>(x) } else { stop_mask8::<false>(x) };
            let found = (mask != 0).then(|| (mask.trailing_zeros() / 8) as usize);
            prop_assert_eq!(found, bytes.iter().position(|&b| stop(b)));
        }
    }
}
