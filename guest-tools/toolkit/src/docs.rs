//! The documents one call works on, held as the store's text until something needs them
//! whole: a tool reads the values at the paths it needs and replaces values in the text, so
//! that moving one count on a large document costs a scan of it, not a parse and a print.

use serde_json::{Map, Number, Value, json};

use crate::common::{Store, StoreExt, ToolError, to_json};
use crate::json_text::{Span, span_at, span_within, top_fields};

/// The documents a call reads and changes, written back together by [`Docs::flush`]. When
/// `record` is set, every change is also noted as an edit for the compensator.
///
/// A document stays the text the store returned until something needs it whole: [`Docs::at`]
/// parses only the value at its path, and [`Docs::set`] of a field that exists replaces that
/// value's text. A seat count moved on a 4 KB flight document then costs a scan of its text,
/// not a tree of every date built, copied and printed again.
pub struct Docs<'s> {
    store: &'s mut dyn Store,
    loaded: Vec<Loaded>,
    /// The changed documents (indices into `loaded`), in the order of their first change:
    /// the order [`Docs::flush`] writes them in.
    changed: Vec<usize>,
    record: bool,
    edits: Vec<Value>,
}

/// A loaded document's index and the object that holds a field.
type Parent<'a> = (usize, &'a mut Map<String, Value>);

struct Loaded {
    ns: String,
    key: String,
    body: Body,
    /// The path and range of the value [`Docs::span`] found last in `body`'s text.
    last_span: Option<(Vec<String>, std::ops::Range<usize>)>,
}

/// What [`Docs::replace_in_text`] did.
enum InText {
    /// The field was there, with this value.
    Replaced(Value),
    /// The field was there, with the same value.
    Unchanged,
    /// The document is not held as text, or the field is not there: `set` works on the tree.
    NotHere,
}

/// A document as a call holds it.
enum Body {
    Absent,
    /// The text as the store keeps it (canonical), possibly with values replaced in place.
    Text(String),
    Tree(Value),
}

impl<'s> Docs<'s> {
    pub fn new(store: &'s mut dyn Store, record: bool) -> Self {
        Docs { store, loaded: Vec::new(), changed: Vec::new(), record, edits: Vec::new() }
    }

    fn index(&mut self, ns: &str, key: &str) -> Result<usize, ToolError> {
        if let Some(i) = self.loaded.iter().position(|l| l.ns == ns && l.key == key) {
            return Ok(i);
        }
        let body = self.store.get(ns, key)?.map_or(Body::Absent, Body::Text);
        self.loaded.push(Loaded { ns: ns.to_string(), key: key.to_string(), body, last_span: None });
        Ok(self.loaded.len() - 1)
    }

    /// The document at `i` as a tree, parsing its text the first time.
    fn tree(&mut self, i: usize) -> Result<Option<&mut Value>, ToolError> {
        let loaded = &mut self.loaded[i];
        if let Body::Text(text) = &loaded.body {
            let tree = serde_json::from_str(text)
                .map_err(|e| ToolError::Transient(format!("{}/{} is not JSON: {e}", loaded.ns, loaded.key)))?;
            loaded.body = Body::Tree(tree);
        }
        Ok(match &mut loaded.body {
            Body::Tree(tree) => Some(tree),
            _ => None,
        })
    }

    /// Whether the document exists (as this call left it so far).
    pub fn exists(&mut self, ns: &str, key: &str) -> Result<bool, ToolError> {
        let i = self.index(ns, key)?;
        Ok(!matches!(self.loaded[i].body, Body::Absent))
    }

    /// The document as this call left it so far.
    pub fn load(&mut self, ns: &str, key: &str) -> Result<Option<Value>, ToolError> {
        let i = self.index(ns, key)?;
        Ok(self.tree(i)?.cloned())
    }

    /// The value at `path` in a document (None: no document, or nothing there).
    pub fn at(&mut self, ns: &str, key: &str, path: &[&str]) -> Result<Option<Value>, ToolError> {
        let i = self.index(ns, key)?;
        match self.span(i, path) {
            Some(Span::Missing) => return Ok(None),
            Some(Span::At(range)) => return self.parse_part(i, range).map(Some),
            Some(Span::Unreadable) | None => {}
        }
        let mut value = self.tree(i)?.map(|v| &*v);
        for p in path {
            value = value.and_then(|v| v.get(*p));
        }
        Ok(value.cloned())
    }

    /// The top-level fields `names` of a document (None: no document, or no such field),
    /// read in one pass over its text.
    pub fn fields<const N: usize>(
        &mut self,
        ns: &str,
        key: &str,
        names: [&str; N],
    ) -> Result<[Option<Value>; N], ToolError> {
        let i = self.index(ns, key)?;
        let mut values: [Option<Value>; N] = std::array::from_fn(|_| None);
        if let Body::Text(text) = &self.loaded[i].body
            && let Some(found) = top_fields(text, &names)
        {
            for (value, range) in values.iter_mut().zip(found) {
                *value = range.map(|r| self.parse_part(i, r)).transpose()?;
            }
            return Ok(values);
        }
        for (value, name) in values.iter_mut().zip(names) {
            *value = self.at(ns, key, &[name])?;
        }
        Ok(values)
    }

    /// Where `path` is in document `i`, if it is held as text. The last span found is kept,
    /// so that a `set` after an `at` of the same path does not scan again, and one below it
    /// (a seat count after its day) scans only that value.
    fn span(&mut self, i: usize, path: &[&str]) -> Option<Span> {
        let loaded = &mut self.loaded[i];
        let Body::Text(text) = &loaded.body else { return None };
        // A path below the last one found is looked for inside its value only.
        let span = match &loaded.last_span {
            Some((known, range)) if known.iter().eq(path.iter()) => return Some(Span::At(range.clone())),
            Some((known, range)) if known.len() < path.len() && known.iter().zip(path).all(|(k, p)| k == p) => {
                span_within(text, range.clone(), &path[known.len()..])
            }
            _ => span_at(text, path),
        };
        if let Span::At(range) = &span {
            loaded.last_span = Some((path.iter().map(|p| p.to_string()).collect(), range.clone()));
        }
        Some(span)
    }

    /// The value in `range` of the text of document `i`.
    fn parse_part(&self, i: usize, range: std::ops::Range<usize>) -> Result<Value, ToolError> {
        let Loaded { ns, key, body: Body::Text(text), .. } = &self.loaded[i] else {
            unreachable!("parse_part is only called on a document held as text")
        };
        serde_json::from_str(&text[range]).map_err(|e| ToolError::Transient(format!("{ns}/{key} is not JSON: {e}")))
    }

    fn note(&mut self, edit: Value) {
        if self.record {
            self.edits.push(edit);
        }
    }

    pub fn create(&mut self, ns: &str, key: &str, doc: Value) -> Result<(), ToolError> {
        let i = self.index(ns, key)?;
        self.loaded[i].body = Body::Tree(doc);
        self.mark_changed(i);
        self.note(json!({ "op": "create", "ns": ns, "key": key }));
        Ok(())
    }

    pub fn remove(&mut self, ns: &str, key: &str) -> Result<(), ToolError> {
        let i = self.index(ns, key)?;
        if !matches!(std::mem::replace(&mut self.loaded[i].body, Body::Absent), Body::Absent) {
            self.mark_changed(i);
        }
        Ok(())
    }

    /// The object holding the last element of `path`, in a loaded document (None when the
    /// document or a parent is missing).
    fn parent(&mut self, ns: &str, key: &str, path: &[&str]) -> Result<Option<Parent<'_>>, ToolError> {
        let i = self.index(ns, key)?;
        let Some((_, parents)) = path.split_last() else { return Ok(None) };
        let mut target = self.tree(i)?;
        for p in parents {
            target = target.and_then(|t| t.get_mut(*p));
        }
        Ok(target.and_then(Value::as_object_mut).map(|m| (i, m)))
    }

    /// Sets (`Some`) or removes (`None`) the field at `path`; its parent must exist.
    pub fn set(&mut self, ns: &str, key: &str, path: &[&str], value: Option<Value>) -> Result<(), ToolError> {
        if let Some(value) = &value {
            match self.replace_in_text(ns, key, path, value)? {
                InText::Replaced(before) => {
                    self.note_set(ns, key, path, Some(before), Some(value.clone()));
                    return Ok(());
                }
                InText::Unchanged => return Ok(()),
                InText::NotHere => {}
            }
        }
        let record = self.record;
        let Some((i, parent)) = self.parent(ns, key, path)? else {
            if record {
                return Err(ToolError::Transient(format!("{ns}/{key} has no {}", path.join("."))));
            }
            return Ok(()); // undoing onto a document that is gone: nothing to put back
        };
        let field = path[path.len() - 1];
        let before = parent.get(field).cloned();
        let unchanged = match (&before, &value) {
            (Some(b), Some(v)) => same(b, v),
            (None, None) => true,
            _ => false,
        };
        if unchanged {
            return Ok(());
        }
        match &value {
            Some(v) => parent.insert(field.to_string(), v.clone()),
            None => parent.remove(field),
        };
        self.mark_changed(i);
        self.note_set(ns, key, path, before, value);
        Ok(())
    }

    /// Adds `n` to the count at `path` (a missing or malformed count counts as 0). Nothing
    /// is created when the field's parent is missing and changes are not recorded.
    pub fn add_to_count(&mut self, ns: &str, key: &str, path: &[&str], n: u64) -> Result<(), ToolError> {
        let now = self.at(ns, key, path)?.and_then(|v| v.as_u64()).unwrap_or(0);
        self.set(ns, key, path, Some(json!(now + n)))
    }

    /// [`Docs::set`] of a field that a document held as text has: its value's text is replaced
    /// (a canonical text stays canonical: `value` prints canonically).
    fn replace_in_text(&mut self, ns: &str, key: &str, path: &[&str], value: &Value) -> Result<InText, ToolError> {
        let i = self.index(ns, key)?;
        let (false, Some(Span::At(range))) = (path.is_empty(), self.span(i, path)) else { return Ok(InText::NotHere) };
        let before = self.parse_part(i, range.clone())?;
        if same(&before, value) {
            return Ok(InText::Unchanged);
        }
        let loaded = &mut self.loaded[i];
        let Body::Text(text) = &mut loaded.body else { unreachable!("span found it in the text") };
        text.replace_range(range, &to_json(value));
        loaded.last_span = None;
        self.mark_changed(i);
        Ok(InText::Replaced(before))
    }

    fn note_set(&mut self, ns: &str, key: &str, path: &[&str], before: Option<Value>, after: Option<Value>) {
        if !self.record {
            return;
        }
        let mut edit = Map::new();
        edit.insert("op".into(), json!("set"));
        edit.insert("ns".into(), json!(ns));
        edit.insert("key".into(), json!(key));
        edit.insert("path".into(), json!(path));
        if let Some(before) = before {
            edit.insert("before".into(), before);
        }
        if let Some(after) = after {
            edit.insert("after".into(), after);
        }
        self.note(Value::Object(edit));
    }

    /// Appends `value` to the list at `path`.
    pub fn push(&mut self, ns: &str, key: &str, path: &[&str], value: Value) -> Result<(), ToolError> {
        let Some((i, parent)) = self.parent(ns, key, path)? else {
            return Err(ToolError::Transient(format!("{ns}/{key} has no {}", path.join("."))));
        };
        let list = parent.get_mut(path[path.len() - 1]).and_then(Value::as_array_mut);
        let list = list.ok_or_else(|| ToolError::Transient(format!("{ns}/{key}: {} is not a list", path.join("."))))?;
        list.push(value.clone());
        self.mark_changed(i);
        self.note(json!({ "op": "push", "ns": ns, "key": key, "path": path, "value": value }));
        Ok(())
    }

    /// Removes the last item equal to `value` from the list at `path`, if there is one.
    pub fn unpush(&mut self, ns: &str, key: &str, path: &[&str], value: &Value) -> Result<(), ToolError> {
        let Some((i, parent)) = self.parent(ns, key, path)? else { return Ok(()) };
        let Some(list) = parent.get_mut(path[path.len() - 1]).and_then(Value::as_array_mut) else { return Ok(()) };
        if let Some(at) = list.iter().rposition(|item| same(item, value)) {
            list.remove(at);
            self.mark_changed(i);
        }
        Ok(())
    }

    fn mark_changed(&mut self, i: usize) {
        if !self.changed.contains(&i) {
            self.changed.push(i);
        }
    }

    /// Writes every changed document, in the order of their first change; returns the edits
    /// noted.
    pub fn flush(self) -> Result<Vec<Value>, ToolError> {
        for loaded in self.changed.iter().map(|&i| &self.loaded[i]) {
            match &loaded.body {
                Body::Text(text) => self.store.put(&loaded.ns, &loaded.key, text)?,
                Body::Tree(doc) => self.store.put_doc(&loaded.ns, &loaded.key, doc)?,
                Body::Absent => {
                    self.store.delete(&loaded.ns, &loaded.key)?;
                }
            }
        }
        Ok(self.edits)
    }
}

pub(crate) fn same_number(a: &Number, b: &Number) -> bool {
    match (a.as_i64(), b.as_i64()) {
        (Some(x), Some(y)) => x == y,
        _ => a.as_f64() == b.as_f64(),
    }
}

/// JSON equality with numbers compared by value (`200` and `200.0` are one amount).
pub(crate) fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => same_number(x, y),
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, y)),
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::MapStore;
    use crate::json_text::tests::{KEYS, doc_and_path, json_value, lookup};
    use crate::taubench::float;

    /// The value a `set` writes: often one equal to what is there (also as a float), which a
    /// `set` must leave alone and not note.
    fn new_value(doc: &Value, path: &[&str], pick: u8, other: Value) -> Value {
        match (lookup(doc, path), pick % 3) {
            (Some(Value::Number(n)), 0) => n.as_f64().map_or(other, float),
            (Some(same), 0 | 1) => same.clone(),
            _ => other,
        }
    }

    /// `set` of `path` to `value` on `text`, with the document held as text (after an `at` of
    /// the first `read_first` fields of the path) or (after a `load`) as a tree: what is
    /// stored after the flush, and the edits noted.
    fn set_and_flush(
        text: &str,
        path: &[&str],
        value: &Value,
        read_first: Option<usize>,
    ) -> (Option<String>, Vec<Value>) {
        let mut store = MapStore::default();
        store.put("ns", "doc", text).unwrap();
        let mut docs = Docs::new(&mut store, true);
        match read_first {
            Some(n) => drop(docs.at("ns", "doc", &path[..n.min(path.len())]).unwrap()),
            None => drop(docs.load("ns", "doc").unwrap()),
        }
        let edits = match docs.set("ns", "doc", path, Some(value.clone())) {
            Ok(()) => docs.flush().unwrap(),
            Err(error) => vec![json!(format!("{error:?}"))],
        };
        (store.get("ns", "doc").unwrap(), edits)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

        /// Setting a field in a document held as text stores the same document, and notes the
        /// same edit, as setting it in the parsed tree; a canonical text stays canonical.
        #[test]
        fn a_field_set_in_the_text_gives_what_the_tree_gives((doc, path) in doc_and_path(), pick: u8, other in json_value(), read_first in 0..4usize) {
            let value = new_value(&doc, &path, pick, other);
            let text = to_json(&doc);
            let (in_text, edits_in_text) = set_and_flush(&text, &path, &value, Some(read_first));
            let (in_tree, edits_in_tree) = set_and_flush(&text, &path, &value, None);
            let parsed = |t: &Option<String>| t.as_deref().map(|t| serde_json::from_str::<Value>(t).unwrap());
            prop_assert_eq!(parsed(&in_text), parsed(&in_tree));
            prop_assert_eq!(edits_in_text, edits_in_tree);
            let stored = in_text.unwrap();
            prop_assert_eq!(to_json(&serde_json::from_str(&stored).unwrap()), stored);
        }
    }

    proptest! {
        /// A value read after a value above it (looked for inside that one) is what a parse
        /// finds at its path.
        #[test]
        fn a_path_read_below_the_last_one_found_is_what_a_parse_finds((doc, path) in doc_and_path(), read_first in 0..4usize) {
            let mut store = MapStore::default();
            store.put("ns", "doc", &to_json(&doc)).unwrap();
            let mut docs = Docs::new(&mut store, false);
            let above = &path[..read_first.min(path.len())];
            prop_assert_eq!(docs.at("ns", "doc", above).unwrap(), lookup(&doc, above).cloned());
            prop_assert_eq!(docs.at("ns", "doc", &path).unwrap(), lookup(&doc, &path).cloned());
        }
    }

    proptest! {
        /// One pass over a document's text reads the fields that `at` reads one by one.
        #[test]
        fn fields_read_in_one_pass_are_what_a_parse_finds(doc in json_value(), names in prop::array::uniform3(prop::sample::select(&KEYS[..]))) {
            let mut store = MapStore::default();
            store.put("ns", "doc", &to_json(&doc)).unwrap();
            let mut docs = Docs::new(&mut store, false);
            let found = docs.fields("ns", "doc", names).unwrap();
            let parsed = names.map(|name| lookup(&doc, &[name]).cloned());
            prop_assert_eq!(found, parsed);
        }
    }

    #[test]
    fn a_seat_count_is_read_and_moved_without_the_other_dates() {
        let flight = r#"{"dates":{"2024-05-01":{"available_seats":{"economy":3},"status":"available"},"2024-05-02":{"available_seats":{"economy":9},"status":"landed"}},"origin":"JFK"}"#;
        let mut store = MapStore::default();
        store.put("flights", "HAT001", flight).unwrap();
        let mut docs = Docs::new(&mut store, true);
        let path = ["dates", "2024-05-02", "available_seats", "economy"];
        assert_eq!(docs.at("flights", "HAT001", &path).unwrap(), Some(json!(9)));
        assert_eq!(docs.at("flights", "HAT001", &["origin"]).unwrap(), Some(json!("JFK")));
        assert_eq!(docs.at("flights", "HAT001", &["dates", "2024-05-03"]).unwrap(), None);
        assert_eq!(docs.at("flights", "HAT001", &["origin", "x"]).unwrap(), None);
        docs.set("flights", "HAT001", &path, Some(json!(7))).unwrap();
        assert!(matches!(docs.loaded[0].body, Body::Text(_)), "the flight was parsed whole");
        let edits = docs.flush().unwrap();
        assert_eq!(store.get("flights", "HAT001").unwrap().unwrap(), flight.replace(":9}", ":7}"));
        assert_eq!(
            edits,
            vec![json!({"op": "set", "ns": "flights", "key": "HAT001", "path": path, "before": 9, "after": 7})]
        );
    }
}
