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

use serde_json::{Number, Value, json};

use crate::common::{Context, Store, StoreExt, ToolError, ToolSpec, unknown_tool};
use crate::docs::{Docs, same_number};

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

/// `now + (before - after)`.
fn shifted(now: &Number, before: &Number, after: &Number) -> Value {
    if let (Some(n), Some(b), Some(a)) = (now.as_i64(), before.as_i64(), after.as_i64()) {
        return json!(n + (b - a));
    }
    let f = |x: &Number| x.as_f64().unwrap_or(0.0);
    float(f(now) + (f(before) - f(after)))
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
