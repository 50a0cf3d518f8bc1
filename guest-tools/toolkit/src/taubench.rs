//! What tau2-bench's tools have in common (the `taubench_airline` and `taubench_retail`
//! plugins): argument readers, the write log that makes every write undoable byte for byte
//! and replayable, and tau2's `calculate` with Python's arithmetic and float formatting.
//!
//! A write runs through [`write`]: it works on [`Docs`], which notes every change (fields set,
//! with their values before and after; list items appended; documents created), and stores
//! the changes together with that record in the plugin's write log, keyed by the call's
//! idempotency key. [`undo`] finds the record by the forward call's key (so it also undoes a
//! call whose reply was lost), undoes each change, newest first, and deletes the record. A
//! number that another call moved meanwhile (seats, a balance) is moved back by the amount
//! this call moved it; other fields are put back. A second delivery of a write with the same
//! key finds the record and returns the first delivery's output.

use serde_json::{Map, Number, Value, json};

use crate::common::{Context, Store, StoreExt, ToolError, ToolSpec, to_json, unknown_tool};
use crate::json_text::{Span, span_at, top_fields};

pub fn string() -> Value {
    json!({ "type": "string" })
}

pub fn object(properties: Value, required: &[&str]) -> Value {
    json!({ "type": "object", "properties": properties, "required": required })
}

pub fn undo_schema() -> Value {
    object(
        json!({
            "forward": object(
                json!({ "arguments": { "type": "object" }, "output": {}, "idempotency_key": string() }),
                &["idempotency_key"]
            )
        }),
        &["forward"],
    )
}

pub fn str_arg<'a>(args: &'a Value, field: &str) -> Result<&'a str, ToolError> {
    args.get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| ToolError::InvalidInput(format!("'{field}' must be a string")))
}

/// An integer argument (JSON integers, or floats without a fractional part as pydantic takes them).
pub fn int_of(value: &Value) -> Option<i64> {
    value.as_i64().or_else(|| value.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15).map(|f| f as i64))
}

pub fn int_arg(args: &Value, field: &str) -> Result<i64, ToolError> {
    args.get(field).and_then(int_of).ok_or_else(|| ToolError::InvalidInput(format!("'{field}' must be an integer")))
}

pub fn array_arg<'a>(args: &'a Value, field: &str) -> Result<&'a Vec<Value>, ToolError> {
    args.get(field)
        .and_then(Value::as_array)
        .ok_or_else(|| ToolError::InvalidInput(format!("'{field}' must be an array")))
}

pub fn item_str<'a>(item: &'a Value, list: &str, field: &str) -> Result<&'a str, ToolError> {
    item.get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| ToolError::InvalidInput(format!("every item of '{list}' needs a string '{field}'")))
}

pub fn rejected(message: impl Into<String>) -> ToolError {
    ToolError::Rejected(message.into())
}

/// A float as JSON.
pub fn float(value: f64) -> Value {
    Number::from_f64(value).map_or(Value::Null, Value::Number)
}

pub type Apply = fn(&mut Docs<'_>, &Value, &Context) -> Result<Value, ToolError>;

/// Runs a write tool: a second delivery replays the first one's output; otherwise `apply`
/// works on the documents, and its changes are stored together with the record of them.
pub fn write(
    store: &mut dyn Store,
    log: &str,
    tool: &str,
    args: &Value,
    ctx: &Context,
    apply: Apply,
) -> Result<Value, ToolError> {
    let key = ctx.idempotency_key.as_str();
    if key.is_empty() {
        return Err(ToolError::InvalidInput(format!("{tool} needs the call's idempotency key")));
    }
    if let Some(record) = store.doc(log, key)? {
        if record["tool"] == tool {
            return Ok(record["output"].clone());
        }
        return Err(rejected(format!("idempotency key {key} belongs to a {} call", record["tool"])));
    }
    let mut docs = Docs::new(store, true);
    let output = apply(&mut docs, args, ctx)?;
    let edits = docs.flush()?;
    store.put_doc(log, key, &json!({ "tool": tool, "output": output, "edits": edits }))?;
    Ok(output)
}

// ---------------------------------------------------------------------------------------------
// Compensators

/// Undoes the write recorded under the forward call's idempotency key, newest change first.
pub fn undo(store: &mut dyn Store, log: &str, forward: &str, args: &Value) -> Result<Value, ToolError> {
    let key = args
        .pointer("/forward/idempotency_key")
        .and_then(Value::as_str)
        .ok_or_else(|| ToolError::InvalidInput("need the forward call's idempotency key".into()))?;
    let Some(record) = store.doc(log, key)? else {
        return Ok(json!({ "undone": false, "idempotency_key": key, "reason": "nothing to undo" }));
    };
    if record["tool"] != forward {
        return Err(rejected(format!("idempotency key {key} belongs to a {} call, not {forward}", record["tool"])));
    }
    let mut docs = Docs::new(store, false);
    for edit in record["edits"].as_array().into_iter().flatten().rev() {
        let (ns, doc_key) = (edit["ns"].as_str().unwrap_or_default(), edit["key"].as_str().unwrap_or_default());
        let path: Vec<&str> = edit["path"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        match edit["op"].as_str() {
            Some("create") => docs.remove(ns, doc_key)?,
            Some("push") => docs.unpush(ns, doc_key, &path, &edit["value"])?,
            Some("set") => {
                let (before, after) = (edit.get("before"), edit.get("after"));
                let now = docs.at(ns, doc_key, &path)?;
                let restored = match (before, after, &now) {
                    // Someone else moved the number meanwhile: move it back by what this call moved it.
                    (Some(Value::Number(b)), Some(Value::Number(a)), Some(Value::Number(n))) if !same_number(n, a) => {
                        Some(shifted(n, b, a))
                    }
                    _ => before.cloned(),
                };
                docs.set(ns, doc_key, &path, restored)?;
            }
            _ => return Err(ToolError::Transient(format!("{log}/{key} holds an unknown edit: {edit}"))),
        }
    }
    docs.flush()?;
    store.delete(log, key)?;
    Ok(json!({ "undone": true, "tool": forward, "idempotency_key": key }))
}

fn same_number(a: &Number, b: &Number) -> bool {
    match (a.as_i64(), b.as_i64()) {
        (Some(x), Some(y)) => x == y,
        _ => a.as_f64() == b.as_f64(),
    }
}

/// `now + (before - after)`.
fn shifted(now: &Number, before: &Number, after: &Number) -> Value {
    if let (Some(n), Some(b), Some(a)) = (now.as_i64(), before.as_i64(), after.as_i64()) {
        return json!(n + (b - a));
    }
    let f = |x: &Number| x.as_f64().unwrap_or(0.0);
    float(f(now) + (f(before) - f(after)))
}

/// JSON equality with numbers compared by value (`200` and `200.0` are one amount).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => same_number(x, y),
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, y)),
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

// ---------------------------------------------------------------------------------------------
// The documents one call works on

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
    record: bool,
    edits: Vec<Value>,
}

/// A loaded document's index and the object that holds a field.
type Parent<'a> = (usize, &'a mut Map<String, Value>);

struct Loaded {
    ns: String,
    key: String,
    body: Body,
    dirty: bool,
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
        Docs { store, loaded: Vec::new(), record, edits: Vec::new() }
    }

    fn index(&mut self, ns: &str, key: &str) -> Result<usize, ToolError> {
        if let Some(i) = self.loaded.iter().position(|l| l.ns == ns && l.key == key) {
            return Ok(i);
        }
        let body = self.store.get(ns, key)?.map_or(Body::Absent, Body::Text);
        self.loaded.push(Loaded { ns: ns.to_string(), key: key.to_string(), body, dirty: false, last_span: None });
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
    pub fn fields(&mut self, ns: &str, key: &str, names: &[&str]) -> Result<Vec<Option<Value>>, ToolError> {
        let i = self.index(ns, key)?;
        if let Body::Text(text) = &self.loaded[i].body
            && let Some(found) = top_fields(text, names)
        {
            return found.into_iter().map(|range| range.map(|r| self.parse_part(i, r)).transpose()).collect();
        }
        names.iter().map(|name| self.at(ns, key, &[name])).collect()
    }

    /// Where `path` is in document `i`, if it is held as text. The last span found is kept,
    /// so that a `set` after an `at` of the same path does not scan again.
    fn span(&mut self, i: usize, path: &[&str]) -> Option<Span> {
        let loaded = &mut self.loaded[i];
        let Body::Text(text) = &loaded.body else { return None };
        if let Some((known, range)) = &loaded.last_span
            && known.iter().eq(path.iter())
        {
            return Some(Span::At(range.clone()));
        }
        let span = span_at(text, path);
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
        self.loaded[i].dirty = true;
        self.note(json!({ "op": "create", "ns": ns, "key": key }));
        Ok(())
    }

    pub fn remove(&mut self, ns: &str, key: &str) -> Result<(), ToolError> {
        let i = self.index(ns, key)?;
        if !matches!(std::mem::replace(&mut self.loaded[i].body, Body::Absent), Body::Absent) {
            self.loaded[i].dirty = true;
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
        self.loaded[i].dirty = true;
        self.note_set(ns, key, path, before, value);
        Ok(())
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
        loaded.dirty = true;
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
        self.loaded[i].dirty = true;
        self.note(json!({ "op": "push", "ns": ns, "key": key, "path": path, "value": value }));
        Ok(())
    }

    /// Removes the last item equal to `value` from the list at `path`, if there is one.
    pub fn unpush(&mut self, ns: &str, key: &str, path: &[&str], value: &Value) -> Result<(), ToolError> {
        let Some((i, parent)) = self.parent(ns, key, path)? else { return Ok(()) };
        let Some(list) = parent.get_mut(path[path.len() - 1]).and_then(Value::as_array_mut) else { return Ok(()) };
        if let Some(at) = list.iter().rposition(|item| same(item, value)) {
            list.remove(at);
            self.loaded[i].dirty = true;
        }
        Ok(())
    }

    /// Writes every changed document; returns the edits noted.
    pub fn flush(self) -> Result<Vec<Value>, ToolError> {
        for loaded in self.loaded.iter().filter(|l| l.dirty) {
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

// ---------------------------------------------------------------------------------------------
// calculate: Python's arithmetic on the characters tau2 allows

/// The read tools every tau2 domain has, as tau2 describes them.
pub fn shared_queries() -> [ToolSpec; 2] {
    [
        ToolSpec::query(
            "calculate",
            "The value of an arithmetic expression of numbers, + - * / and parentheses, \
             rounded to 2 decimals.",
            object(json!({ "expression": string() }), &["expression"]),
        ),
        ToolSpec::query(
            "transfer_to_human_agents",
            "Hand the user over to a human agent, with a summary of the user's issue.",
            object(json!({ "summary": string() }), &["summary"]),
        ),
    ]
}

/// Serves what every domain serves alike: the [`shared_queries`], and the `undo_<tool>`
/// compensator of each of the domain's `writes` from its write log `log`.
pub fn call_shared(
    store: &mut dyn Store,
    tool: &str,
    args: &Value,
    writes: &[(&str, &str)],
    log: &str,
) -> Result<Value, ToolError> {
    match tool {
        "calculate" => calculate(str_arg(args, "expression")?).map(Value::String).map_err(ToolError::Rejected),
        "transfer_to_human_agents" => Ok(json!("Transfer successful")),
        other => match writes.iter().find(|(_, undo)| *undo == other) {
            Some((forward, _)) => undo(store, log, forward, args),
            None => Err(unknown_tool(other)),
        },
    }
}

/// tau2's `calculate`: the expression evaluated as Python would, as `str(round(float(x), 2))`.
pub fn calculate(expression: &str) -> Result<String, String> {
    if !expression.chars().all(|c| "0123456789+-*/(). ".contains(c)) {
        return Err("Invalid characters in expression".into());
    }
    let mut parser = Parser { text: expression.as_bytes(), at: 0 };
    let value = parser.expression()?;
    parser.skip_spaces();
    if parser.at != parser.text.len() {
        return Err("invalid syntax (<string>, line 1)".into());
    }
    let x = value.to_float()?;
    let rounded = if x.is_finite() { format!("{x:.2}").parse::<f64>().unwrap_or(x) } else { x };
    Ok(python_float(rounded))
}

/// A Python number: an int (while it fits) or a float.
#[derive(Clone, Copy, Debug)]
enum Num {
    Int(i128),
    Float(f64),
}

impl Num {
    fn to_float(self) -> Result<f64, String> {
        match self {
            Num::Int(i) => Ok(i as f64),
            Num::Float(f) => Ok(f),
        }
    }
}

const SYNTAX: &str = "invalid syntax (<string>, line 1)";

struct Parser<'a> {
    text: &'a [u8],
    at: usize,
}

impl Parser<'_> {
    fn skip_spaces(&mut self) {
        while self.text.get(self.at) == Some(&b' ') {
            self.at += 1;
        }
    }

    /// The next token if it is `op` (an operator of one or two characters), consumed.
    fn eat(&mut self, op: &str) -> bool {
        self.skip_spaces();
        let rest = &self.text[self.at..];
        if !rest.starts_with(op.as_bytes()) {
            return false;
        }
        // `*` is not `**`, `/` is not `//`.
        if op.len() == 1 && rest.get(1) == Some(&op.as_bytes()[0]) && matches!(op, "*" | "/") {
            return false;
        }
        self.at += op.len();
        true
    }

    fn expression(&mut self) -> Result<Num, String> {
        let mut value = self.term()?;
        loop {
            if self.eat("+") {
                value = arith(value, self.term()?, '+')?;
            } else if self.eat("-") {
                value = arith(value, self.term()?, '-')?;
            } else {
                return Ok(value);
            }
        }
    }

    fn term(&mut self) -> Result<Num, String> {
        let mut value = self.factor()?;
        loop {
            if self.eat("*") {
                value = arith(value, self.factor()?, '*')?;
            } else if self.eat("//") {
                value = floor_div(value, self.factor()?)?;
            } else if self.eat("/") {
                value = true_div(value, self.factor()?)?;
            } else {
                return Ok(value);
            }
        }
    }

    fn factor(&mut self) -> Result<Num, String> {
        if self.eat("+") {
            return self.factor();
        }
        if self.eat("-") {
            return Ok(match self.factor()? {
                Num::Int(i) => Num::Int(-i),
                Num::Float(f) => Num::Float(-f),
            });
        }
        let base = self.atom()?;
        if self.eat("**") { power(base, self.factor()?) } else { Ok(base) }
    }

    fn atom(&mut self) -> Result<Num, String> {
        self.skip_spaces();
        if self.eat("(") {
            let value = self.expression()?;
            return if self.eat(")") { Ok(value) } else { Err(SYNTAX.into()) };
        }
        let start = self.at;
        let digits = |p: &mut Self| {
            let from = p.at;
            while p.text.get(p.at).is_some_and(u8::is_ascii_digit) {
                p.at += 1;
            }
            p.at - from
        };
        let whole = digits(self);
        let fraction = if self.text.get(self.at) == Some(&b'.') {
            self.at += 1;
            Some(digits(self))
        } else {
            None
        };
        let literal = std::str::from_utf8(&self.text[start..self.at]).unwrap_or_default();
        match fraction {
            None if whole == 0 => Err(SYNTAX.into()),
            None => {
                if literal.len() > 1 && literal.starts_with('0') && literal.bytes().any(|b| b != b'0') {
                    return Err("leading zeros in decimal integer literals are not permitted".into());
                }
                Ok(literal
                    .parse::<i128>()
                    .map(Num::Int)
                    .unwrap_or_else(|_| Num::Float(literal.parse().unwrap_or(f64::INFINITY))))
            }
            Some(after) if whole == 0 && after == 0 => Err(SYNTAX.into()),
            Some(_) => literal.parse::<f64>().map(Num::Float).map_err(|_| SYNTAX.to_string()),
        }
    }
}

fn floats(a: Num, b: Num) -> (f64, f64) {
    let f = |n: Num| match n {
        Num::Int(i) => i as f64,
        Num::Float(f) => f,
    };
    (f(a), f(b))
}

fn arith(a: Num, b: Num, op: char) -> Result<Num, String> {
    if let (Num::Int(x), Num::Int(y)) = (a, b) {
        let exact = match op {
            '+' => x.checked_add(y),
            '-' => x.checked_sub(y),
            _ => x.checked_mul(y),
        };
        if let Some(v) = exact {
            return Ok(Num::Int(v));
        }
    }
    let (x, y) = floats(a, b);
    Ok(Num::Float(match op {
        '+' => x + y,
        '-' => x - y,
        _ => x * y,
    }))
}

fn true_div(a: Num, b: Num) -> Result<Num, String> {
    let (x, y) = floats(a, b);
    if y == 0.0 {
        return Err(match (a, b) {
            (Num::Int(_), Num::Int(_)) => "division by zero".into(),
            _ => "float division by zero".into(),
        });
    }
    Ok(Num::Float(x / y))
}

fn floor_div(a: Num, b: Num) -> Result<Num, String> {
    if let (Num::Int(x), Num::Int(y)) = (a, b) {
        if y == 0 {
            return Err("integer division or modulo by zero".into());
        }
        if let (Some(q), Some(r)) = (x.checked_div(y), x.checked_rem(y)) {
            // Python floors; Rust truncates towards zero.
            return Ok(Num::Int(if r != 0 && (r < 0) != (y < 0) { q - 1 } else { q }));
        }
    }
    let (x, y) = floats(a, b);
    if y == 0.0 {
        return Err("float floor division by zero".into());
    }
    // CPython's float_floor_div.
    let m = x % y;
    let mut div = (x - m) / y;
    if m != 0.0 && (y < 0.0) != (m < 0.0) {
        div -= 1.0;
    }
    let floordiv = if div != 0.0 {
        let f = div.floor();
        if div - f > 0.5 { f + 1.0 } else { f }
    } else {
        0f64.copysign(x / y)
    };
    Ok(Num::Float(floordiv))
}

fn power(a: Num, b: Num) -> Result<Num, String> {
    if let (Num::Int(x), Num::Int(y)) = (a, b)
        && y >= 0
    {
        if let Some(v) = u32::try_from(y).ok().and_then(|e| x.checked_pow(e)) {
            return Ok(Num::Int(v));
        }
        let f = (x as f64).powf(y as f64);
        return if f.is_finite() { Ok(Num::Float(f)) } else { Err("int too large to convert to float".into()) };
    }
    let (x, y) = floats(a, b);
    if y == 0.0 {
        return Ok(Num::Float(1.0));
    }
    if x == 0.0 && y < 0.0 {
        return Err("0.0 cannot be raised to a negative power".into());
    }
    if x < 0.0 && y.fract() != 0.0 {
        return Err("float() argument must be a string or a real number, not 'complex'".into());
    }
    let f = x.powf(y);
    if f.is_infinite() && x.is_finite() && y.is_finite() {
        return Err("(34, 'Numerical result out of range')".into());
    }
    Ok(Num::Float(f))
}

/// Python's `repr` of a float: the shortest text that reads back as the same float, with a
/// decimal point when the exponent is in [-4, 16), else in scientific notation.
pub fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    let scientific = format!("{:e}", x.abs());
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if x < 0.0 { "-" } else { "" };
    let text = if (-4..16).contains(&exponent) {
        if exponent >= 0 {
            let point = exponent as usize + 1;
            let (int, frac) = if digits.len() > point {
                (digits[..point].to_string(), digits[point..].to_string())
            } else {
                (format!("{digits}{}", "0".repeat(point - digits.len())), "0".to_string())
            };
            format!("{int}.{frac}")
        } else {
            format!("0.{}{digits}", "0".repeat((-exponent - 1) as usize))
        }
    } else {
        let mantissa = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        format!("{mantissa}e{}{:02}", if exponent < 0 { '-' } else { '+' }, exponent.abs())
    };
    format!("{sign}{text}")
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::MapStore;
    use crate::json_text::tests::{KEYS, doc_and_path, json_value, lookup};

    /// The value a `set` writes: often one equal to what is there (also as a float), which a
    /// `set` must leave alone and not note.
    fn new_value(doc: &Value, path: &[&str], pick: u8, other: Value) -> Value {
        match (lookup(doc, path), pick % 3) {
            (Some(Value::Number(n)), 0) => n.as_f64().map_or(other, float),
            (Some(same), 0 | 1) => same.clone(),
            _ => other,
        }
    }

    /// `set` of `path` to `value` on `text`, with the document held as text or (after a
    /// `load`) as a tree: what is stored after the flush, and the edits noted.
    fn set_and_flush(text: &str, path: &[&str], value: &Value, as_tree: bool) -> (Option<String>, Vec<Value>) {
        let mut store = MapStore::default();
        store.put("ns", "doc", text).unwrap();
        let mut docs = Docs::new(&mut store, true);
        if as_tree {
            docs.load("ns", "doc").unwrap();
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
        fn a_field_set_in_the_text_gives_what_the_tree_gives((doc, path) in doc_and_path(), pick: u8, other in json_value()) {
            let value = new_value(&doc, &path, pick, other);
            let text = to_json(&doc);
            let (in_text, edits_in_text) = set_and_flush(&text, &path, &value, false);
            let (in_tree, edits_in_tree) = set_and_flush(&text, &path, &value, true);
            let parsed = |t: &Option<String>| t.as_deref().map(|t| serde_json::from_str::<Value>(t).unwrap());
            prop_assert_eq!(parsed(&in_text), parsed(&in_tree));
            prop_assert_eq!(edits_in_text, edits_in_tree);
            let stored = in_text.unwrap();
            prop_assert_eq!(to_json(&serde_json::from_str(&stored).unwrap()), stored);
        }
    }

    proptest! {
        /// One pass over a document's text reads the fields that `at` reads one by one.
        #[test]
        fn fields_read_in_one_pass_are_what_a_parse_finds(doc in json_value(), names in prop::collection::vec(prop::sample::select(&KEYS[..]), 0..4)) {
            let mut store = MapStore::default();
            store.put("ns", "doc", &to_json(&doc)).unwrap();
            let mut docs = Docs::new(&mut store, false);
            let found = docs.fields("ns", "doc", &names).unwrap();
            let parsed: Vec<Option<Value>> = names.iter().map(|name| lookup(&doc, &[name]).cloned()).collect();
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
