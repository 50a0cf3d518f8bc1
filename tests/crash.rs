//! Durable runs: `sagabox run --db` killed with SIGKILL at seeded random instants, then
//! `sagabox resume` (itself killed at times, then resumed again). The runs cover sequential
//! and DAG sagas, injected faults (a rejected step, a lost reply), steps that write nothing,
//! and several processes on one database. After the last resume every run is finished, each
//! run's allocations are all there (completed) or all undone (failed), every effect and every
//! compensation was applied exactly once, and the pools' totals are conserved.
//!
//! Every durable test runs on SQLite (module `sqlite`) and on PostgreSQL (module `postgres`,
//! a schema of its own per database); workers (`sagabox submit`, `sagabox worker`) finish a
//! queue while one of them is killed, or while their connections are terminated.
//!
//! The suite runs about 80 kill points per backend; `SAGABOX_CRASH_POINTS=1000 cargo test
//! --release --test end_to_end -- crash::` runs 1,000 in the main harness and as many more, proportionally,
//! elsewhere.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sagabox::backend::{Backend, Durability, RunRecord};
use sagabox::saga::journal::{self, EventKind};
use serde_json::{Value, json};
use support::*;

/// Each call of the harness's sagas sleeps this long, so that kills land mid-saga.
const DELAY_MS: u64 = 40;

fn call(id: &str, tool: &str, pool: &str, amount: Option<u64>, depends_on: Option<&[&str]>) -> Value {
    let mut arguments = json!({ "pool_id": pool, "delay_ms": DELAY_MS });
    if let Some(amount) = amount {
        arguments["amount"] = json!(amount);
    }
    let mut step = json!({ "id": id, "action": { "name": format!("slow_pool.{tool}"), "arguments": arguments } });
    if let Some(deps) = depends_on {
        step["depends_on"] = json!(deps);
    }
    step
}

fn allocate(id: &str, pool: &str, amount: u64) -> Value {
    call(id, "allocate", pool, Some(amount), None)
}

/// A directory with the slow plugin, its policy, and the harness's sagas, all with one
/// fixture (pool `cluster` of 50 units, pool `shared` of a million):
/// - `failing`: four allocations on `cluster`, the 4th overflows it: the run rolls back;
/// - `completing`: three allocations on `cluster` (45 units);
/// - `dag`: `a1`, then `a2` and `a3` and a read-only `c` in parallel, then `a4` (26 units);
/// - `mixed`: allocations between a query (`check`) and an action that writes nothing
///   (`peek`, whose undo finds nothing to undo) (6 units).
fn setup(dir: &Path) {
    install_slow_pool(dir);
    let cluster = |id: &str, amount: u64| allocate(id, "cluster", amount);
    let dag = vec![
        allocate("a1", "shared", 5),
        call("a2", "allocate", "shared", Some(6), Some(&["a1"])),
        call("a3", "allocate", "shared", Some(7), Some(&["a1"])),
        call("c", "check", "shared", None, Some(&["a1"])),
        call("a4", "allocate", "shared", Some(8), Some(&["a2", "a3", "c"])),
    ];
    let mixed = vec![
        call("c0", "check", "shared", None, None),
        allocate("a1", "shared", 1),
        call("p1", "peek", "shared", None, None),
        allocate("a2", "shared", 2),
        call("c2", "check", "shared", None, None),
        allocate("a3", "shared", 3),
    ];
    let sagas = [
        ("failing", vec![cluster("a1", 10), cluster("a2", 15), cluster("a3", 20), cluster("a4", 30)]),
        ("completing", vec![cluster("a1", 10), cluster("a2", 15), cluster("a3", 20)]),
        ("dag", dag),
        ("mixed", mixed),
    ];
    let fixture = json!({ "pools": {
        "cluster": { "pool_id": "cluster", "capacity": 50, "allocated": 0 },
        "shared": { "pool_id": "shared", "capacity": 1_000_000, "allocated": 0 } } });
    for (name, steps) in sagas {
        let saga = json!({ "saga": { "steps": steps, "ledgers": ["executions"], "timeout": "60s" } });
        std::fs::write(dir.join(format!("{name}.json")), saga.to_string()).unwrap();
        std::fs::write(dir.join(format!("{name}.fixture.json")), fixture.to_string()).unwrap();
    }
}

/// Sets the delay of every call of the saga `name` in `dir`.
fn set_delay(dir: &Path, name: &str, delay_ms: u64) {
    let path = dir.join(format!("{name}.json"));
    let mut saga: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for step in saga["saga"]["steps"].as_array_mut().unwrap() {
        step["action"]["arguments"]["delay_ms"] = json!(delay_ms);
    }
    std::fs::write(&path, saga.to_string()).unwrap();
}

/// Which backend a test runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Sqlite,
    Postgres,
}

/// A database of a test: a SQLite file in the test's directory, or a PostgreSQL schema of
/// its own (dropped with the value).
enum Db {
    Sqlite(PathBuf),
    Postgres(support::postgres::Schema),
}

impl Db {
    /// A new database: nothing is created for SQLite (sagabox creates the file); an empty
    /// schema for PostgreSQL (sagabox creates its tables on connecting). `name` is short:
    /// schema names have at most 63 characters.
    fn new(kind: Kind, dir: &Path, name: &str) -> Db {
        match kind {
            Kind::Sqlite => Db::Sqlite(dir.join(format!("{name}.db"))),
            Kind::Postgres => Db::Postgres(support::postgres::Schema::new(name)),
        }
    }

    /// The `--db` value.
    fn arg(&self) -> &str {
        match self {
            Db::Sqlite(path) => path.to_str().unwrap(),
            Db::Postgres(schema) => &schema.url,
        }
    }

    /// Whether a process created the database (a schema is always there).
    fn exists(&self) -> bool {
        match self {
            Db::Sqlite(path) => path.exists(),
            Db::Postgres(_) => true,
        }
    }

    fn open(&self) -> Arc<dyn Backend> {
        sagabox::backend::open(self.arg(), Durability::Normal, true).unwrap()
    }

    /// Opens the new database and seeds it with the fixture at `fixture`.
    fn seeded(&self, fixture: &Path) -> Arc<dyn Backend> {
        let db = self.open();
        assert!(db.seed_if_new(&sagabox::store::fixture::load(fixture).unwrap()).unwrap(), "{} was not new", db.name());
        db
    }
}

fn sagabox(dir: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sagabox"));
    cmd.env("SAGABOX_CACHE_DIR", shared_cache())
        .args(["--no-bundled", "--plugins"])
        .arg(dir.join("plugins"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

/// A run the harness starts: a saga, the faults injected into it, and how it must end.
#[derive(Clone, Copy, Debug)]
struct Plan {
    saga: &'static str,
    faults: &'static [&'static str],
    /// `completed` or `failed`.
    expect: &'static str,
    /// How many calls the run makes (compensations included): a bound on when to kill it.
    calls: u64,
}

/// How long a run of a plan takes here, uninterrupted: until it is registered, and then.
#[derive(Clone, Copy, Debug)]
struct Window {
    startup_ms: u64,
    run_ms: u64,
}

impl Window {
    /// A kill instant: mostly while the run runs, sometimes before it is registered.
    fn pick(&self, rng: &mut ChaCha8Rng) -> Duration {
        let ms = if rng.random_bool(0.15) {
            rng.random_range(5..self.startup_ms.max(6))
        } else {
            // Skewed late: the first call also instantiates the plugin, and compensations
            // come last.
            self.startup_ms + (self.run_ms as f64 * rng.random::<f64>().sqrt()) as u64
        };
        Duration::from_millis(ms)
    }
}

/// Each plan's window on one backend, measured once by running it.
struct Windows {
    kind: Kind,
    windows: BTreeMap<String, Window>,
}

impl Windows {
    fn new(kind: Kind) -> Windows {
        Windows { kind, windows: BTreeMap::new() }
    }

    fn of(&mut self, dir: &Path, plan: &Plan) -> Window {
        let name = format!("{} {:?}", plan.saga, plan.faults);
        let kind = self.kind;
        *self.windows.entry(name).or_insert_with(|| {
            let db = Db::new(kind, dir, &format!("calibrate_{}_{}", plan.saga, plan.faults.len()));
            let spawned = now_ms();
            start(dir, &db, plan, "calibrate").wait().unwrap();
            let run = db.open().runs().unwrap().remove(0);
            let startup_ms = run.started_ms.saturating_sub(spawned);
            // Never less than the calls' own sleeps.
            let run_ms = run.finished_ms.unwrap_or(0).saturating_sub(run.started_ms).max(plan.calls * DELAY_MS);
            Window { startup_ms, run_ms }
        })
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

const PLANS: [Plan; 6] = [
    Plan { saga: "failing", faults: &[], expect: "failed", calls: 7 },
    Plan { saga: "completing", faults: &[], expect: "completed", calls: 3 },
    Plan { saga: "dag", faults: &[], expect: "completed", calls: 5 },
    // The DAG rolls back both branches.
    Plan { saga: "dag", faults: &["a4:rejected"], expect: "failed", calls: 8 },
    Plan { saga: "mixed", faults: &[], expect: "completed", calls: 6 },
    // Rolls back through a peek whose undo has nothing to undo.
    Plan { saga: "mixed", faults: &["a3:rejected"], expect: "failed", calls: 8 },
];

/// A step whose effect commits but whose reply is lost: the run compensates it.
const LOST: [Plan; 2] = [
    Plan { saga: "completing", faults: &["a2:lost_response"], expect: "failed", calls: 4 },
    Plan { saga: "dag", faults: &["a3:lost_response"], expect: "failed", calls: 7 },
];

/// The number of kill points of a test: `default`, or scaled by `SAGABOX_CRASH_POINTS`
/// (the main harness's count, 48 by default).
fn points(default: u64) -> u64 {
    match std::env::var("SAGABOX_CRASH_POINTS").ok().and_then(|v| v.parse::<u64>().ok()) {
        Some(n) => (n * default / 48).max(1),
        None => default,
    }
}

fn start(dir: &Path, db: &Db, plan: &Plan, run_id: &str) -> Child {
    let mut cmd = sagabox(dir);
    cmd.args(["run", dir.join(format!("{}.json", plan.saga)).to_str().unwrap(), "--db", db.arg()]);
    cmd.args(["--run-id", run_id]);
    for fault in plan.faults {
        cmd.args(["--fault", fault]);
    }
    cmd.spawn().unwrap()
}

fn kill_after(mut child: Child, after: Duration) {
    std::thread::sleep(after);
    let _ = child.kill(); // SIGKILL
    let _ = child.wait();
}

/// Resumes every unfinished run; it must not fail to run (a failed saga is fine).
fn resume(dir: &Path, db: &Db, context: &str) {
    let out = sagabox(dir).args(["resume", "--db", db.arg()]).output().unwrap();
    assert!(
        out.status.code().is_some_and(|c| c <= 1),
        "{context}: resume failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Where a run was when it was killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    NotStarted,
    Forward,
    Compensating,
    Finished,
}

fn phase_of(db: &Db, run_id: &str) -> Phase {
    if !db.exists() {
        return Phase::NotStarted;
    }
    let db = db.open();
    let Some(run) = db.runs().unwrap().into_iter().find(|r| r.run_id == run_id) else { return Phase::NotStarted };
    if run.status != "running" {
        return Phase::Finished;
    }
    let events = db.events(&run.run_id).unwrap();
    if events.iter().any(|e| e.event == EventKind::CompensationTriggered || e.event == EventKind::CompensationCompleted)
    {
        Phase::Compensating
    } else {
        Phase::Forward
    }
}

/// One execution the slow plugin recorded.
struct Execution {
    tool: String,
    key: String,
    forward_key: Option<String>,
    /// The allocation it created or released.
    allocation: String,
    run: String,
}

fn executions(state: &sagabox::store::State) -> Vec<Execution> {
    let text = |v: &Value| v.as_str().map(String::from);
    state
        .namespace("executions")
        .into_iter()
        .flat_map(|n| n.iter())
        .map(|(_, doc)| {
            let r: Value = serde_json::from_str(&doc.text).unwrap();
            Execution {
                tool: text(&r["tool"]).unwrap(),
                key: text(&r["key"]).unwrap(),
                forward_key: text(&r["forward_key"]),
                allocation: text(&r["allocation"]).unwrap(),
                run: text(&r["run"]).unwrap(),
            }
        })
        .collect()
}

/// The number of allocations a saga makes, and their units.
fn allocations_of(saga: &str) -> (usize, u64) {
    match saga {
        "failing" | "completing" => (3, 45),
        "dag" => (4, 26),
        "mixed" => (3, 6),
        other => panic!("unknown saga {other}"),
    }
}

/// What the journal of `run_id` says its first failed step failed with, for a message.
fn first_failure(db: &dyn Backend, run_id: &str) -> String {
    let events = db.events(run_id).unwrap_or_default();
    journal::first_failure(&events).map_or(String::new(), |failure| format!(" ({failure})"))
}

/// Checks a database after its last resume: `runs` are the runs started on it. Returns how
/// each registered run ended.
fn check_all_or_nothing(db: &Db, runs: &[(String, Plan)], context: &str) -> Vec<String> {
    let mut outcomes = Vec::new();
    if !db.exists() {
        return outcomes;
    }
    let db = db.open();
    let registered = db.runs().unwrap();
    assert!(registered.iter().all(|r| r.status != "running"), "{context}: a run is still unfinished: {registered:?}");
    let state = db.current_state().unwrap();
    let executions = executions(&state);
    // Every effect and every compensation applied at most once...
    let mut applied: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for e in &executions {
        *applied.entry((&e.tool, &e.key)).or_default() += 1;
    }
    for ((tool, key), n) in &applied {
        assert_eq!(*n, 1, "{context}: {tool} with key {key} was applied {n} times");
    }
    let releases: BTreeSet<&str> =
        executions.iter().filter(|e| e.tool == "release").filter_map(|e| e.forward_key.as_deref()).collect();
    let mut expected_units: BTreeMap<&str, u64> = BTreeMap::new();
    for (run_id, plan) in runs {
        let context = format!("{context}, run {run_id} ({} {:?})", plan.saga, plan.faults);
        let effects: Vec<&Execution> = executions.iter().filter(|e| &e.run == run_id && e.tool == "allocate").collect();
        let Some(record) = registered.iter().find(|r| &r.run_id == run_id) else {
            // Killed before it was registered: it did nothing.
            assert!(effects.is_empty(), "{context}: effects of an unregistered run");
            continue;
        };
        // A resume does not inject the faults again: a run killed before its fault fired
        // completes.
        let completed = record.status == "completed";
        assert!(
            record.status == plan.expect || (completed && !plan.faults.is_empty()),
            "{context}: {}{}",
            record.status,
            first_failure(&*db, run_id)
        );
        outcomes.push(record.status.clone());
        let (count, units) = allocations_of(plan.saga);
        for effect in &effects {
            let key = &effect.key;
            let present = state.get("allocations", &effect.allocation).is_some();
            let released = releases.contains(key.as_str());
            // ...and exactly once: a completed run's effects stand, a failed run's are undone.
            if completed {
                assert!(present && !released, "{context}: effect {key} present {present}, released {released}");
            } else {
                assert!(!present && released, "{context}: effect {key} present {present}, released {released}");
            }
        }
        if completed {
            assert_eq!(effects.len(), count, "{context}: allocations");
            let pool = if plan.saga == "dag" || plan.saga == "mixed" { "shared" } else { "cluster" };
            *expected_units.entry(pool).or_default() += units;
        }
        check_journal(&*db, run_id, &context);
    }
    // No compensation of an effect that does not exist; the pools' totals are conserved.
    let effects: BTreeSet<&str> = executions.iter().filter(|e| e.tool == "allocate").map(|e| e.key.as_str()).collect();
    assert!(releases.iter().all(|k| effects.contains(k)), "{context}: a release of nothing");
    for pool in ["cluster", "shared"] {
        let (allocated, sum) = pool_and_allocations(&state, pool);
        assert_eq!(allocated, sum, "{context}: pool {pool} disagrees with its allocations");
        assert_eq!(allocated, expected_units.get(pool).copied().unwrap_or(0), "{context}: pool {pool}");
    }
    outcomes
}

/// A finished run's journal: in order, ending with its end, no step completed twice.
fn check_journal(db: &dyn Backend, run_id: &str, context: &str) {
    let events = db.events(run_id).unwrap();
    for kind in [EventKind::StepCompleted, EventKind::CompensationCompleted] {
        let mut per_step: BTreeMap<&str, usize> = BTreeMap::new();
        for e in events.iter().filter(|e| e.event == kind && e.replayed != Some(true)) {
            *per_step.entry(e.step.as_deref().unwrap()).or_default() += 1;
        }
        assert!(per_step.values().all(|n| *n == 1), "{context}: {kind:?} recorded twice: {per_step:?}");
    }
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{context}: journal out of order");
    assert_eq!(events.last().map(|e| e.event), Some(EventKind::SagaFinished), "{context}");
}

/// Runs `plan` on a new database, kills it at a seeded instant, optionally kills a resume
/// too, resumes, and checks. Returns where the run was when killed, and how it ended.
fn kill_and_resume(
    kind: Kind,
    dir: &Path,
    point: u64,
    plan: &Plan,
    window: Window,
    kill_resume: bool,
) -> (Phase, Option<String>) {
    let mut rng = ChaCha8Rng::seed_from_u64(point);
    let db = Db::new(kind, dir, &format!("crash_{point}_{}", plan.saga));
    let run_id = format!("run-{point}");
    let kill_after_run = window.pick(&mut rng);
    kill_after(start(dir, &db, plan, &run_id), kill_after_run);
    let phase = phase_of(&db, &run_id);
    let mut context = format!("{kind:?} point {point} (killed after {kill_after_run:?} in {phase:?}");
    if kill_resume && db.exists() {
        let after = window.pick(&mut rng);
        let child = sagabox(dir).args(["resume", "--db", db.arg()]).spawn().unwrap();
        kill_after(child, after);
        context += &format!(", resume killed after {after:?} in {:?}", phase_of(&db, &run_id));
    }
    context += ")";
    if db.exists() {
        resume(dir, &db, &context);
    }
    let outcome = check_all_or_nothing(&db, &[(run_id, *plan)], &context).pop();
    if let Db::Sqlite(path) = &db {
        let _ = std::fs::remove_file(path);
    }
    (phase, outcome)
}

/// Where runs were killed, and how runs with faults ended.
#[derive(Debug, Default)]
struct Tally {
    phases: BTreeMap<String, usize>,
    faulted: BTreeMap<String, usize>,
}

impl Tally {
    fn add(&mut self, plan: &Plan, (phase, outcome): (Phase, Option<String>)) {
        *self.phases.entry(format!("{phase:?}")).or_default() += 1;
        if let Some(outcome) = outcome.filter(|_| !plan.faults.is_empty()) {
            *self.faulted.entry(outcome).or_default() += 1;
        }
    }

    fn count(&self, phase: &str) -> usize {
        self.phases.get(phase).copied().unwrap_or(0)
    }
}

/// Kills and resumes `count` runs of `plans` (in turn) at seeded instants from `first` on;
/// `kill_resume` says for which points the resume is killed once too.
fn kill_points(kind: Kind, first: u64, count: u64, plans: &[Plan], kill_resume: impl Fn(u64) -> bool) -> Tally {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let (mut tally, mut windows) = (Tally::default(), Windows::new(kind));
    for point in first..first + count {
        let plan = &plans[point as usize % plans.len()];
        let window = windows.of(dir.path(), plan);
        tally.add(plan, kill_and_resume(kind, dir.path(), point, plan, window, kill_resume(point)));
    }
    println!("{kind:?}: {count} kill points: {tally:?}");
    tally
}

fn a_run_killed_at_any_instant_resumes_to_all_or_nothing(kind: Kind) {
    let points = points(48);
    let tally = kill_points(kind, 0, points, &PLANS, |_| false);
    // The seeded instants must catch runs mid-flight, both forward and compensating, and
    // injected faults must fire.
    assert!(tally.count("Forward") >= points as usize / 5, "{tally:?}");
    assert!(tally.count("Compensating") >= 1, "{tally:?}");
    assert!(tally.faulted.contains_key("failed"), "{tally:?}");
}

fn a_resume_killed_at_any_instant_resumes_again_to_all_or_nothing(kind: Kind) {
    // Other seeds than the main harness's.
    kill_points(kind, 10_000, points(12), &PLANS, |_| true);
}

fn a_run_with_a_lost_reply_killed_at_any_instant_resumes_to_all_or_nothing(kind: Kind) {
    let tally = kill_points(kind, 20_000, points(12), &LOST, |point| point % 3 == 0);
    assert!(tally.faulted.contains_key("failed"), "{tally:?}");
}

fn processes_killed_on_one_new_database_resume_to_all_or_nothing(kind: Kind) {
    let points = points(8);
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let mut windows = Windows::new(kind);
    for point in 0..points {
        let mut rng = ChaCha8Rng::seed_from_u64(30_000 + point);
        let db = Db::new(kind, dir.path(), &format!("shared_{point}"));
        // Four runs start at once on a database none of them has seeded yet.
        let plans = [PLANS[1], PLANS[2], PLANS[3], PLANS[5]];
        let runs: Vec<(String, Plan)> = plans.iter().enumerate().map(|(i, p)| (format!("p{point}-{i}"), *p)).collect();
        // Each is killed at its own instant (some after they finished).
        let afters: Vec<Duration> =
            plans.iter().map(|plan| windows.of(dir.path(), plan).pick(&mut rng).mul_f64(1.2)).collect();
        let started = std::time::Instant::now();
        let mut children: Vec<(Child, Duration)> =
            runs.iter().zip(afters).map(|((id, plan), after)| (start(dir.path(), &db, plan, id), after)).collect();
        let mut killed = Vec::new();
        children.sort_by_key(|(_, after)| *after);
        for (mut child, after) in children {
            std::thread::sleep(after.saturating_sub(started.elapsed()));
            let _ = child.kill();
            let _ = child.wait();
            killed.push(after);
        }
        let mut context = format!("{kind:?} point {point} (runs killed after {killed:?}");
        if point % 2 == 1 && db.exists() {
            let after = windows.of(dir.path(), &PLANS[3]).pick(&mut rng);
            let child = sagabox(dir.path()).args(["resume", "--db", db.arg()]).spawn().unwrap();
            kill_after(child, after);
            context += &format!(", resume killed after {after:?}");
        }
        context += ")";
        if db.exists() {
            resume(dir.path(), &db, &context);
        }
        check_all_or_nothing(&db, &runs, &context);
    }
}

fn concurrent_processes_on_one_database_keep_state_and_journals_consistent(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let db = Db::new(kind, dir.path(), "concurrent");
    // Seed first, so that the racing processes find the state there.
    drop(db.seeded(&dir.path().join("completing.fixture.json")));
    let children: Vec<_> = (0..4)
        .map(|_| {
            sagabox(dir.path())
                .args(["run", dir.path().join("completing.json").to_str().unwrap(), "--db", db.arg()])
                .spawn()
                .unwrap()
        })
        .collect();
    for mut child in children {
        child.wait().unwrap();
    }
    let db = db.open();
    let runs = db.runs().unwrap();
    assert_eq!(runs.len(), 4);
    let completed = runs.iter().filter(|r| r.status == "completed").count();
    assert!(runs.iter().all(|r| r.status == "completed" || r.status == "failed"), "{runs:?}");
    let state = db.snapshot();
    let pool: Value = serde_json::from_str(&state.get("pools", "cluster").unwrap().text).unwrap();
    // Each completed run holds 45 of the 50 units; the others rolled back everything.
    assert_eq!(pool["allocated"], json!(45 * completed));
    assert!(completed <= 1, "only one run fits in the pool");
    for run in &runs {
        let events = db.events(&run.run_id).unwrap();
        let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (0..events.len() as u64).collect::<Vec<_>>(), "{}: journal has gaps", run.run_id);
        assert!(events.iter().all(|e| e.run_id == run.run_id));
        assert_eq!(events.first().unwrap().event, EventKind::SagaStarted);
        assert_eq!(events.last().unwrap().event, EventKind::SagaFinished);
    }
}

fn many_sagas_in_one_process_share_one_database(kind: Kind) {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(many_sagas_in_one_process(kind));
}

async fn many_sagas_in_one_process(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    let handle = Db::new(kind, dir.path(), "one");
    let db = handle.open();
    let fixture = json!({ "pools": { "p": { "capacity": 1000, "allocated": 0 } } });
    assert!(db.seed_if_new(&sagabox::store::State::from_json(&fixture).unwrap()).unwrap());
    std::fs::write(
        dir.path().join("two.json"),
        json!({ "saga": { "steps": [
            { "id": "x", "action": { "name": "resources.allocate", "arguments": { "pool_id": "p", "amount": 3 } } },
            { "id": "y", "action": { "name": "resources.allocate", "arguments": { "pool_id": "p", "amount": 4 } } }
        ] } })
        .to_string(),
    )
    .unwrap();
    let runtime = std::sync::Arc::new(runtime().await);
    let saga = std::sync::Arc::new(sagabox::saga::Saga::load(&dir.path().join("two.json"), &runtime).unwrap());
    let mut tasks = Vec::new();
    for i in 0..24 {
        let (runtime, saga, db) = (runtime.clone(), saga.clone(), db.clone());
        tasks.push(tokio::spawn(async move {
            let options = sagabox::saga::RunOptions::new(format!("run-{i:02}"), json!({}));
            sagabox::saga::run(&runtime, &saga, &*db, options).await
        }));
    }
    for task in tasks {
        assert_eq!(task.await.unwrap().status, sagabox::saga::Status::Completed);
    }
    let state = db.current_state().unwrap();
    let pool: Value = serde_json::from_str(&state.get("pools", "p").unwrap().text).unwrap();
    assert_eq!(pool["allocated"], 24 * 7);
    assert_eq!(state.namespace("allocations").unwrap().len(), 48);
    for i in 0..24 {
        let events = db.events(&format!("run-{i:02}")).unwrap();
        let kinds: Vec<EventKind> = events.iter().map(|e| e.event).collect();
        assert_eq!(
            kinds,
            [
                EventKind::SagaStarted,
                EventKind::StepStarted,
                EventKind::StepCompleted,
                EventKind::StepStarted,
                EventKind::StepCompleted,
                EventKind::SagaFinished
            ],
            "run-{i:02}"
        );
        assert!(events.iter().enumerate().all(|(n, e)| e.seq == n as u64));
    }
}

fn resume_reports_a_run_it_cannot_rebuild_and_still_finishes_the_others(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let handle = Db::new(kind, dir.path(), "two");
    let db = handle.seeded(&dir.path().join("completing.fixture.json"));
    let record = |run_id: &str, definition: String| RunRecord {
        run_id: run_id.into(),
        saga: "s".into(),
        saga_path: "s.json".into(),
        definition,
        input: json!({}),
        seed: 1,
        status: "running".into(),
        pid: u32::MAX, // no such process
        owner: String::new(),
        lease_until_ms: None,
        started_ms: 0,
        finished_ms: None,
    };
    let gone = json!({ "saga": { "steps": [{ "id": "a", "action": { "name": "removed_plugin.tool" } }] } });
    db.register_run(&record("broken", gone.to_string())).unwrap();
    db.register_run(&record("fine", std::fs::read_to_string(dir.path().join("completing.json")).unwrap())).unwrap();
    drop(db);

    let out = sagabox(dir.path()).args(["resume", "--db", handle.arg()]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("cannot rebuild run broken") && stderr.contains("removed_plugin.tool"), "{stderr}");
    assert!(stderr.contains("1 run(s) left unfinished: broken"), "{stderr}");
    let runs = handle.open().runs().unwrap();
    let status = |id: &str| runs.iter().find(|r| r.run_id == id).unwrap().status.clone();
    assert_eq!(status("fine"), "completed");
    assert_eq!(status("broken"), "running");
}

/// `interleaved.json`: allocations on the `shared` pool interleaved with steps that write nothing
/// (`check`, a query; `peek`, an action whose undo finds nothing to undo).
fn setup_interleaved(dir: &Path) {
    setup(dir);
    let call = |id: &str, tool: &str, amount: Option<u64>| {
        let mut arguments = json!({ "pool_id": "shared", "delay_ms": 2 });
        if let Some(amount) = amount {
            arguments["amount"] = json!(amount);
        }
        json!({ "id": id, "action": { "name": format!("slow_pool.{tool}"), "arguments": arguments } })
    };
    let mut steps = vec![call("c0", "check", None)];
    for n in 1..=6 {
        steps.push(call(&format!("a{n}"), "allocate", Some(n)));
        steps.push(call(&format!("p{n}"), if n % 2 == 0 { "check" } else { "peek" }, None));
    }
    let saga = json!({ "saga": { "steps": steps, "ledgers": ["executions"], "timeout": "60s" } });
    std::fs::write(dir.join("interleaved.json"), saga.to_string()).unwrap();
    let fixture = json!({ "pools": { "shared": { "pool_id": "shared", "capacity": 1_000_000, "allocated": 0 } } });
    std::fs::write(dir.join("interleaved.fixture.json"), fixture.to_string()).unwrap();
}

/// What one allocation step of a run left: its allocation id, from the journal.
fn allocation_ids(db: &dyn Backend, run_id: &str) -> Vec<String> {
    let events = db.events(run_id).unwrap();
    events
        .iter()
        .filter(|e| e.event == EventKind::StepCompleted && e.step.as_deref().is_some_and(|s| s.starts_with('a')))
        .filter_map(|e| e.data.as_ref()?.get("allocation_id")?.as_str().map(String::from))
        .collect()
}

/// The `allocated` counter of a pool, and the sum of its allocations' amounts.
fn pool_and_allocations(state: &sagabox::store::State, pool: &str) -> (u64, u64) {
    let doc = |text: &str| serde_json::from_str::<Value>(text).unwrap();
    // No pool: a process was killed before it seeded the database.
    let allocated = state.get("pools", pool).map_or(0, |d| doc(&d.text)["allocated"].as_u64().unwrap());
    let sum = state
        .namespace("allocations")
        .into_iter()
        .flat_map(|n| n.iter())
        .map(|(_, d)| doc(&d.text))
        .filter(|a| a["pool_id"] == pool)
        .map(|a| a["amount"].as_u64().unwrap())
        .sum();
    (allocated, sum)
}

fn processes_mixing_read_only_steps_and_allocations_lose_no_update(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    setup_interleaved(dir.path());
    let handle = Db::new(kind, dir.path(), "interleaved");
    drop(handle.seeded(&dir.path().join("interleaved.fixture.json")));
    let saga = dir.path().join("interleaved.json");
    let children: Vec<_> = (0..6)
        .map(|i| {
            let mut cmd = sagabox(dir.path());
            cmd.args(["run", saga.to_str().unwrap(), "--db", handle.arg(), "--run-id", &format!("m{i}")]);
            // Every other run fails at its last allocation and releases the others (and
            // "undoes" its peeks, which have nothing to undo).
            if i % 2 == 1 {
                cmd.args(["--fault", "a6:rejected"]);
            }
            cmd.spawn().unwrap()
        })
        .collect();
    for mut child in children {
        child.wait().unwrap();
    }
    let db = handle.open();
    let state = db.current_state().unwrap();
    let (allocated, sum) = pool_and_allocations(&state, "shared");
    assert_eq!(allocated, sum, "the pool's counter disagrees with its allocations: an update was lost");
    let runs = db.runs().unwrap();
    assert_eq!(runs.len(), 6, "every process registered its run");
    let mut expected = 0;
    for run in runs {
        let ids = allocation_ids(&*db, &run.run_id);
        let present = ids.iter().filter(|id| state.get("allocations", id).is_some()).count();
        if run.run_id.trim_start_matches('m').parse::<u32>().unwrap() % 2 == 0 {
            assert_eq!(run.status, "completed", "{}", run.run_id);
            assert_eq!((ids.len(), present), (6, 6), "{}: an allocation is missing", run.run_id);
            expected += 21;
        } else {
            assert_eq!(run.status, "failed", "{}", run.run_id);
            assert_eq!((ids.len(), present), (5, 0), "{}: an allocation was not released", run.run_id);
        }
    }
    assert_eq!(allocated, expected);
}

/// SQLite only: a file that is not there (a PostgreSQL database is created by its server).
#[test]
fn reading_commands_on_a_missing_database_fail_and_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let missing = dir.path().join("missing.db");
    let m = missing.to_str().unwrap();
    for args in
        [vec!["resume", "--db", m], vec!["runs", "--db", m], vec!["journal", "--db", m, "r"], vec!["state", "--db", m]]
    {
        let out = sagabox(dir.path()).args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(m), "{args:?} does not name the file: {stderr}");
        assert!(!missing.exists(), "{args:?} created {m}");
    }
}

fn reusing_a_run_id_names_the_run_and_the_database(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let handle = Db::new(kind, dir.path(), "reuse");
    let db = handle.arg();
    let saga = dir.path().join("completing.json");
    let run =
        || sagabox(dir.path()).args(["run", saga.to_str().unwrap(), "--db", db, "--run-id", "r1"]).output().unwrap();
    assert_eq!(run().status.code(), Some(0));
    let again = run();
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert_eq!(again.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(&format!("run 'r1' already exists in {db} (completed)")), "{stderr}");
    assert!(stderr.contains("choose another --run-id"), "{stderr}");
    assert!(!stderr.contains("UNIQUE"), "{stderr}");
    // An unfinished run: the message says how to finish it.
    let backend = handle.open();
    let mut record = backend.runs().unwrap().remove(0);
    record.run_id = "r2".into();
    record.status = "running".into();
    record.finished_ms = None;
    backend.register_run(&record).unwrap();
    let out = sagabox(dir.path()).args(["run", saga.to_str().unwrap(), "--db", db, "--run-id", "r2"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("`sagabox resume --db {db} r2`")), "{stderr}");
}

fn resumes_started_at_once_run_an_interrupted_run_once(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let handle = Db::new(kind, dir.path(), "orphan");
    let db = handle.seeded(&dir.path().join("completing.fixture.json"));
    db.register_run(&RunRecord {
        run_id: "orphan".into(),
        saga: "completing".into(),
        saga_path: "completing.json".into(),
        definition: std::fs::read_to_string(dir.path().join("completing.json")).unwrap(),
        input: json!({}),
        seed: 1,
        status: "running".into(),
        pid: u32::MAX, // no such process
        owner: String::new(),
        lease_until_ms: None,
        started_ms: 0,
        finished_ms: None,
    })
    .unwrap();
    drop(db);
    let children: Vec<_> = (0..4)
        .map(|_| sagabox(dir.path()).args(["resume", "--db", handle.arg()]).stdout(Stdio::piped()).spawn().unwrap())
        .collect();
    let outputs: Vec<_> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    let ran = outputs.iter().filter(|o| String::from_utf8_lossy(&o.stdout).contains("(run orphan)")).count();
    let stderr: Vec<_> = outputs.iter().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).collect();
    assert_eq!(ran, 1, "the run was resumed {ran} times: {stderr:?}");
    let db = handle.open();
    let events = db.events("orphan").unwrap();
    // It never started before: the one resume starts it.
    let starts = events.iter().filter(|e| matches!(e.event, EventKind::SagaStarted | EventKind::SagaResumed)).count();
    assert_eq!(starts, 1, "{:?}", events.iter().map(|e| e.event).collect::<Vec<_>>());
    assert_eq!(db.runs().unwrap()[0].status, "completed");
}

/// Queues `count` runs of the saga `name` (ids `{name}{batch}-1` and on, or `{name}{batch}`
/// for one); returns their ids.
fn submit(dir: &Path, db: &str, name: &str, batch: usize, count: u64) -> Vec<String> {
    let saga = dir.join(format!("{name}.json"));
    let base = format!("{name}{batch}");
    let count_arg = count.to_string();
    let out = sagabox(dir)
        .args(["submit", saga.to_str().unwrap(), "--db", db, "--count", &count_arg, "--run-id", &base])
        .stdout(Stdio::piped())
        .output()
        .unwrap();
    assert!(out.status.success(), "submit {name}: {}", String::from_utf8_lossy(&out.stderr));
    let ids: Vec<String> = String::from_utf8(out.stdout).unwrap().lines().map(String::from).collect();
    // One run takes the id as given.
    let expected: Vec<String> = match count {
        1 => vec![base],
        _ => (1..=count).map(|n| format!("{base}-{n}")).collect(),
    };
    assert_eq!(ids, expected, "submit prints the runs' ids");
    ids
}

/// Queues `n` runs, of the sagas that end the same however runs interleave: `failing` (it
/// cannot fit its pool: rolled back), `dag` and `mixed` (on a pool that never fills:
/// completed), in three batches of each, so that the queue mixes them. Their calls sleep
/// `delay_ms`.
fn queue(dir: &Path, db: &str, n: u64, delay_ms: u64) -> Vec<(String, Plan)> {
    let plans = [PLANS[0], PLANS[2], PLANS[4]];
    for plan in &plans {
        set_delay(dir, plan.saga, delay_ms);
    }
    let submits = 3 * plans.len() as u64;
    let mut runs = Vec::new();
    for i in 0..submits {
        let (plan, batch) = (&plans[i as usize % plans.len()], i as usize / plans.len());
        let count = n / submits + u64::from(i < n % submits);
        runs.extend(submit(dir, db, plan.saga, batch, count).into_iter().map(|id| (id, *plan)));
    }
    assert_eq!(runs.len() as u64, n);
    runs
}

/// A worker that exits once no run is left, with its stderr in `log`.
fn worker(dir: &Path, db: &str, log: &Path) -> Child {
    sagabox(dir)
        .args(["worker", "--db", db, "--until-done", "--lease", "2s", "--concurrency", "8"])
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap()
}

/// Waits, polling, until `done` says so; fails with `what` after `limit`.
fn wait_for(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < limit, "{what}: not after {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits for workers to exit by themselves (`--until-done`); each must have finished what
/// it took (a rolled-back run makes it exit 1).
fn wait_for_workers(mut workers: Vec<(Child, PathBuf)>, limit: Duration) {
    let started = Instant::now();
    let logs = |workers: &[(Child, PathBuf)]| -> String {
        workers
            .iter()
            .map(|(_, log)| std::fs::read_to_string(log).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n--\n")
    };
    for n in 0..workers.len() {
        let status = loop {
            if let Some(status) = workers[n].0.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > limit {
                for (child, _) in &mut workers {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                panic!("the workers did not finish within {limit:?}: {}", logs(&workers));
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let log = std::fs::read_to_string(&workers[n].1).unwrap();
        assert!(status.code().is_some_and(|c| c <= 1), "a worker failed ({status}): {log}");
        assert!(log.contains("; 0 could not run"), "a worker left runs unfinished: {log}");
    }
}

/// How many of `runs` are finished (neither queued nor running).
fn finished(runs: &[RunRecord]) -> usize {
    runs.iter().filter(|r| r.status != "queued" && r.status != "running").count()
}

/// Checks a queue the workers say they finished: every run ended as its plan says, all or
/// nothing, each effect and compensation applied once, the pools' totals conserved.
fn check_queue(db: &Db, runs: &[(String, Plan)], context: &str) {
    let registered = db.open().runs().unwrap();
    assert_eq!(registered.len(), runs.len(), "{context}: runs in the database");
    let left: Vec<_> = registered.iter().filter(|r| r.status == "queued" || r.status == "running").collect();
    assert!(left.is_empty(), "{context}: {} runs left unfinished: {left:?}", left.len());
    let outcomes = check_all_or_nothing(db, runs, context);
    assert_eq!(outcomes.len(), runs.len(), "{context}");
}

/// The issue's acceptance test: 4 workers (8 runs at once each, 2s leases) take `n` queued
/// runs; one is killed while it holds runs. The others take its runs over once their
/// leases run out, and every run ends as its plan says, each effect applied once.
fn workers_finish_every_queued_run_when_one_is_killed(kind: Kind, n: u64) {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let db = Db::new(kind, dir.path(), "queue");
    let started = Instant::now();
    let runs = queue(dir.path(), db.arg(), n, 5);
    let queued_in = started.elapsed();
    let monitor = db.open();
    let mut workers: Vec<(Child, PathBuf)> = (0..4)
        .map(|i| {
            let log = dir.path().join(format!("worker-{i}.log"));
            (worker(dir.path(), db.arg(), &log), log)
        })
        .collect();
    // Kill one once a quarter of the runs finished, while it holds runs.
    let (mut victim, victim_log) = workers.remove(1);
    let pid = victim.id();
    wait_for(Duration::from_secs(300), "a quarter of the runs finished, the victim holding some", || {
        let now = monitor.runs().unwrap();
        finished(&now) >= runs.len() / 4 && now.iter().any(|r| r.status == "running" && r.pid == pid)
    });
    victim.kill().unwrap();
    victim.wait().unwrap();
    let (killed_at, killed_after) = (now_ms(), started.elapsed());
    let at_kill = monitor.runs().unwrap();
    let held: Vec<&RunRecord> = at_kill.iter().filter(|r| r.status == "running" && r.pid == pid).collect();
    assert!(!held.is_empty(), "the victim held no run when killed: {}", std::fs::read_to_string(&victim_log).unwrap());
    let finished_at_kill = finished(&at_kill);
    assert!(finished_at_kill < runs.len(), "every run finished before the kill");

    wait_for_workers(workers, Duration::from_secs(600));
    let elapsed = started.elapsed();
    let context = format!("{kind:?}, {} runs, worker {pid} killed holding {} runs", runs.len(), held.len());
    check_queue(&db, &runs, &context);
    // The survivors took the victim's runs over, and only once their leases ran out.
    let after = monitor.runs().unwrap();
    let held_ids: BTreeSet<&str> = held.iter().map(|r| r.run_id.as_str()).collect();
    for run in held {
        let now = after.iter().find(|r| r.run_id == run.run_id).unwrap();
        assert_ne!(now.pid, pid, "{context}: run {} still the victim's", run.run_id);
        let lease = run.lease_until_ms.expect("a held run has a lease");
        assert!(lease <= killed_at + 2_000, "{context}: a lease beyond 2s");
        assert!(
            now.finished_ms.is_some_and(|f| f >= lease),
            "{context}: run {} finished at {:?}, before the victim's lease ran out at {lease}",
            run.run_id,
            now.finished_ms
        );
    }
    // Runs taken over from a live worker (its lease ran out while it was busy) are allowed
    // (each effect is still applied once, as checked), but worth seeing.
    let taken_from_live = runs
        .iter()
        .filter(|(id, _)| !held_ids.contains(id.as_str()))
        .filter(|(id, _)| {
            let events = monitor.events(id).unwrap();
            events.iter().filter(|e| matches!(e.event, EventKind::SagaStarted | EventKind::SagaResumed)).count() > 1
        })
        .count();
    println!(
        "{context}: queued in {queued_in:?}, killed after {killed_after:?} ({finished_at_kill} finished then), all \
         finished in {elapsed:?}; {taken_from_live} runs of live workers were taken over"
    );
}

fn workers_finish_every_queued_run_when_one_is_killed_on_sqlite() {
    workers_finish_every_queued_run_when_one_is_killed(Kind::Sqlite, worker_runs(WORKER_RUNS_SQLITE));
}

/// Runs queued for the workers: 1,000 on PostgreSQL, as the issue asks; 300 on SQLite
/// (one machine's database, tested beside it). `SAGABOX_WORKER_RUNS=N` queues N on both.
fn worker_runs(default: u64) -> u64 {
    std::env::var("SAGABOX_WORKER_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

const WORKER_RUNS: u64 = 1000;
const WORKER_RUNS_SQLITE: u64 = 300;

/// PostgreSQL only: while workers run queued runs, their server connections are terminated
/// (`pg_terminate_backend`) a few times; the backend reconnects, and every run still ends as
/// its plan says, each effect applied once.
fn workers_recover_when_their_connections_are_terminated() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let db = Db::new(Kind::Postgres, dir.path(), "conn_kill");
    let Db::Postgres(schema) = &db else { unreachable!() };
    // Only the workers' connections carry this name.
    let app = schema.name.clone();
    let url = format!("{}&application_name={app}", schema.url);
    let runs = queue(dir.path(), db.arg(), 150, 20);
    let monitor = db.open();
    let workers: Vec<(Child, PathBuf)> = (0..3)
        .map(|i| {
            let log = dir.path().join(format!("worker-{i}.log"));
            (worker(dir.path(), &url, &log), log)
        })
        .collect();
    let terminate = format!(
        "DO $$ BEGIN
           IF NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE application_name = '{app}') THEN
             RAISE EXCEPTION 'no connection of the workers';
           END IF;
           PERFORM pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = '{app}';
         END $$"
    );
    let times = 5;
    let mut at = Vec::new();
    for k in 1..=times {
        // Spread over the run: after each sixth of the runs finished.
        wait_for(Duration::from_secs(300), "runs finishing", || {
            finished(&monitor.runs().unwrap()) >= runs.len() * k / (times + 1)
        });
        wait_for(Duration::from_secs(60), "a connection of the workers to terminate", || {
            support::postgres::try_execute(&terminate).is_ok()
        });
        at.push(finished(&monitor.runs().unwrap()));
    }
    assert!(at.iter().all(|n| *n < runs.len()), "runs were in flight at each termination: {at:?}");
    let logs: Vec<PathBuf> = workers.iter().map(|(_, log)| log.clone()).collect();
    wait_for_workers(workers, Duration::from_secs(600));
    check_queue(&db, &runs, &format!("connections terminated {times} times, runs finished then: {at:?}"));
    let retries: usize = logs
        .iter()
        .map(|log| std::fs::read_to_string(log).unwrap().matches("retrying after a broken connection").count())
        .sum();
    println!(
        "connections terminated {times} times (runs finished then: {at:?}); the workers retried {retries} queries"
    );
}

/// A worker stalled past its lease in the middle of a call (SIGSTOP: what a starved
/// process looks like to the others) loses its run to another worker, which finishes it.
/// Woken while the other still runs it, the stalled worker's call returns and its commit is
/// refused (a fence): it writes nothing more into the run, compensates nothing, and says
/// so. The run completes once, as if it had had one holder after the take-over.
fn a_stalled_worker_writes_nothing_into_a_run_another_took_over(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    set_delay(dir.path(), "completing", 800);
    let db = Db::new(kind, dir.path(), "stall");
    let run_id = submit(dir.path(), db.arg(), "completing", 0, 1).remove(0);
    let monitor = db.open();
    let worker = |name: &str| {
        let log = dir.path().join(format!("{name}.log"));
        let child = sagabox(dir.path())
            .args(["worker", "--db", db.arg(), "--until-done", "--lease", "2s", "--concurrency", "1"])
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        (child, log)
    };
    let signal = |child: &Child, signal: libc::c_int| {
        // SAFETY: signals a child this test spawned and has not reaped.
        assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, signal) }, 0);
    };
    let (stalled, stalled_log) = worker("stalled");
    // If the test fails half-way, no worker outlives it (a stopped one would never exit).
    let mut strays = Strays(vec![stalled.id()]);
    // Stopped inside its second call (of 800 ms), once the first committed.
    wait_for(Duration::from_secs(120), "the first step committed", || {
        monitor.events(&run_id).unwrap().iter().any(|e| e.event == EventKind::StepCompleted)
    });
    std::thread::sleep(Duration::from_millis(300));
    signal(&stalled, libc::SIGSTOP);
    let (other, other_log) = worker("other");
    strays.0.push(other.id());
    wait_for(Duration::from_secs(60), "the other worker took the run over", || {
        monitor.runs().unwrap()[0].pid == other.id()
    });
    // Woken while the other worker runs the second call again: its own call has long
    // returned, and it commits at once.
    signal(&stalled, libc::SIGCONT);
    wait_for_workers(vec![(other, other_log), (stalled, stalled_log.clone())], Duration::from_secs(120));
    strays.0.clear(); // Reaped: their pids may be reused.

    let log = std::fs::read_to_string(&stalled_log).unwrap();
    let context = format!("{kind:?}, a worker stalled past its lease; its log: {log}");
    check_queue(&db, &[(run_id.clone(), PLANS[1])], &context);
    // One life after the take-over: the new holder ran every step left itself (a commit of
    // the stalled worker's would show up as a replay), and ended the run once.
    let events = monitor.events(&run_id).unwrap();
    let kinds: Vec<EventKind> = events.iter().map(|e| e.event).collect();
    let count = |kind: EventKind| kinds.iter().filter(|k| **k == kind).count();
    assert!(events.iter().all(|e| e.replayed != Some(true)), "{context}: a step replayed: {kinds:?}");
    assert_eq!((count(EventKind::SagaResumed), count(EventKind::SagaFinished)), (1, 1), "{context}: {kinds:?}");
    assert_eq!(count(EventKind::CompensationTriggered), 0, "{context}: {kinds:?}");
    assert!(
        log.contains("taken over by") && log.contains("1 taken_over"),
        "the stalled worker did not say it lost the run: {log}"
    );
}

/// Processes a test kills (SIGKILL ends a stopped process too) if it ends before reaping them.
struct Strays(Vec<u32>);

impl Drop for Strays {
    fn drop(&mut self) {
        for pid in &self.0 {
            // SAFETY: signals a child of this test that was not reaped.
            unsafe { libc::kill(*pid as libc::pid_t, libc::SIGKILL) };
        }
    }
}

/// One module per backend, each with every durable test.
macro_rules! on_every_backend {
    ($($test:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[test]
                fn $test() {
                    super::$test(super::Kind::Sqlite);
                }
            )*

            #[test]
            fn workers_finish_every_queued_run_when_one_is_killed() {
                super::workers_finish_every_queued_run_when_one_is_killed_on_sqlite();
            }
        }

        mod postgres {
            $(
                #[test]
                fn $test() {
                    super::$test(super::Kind::Postgres);
                }
            )*

            #[test]
            fn workers_finish_every_queued_run_when_one_is_killed() {
                super::workers_finish_every_queued_run_when_one_is_killed(super::Kind::Postgres, super::worker_runs(super::WORKER_RUNS));
            }

            #[test]
            fn workers_recover_when_their_connections_are_terminated() {
                super::workers_recover_when_their_connections_are_terminated();
            }
        }
    };
}

on_every_backend!(
    a_run_killed_at_any_instant_resumes_to_all_or_nothing,
    a_resume_killed_at_any_instant_resumes_again_to_all_or_nothing,
    a_run_with_a_lost_reply_killed_at_any_instant_resumes_to_all_or_nothing,
    processes_killed_on_one_new_database_resume_to_all_or_nothing,
    concurrent_processes_on_one_database_keep_state_and_journals_consistent,
    many_sagas_in_one_process_share_one_database,
    resume_reports_a_run_it_cannot_rebuild_and_still_finishes_the_others,
    processes_mixing_read_only_steps_and_allocations_lose_no_update,
    reusing_a_run_id_names_the_run_and_the_database,
    resumes_started_at_once_run_an_interrupted_run_once,
    a_stalled_worker_writes_nothing_into_a_run_another_took_over,
);
