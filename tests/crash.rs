//! Durable runs: `sagabox run --db` killed with SIGKILL at seeded random instants, then
//! `sagabox resume` (itself killed at times, then resumed again). The runs cover sequential
//! and DAG sagas, injected faults (a rejected step, a lost reply), steps that write nothing,
//! and several processes on one database. After the last resume every run is finished, each
//! run's allocations are all there (completed) or all undone (failed), every effect and every
//! compensation was applied exactly once, and the pools' totals are conserved.
//!
//! The suite runs about 80 kill points; `SAGABOX_CRASH_POINTS=1000 cargo test --release
//! --test crash` runs 1,000 in the main harness and as many more, proportionally, elsewhere.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sagabox::backend::{Backend, Durability, RunRecord, SqliteBackend};
use sagabox::saga::journal::EventKind;
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

/// Each plan's window, measured once by running it.
#[derive(Default)]
struct Windows(BTreeMap<String, Window>);

impl Windows {
    fn of(&mut self, dir: &Path, plan: &Plan) -> Window {
        let name = format!("{} {:?}", plan.saga, plan.faults);
        *self.0.entry(name).or_insert_with(|| {
            let db_path = dir.join(format!("calibrate-{}-{}.db", plan.saga, plan.faults.len()));
            let spawned = now_ms();
            start(dir, &db_path, plan, "calibrate").wait().unwrap();
            let run = SqliteBackend::open(&db_path, Durability::Normal).unwrap().runs().unwrap().remove(0);
            let _ = std::fs::remove_file(&db_path);
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

fn start(dir: &Path, db: &Path, plan: &Plan, run_id: &str) -> Child {
    let mut cmd = sagabox(dir);
    cmd.args(["run", dir.join(format!("{}.json", plan.saga)).to_str().unwrap(), "--db", db.to_str().unwrap()]);
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
fn resume(dir: &Path, db: &Path, context: &str) {
    let out = sagabox(dir).args(["resume", "--db", db.to_str().unwrap()]).output().unwrap();
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

fn phase_of(db_path: &Path, run_id: &str) -> Phase {
    if !db_path.exists() {
        return Phase::NotStarted;
    }
    let db = SqliteBackend::open(db_path, Durability::Normal).unwrap();
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

/// Checks a database after its last resume: `runs` are the runs started on it. Returns how
/// each registered run ended.
fn check_all_or_nothing(db_path: &Path, runs: &[(String, Plan)], context: &str) -> Vec<String> {
    let mut outcomes = Vec::new();
    if !db_path.exists() {
        return outcomes;
    }
    let db = SqliteBackend::open(db_path, Durability::Normal).unwrap();
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
        assert!(record.status == plan.expect || (completed && !plan.faults.is_empty()), "{context}: {}", record.status);
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
        check_journal(&db, run_id, &context);
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
fn check_journal(db: &SqliteBackend, run_id: &str, context: &str) {
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
fn kill_and_resume(dir: &Path, point: u64, plan: &Plan, window: Window, kill_resume: bool) -> (Phase, Option<String>) {
    let mut rng = ChaCha8Rng::seed_from_u64(point);
    let db_path: PathBuf = dir.join(format!("crash-{point}-{}.db", plan.saga));
    let run_id = format!("run-{point}");
    let kill_after_run = window.pick(&mut rng);
    kill_after(start(dir, &db_path, plan, &run_id), kill_after_run);
    let phase = phase_of(&db_path, &run_id);
    let mut context = format!("point {point} (killed after {kill_after_run:?} in {phase:?}");
    if kill_resume && db_path.exists() {
        let after = window.pick(&mut rng);
        let child = sagabox(dir).args(["resume", "--db", db_path.to_str().unwrap()]).spawn().unwrap();
        kill_after(child, after);
        context += &format!(", resume killed after {after:?} in {:?}", phase_of(&db_path, &run_id));
    }
    context += ")";
    if db_path.exists() {
        resume(dir, &db_path, &context);
    }
    let outcome = check_all_or_nothing(&db_path, &[(run_id, *plan)], &context).pop();
    let _ = std::fs::remove_file(&db_path);
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
fn kill_points(first: u64, count: u64, plans: &[Plan], kill_resume: impl Fn(u64) -> bool) -> Tally {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let (mut tally, mut windows) = (Tally::default(), Windows::default());
    for point in first..first + count {
        let plan = &plans[point as usize % plans.len()];
        tally.add(plan, kill_and_resume(dir.path(), point, plan, windows.of(dir.path(), plan), kill_resume(point)));
    }
    println!("{count} kill points: {tally:?}");
    tally
}

#[test]
fn a_run_killed_at_any_instant_resumes_to_all_or_nothing() {
    let points = points(48);
    let tally = kill_points(0, points, &PLANS, |_| false);
    // The seeded instants must catch runs mid-flight, both forward and compensating, and
    // injected faults must fire.
    assert!(tally.count("Forward") >= points as usize / 5, "{tally:?}");
    assert!(tally.count("Compensating") >= 1, "{tally:?}");
    assert!(tally.faulted.contains_key("failed"), "{tally:?}");
}

#[test]
fn a_resume_killed_at_any_instant_resumes_again_to_all_or_nothing() {
    // Other seeds than the main harness's.
    kill_points(10_000, points(12), &PLANS, |_| true);
}

#[test]
fn a_run_with_a_lost_reply_killed_at_any_instant_resumes_to_all_or_nothing() {
    let tally = kill_points(20_000, points(12), &LOST, |point| point % 3 == 0);
    assert!(tally.faulted.contains_key("failed"), "{tally:?}");
}

#[test]
fn processes_killed_on_one_new_database_resume_to_all_or_nothing() {
    let points = points(8);
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let mut windows = Windows::default();
    for point in 0..points {
        let mut rng = ChaCha8Rng::seed_from_u64(30_000 + point);
        let db_path = dir.path().join(format!("shared-{point}.db"));
        // Four runs start at once on a database none of them has seeded yet.
        let plans = [PLANS[1], PLANS[2], PLANS[3], PLANS[5]];
        let runs: Vec<(String, Plan)> = plans.iter().enumerate().map(|(i, p)| (format!("p{point}-{i}"), *p)).collect();
        // Each is killed at its own instant (some after they finished).
        let afters: Vec<Duration> =
            plans.iter().map(|plan| windows.of(dir.path(), plan).pick(&mut rng).mul_f64(1.2)).collect();
        let started = std::time::Instant::now();
        let mut children: Vec<(Child, Duration)> =
            runs.iter().zip(afters).map(|((id, plan), after)| (start(dir.path(), &db_path, plan, id), after)).collect();
        let mut killed = Vec::new();
        children.sort_by_key(|(_, after)| *after);
        for (mut child, after) in children {
            std::thread::sleep(after.saturating_sub(started.elapsed()));
            let _ = child.kill();
            let _ = child.wait();
            killed.push(after);
        }
        let mut context = format!("point {point} (runs killed after {killed:?}");
        if point % 2 == 1 && db_path.exists() {
            let after = windows.of(dir.path(), &PLANS[3]).pick(&mut rng);
            let child = sagabox(dir.path()).args(["resume", "--db", db_path.to_str().unwrap()]).spawn().unwrap();
            kill_after(child, after);
            context += &format!(", resume killed after {after:?}");
        }
        context += ")";
        if db_path.exists() {
            resume(dir.path(), &db_path, &context);
        }
        check_all_or_nothing(&db_path, &runs, &context);
        let _ = std::fs::remove_file(&db_path);
    }
}

#[test]
fn concurrent_processes_on_one_database_keep_state_and_journals_consistent() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let db_path = dir.path().join("shared.db");
    // Seed first, so that the racing processes find the state there.
    let db = SqliteBackend::open(&db_path, Durability::Normal).unwrap();
    db.seed(&sagabox::store::fixture::load(&dir.path().join("completing.fixture.json")).unwrap()).unwrap();
    drop(db);
    let children: Vec<_> = (0..4)
        .map(|_| {
            sagabox(dir.path())
                .args(["run", dir.path().join("completing.json").to_str().unwrap(), "--db", db_path.to_str().unwrap()])
                .spawn()
                .unwrap()
        })
        .collect();
    for mut child in children {
        child.wait().unwrap();
    }
    let db = SqliteBackend::open(&db_path, Durability::Normal).unwrap();
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

#[tokio::test(flavor = "multi_thread")]
async fn many_sagas_in_one_process_share_one_database() {
    let dir = tempfile::tempdir().unwrap();
    let db = std::sync::Arc::new(SqliteBackend::open(&dir.path().join("one.db"), Durability::Normal).unwrap());
    let fixture = json!({ "pools": { "p": { "capacity": 1000, "allocated": 0 } } });
    db.seed(&sagabox::store::State::from_json(&fixture).unwrap()).unwrap();
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
            sagabox::saga::run(&runtime, &saga, db.as_ref(), options).await
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

#[test]
fn resume_reports_a_run_it_cannot_rebuild_and_still_finishes_the_others() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let db_path = dir.path().join("two.db");
    let db = SqliteBackend::open(&db_path, Durability::Normal).unwrap();
    db.seed(&sagabox::store::fixture::load(&dir.path().join("completing.fixture.json")).unwrap()).unwrap();
    let record = |run_id: &str, definition: String| RunRecord {
        run_id: run_id.into(),
        saga: "s".into(),
        saga_path: "s.json".into(),
        definition,
        input: json!({}),
        seed: 1,
        status: "running".into(),
        pid: u32::MAX, // no such process
        started_ms: 0,
        finished_ms: None,
    };
    let gone = json!({ "saga": { "steps": [{ "id": "a", "action": { "name": "removed_plugin.tool" } }] } });
    db.register_run(&record("broken", gone.to_string())).unwrap();
    db.register_run(&record("fine", std::fs::read_to_string(dir.path().join("completing.json")).unwrap())).unwrap();
    drop(db);

    let out = sagabox(dir.path()).args(["resume", "--db", db_path.to_str().unwrap()]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("cannot resume run broken") && stderr.contains("removed_plugin.tool"), "{stderr}");
    let runs = SqliteBackend::open(&db_path, Durability::Normal).unwrap().runs().unwrap();
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
fn allocation_ids(db: &SqliteBackend, run_id: &str) -> Vec<String> {
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

#[test]
fn processes_mixing_read_only_steps_and_allocations_lose_no_update() {
    let dir = tempfile::tempdir().unwrap();
    setup_interleaved(dir.path());
    let db_path = dir.path().join("interleaved.db");
    let db = SqliteBackend::open(&db_path, Durability::Normal).unwrap();
    db.seed(&sagabox::store::fixture::load(&dir.path().join("interleaved.fixture.json")).unwrap()).unwrap();
    drop(db);
    let saga = dir.path().join("interleaved.json");
    let children: Vec<_> = (0..6)
        .map(|i| {
            let mut cmd = sagabox(dir.path());
            cmd.args(["run", saga.to_str().unwrap(), "--db", db_path.to_str().unwrap(), "--run-id", &format!("m{i}")]);
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
    let db = SqliteBackend::open(&db_path, Durability::Normal).unwrap();
    let state = db.current_state().unwrap();
    let (allocated, sum) = pool_and_allocations(&state, "shared");
    assert_eq!(allocated, sum, "the pool's counter disagrees with its allocations: an update was lost");
    let runs = db.runs().unwrap();
    assert_eq!(runs.len(), 6, "every process registered its run");
    let mut expected = 0;
    for run in runs {
        let ids = allocation_ids(&db, &run.run_id);
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

#[test]
fn reusing_a_run_id_names_the_run_and_the_database() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let db_path = dir.path().join("reuse.db");
    let db = db_path.to_str().unwrap();
    let saga = dir.path().join("completing.json");
    let run =
        || sagabox(dir.path()).args(["run", saga.to_str().unwrap(), "--db", db, "--run-id", "r1"]).output().unwrap();
    assert_eq!(run().status.code(), Some(0));
    let again = run();
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert_eq!(again.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(&format!("run 'r1' already exists in {db}")), "{stderr}");
    assert!(stderr.contains("choose another --run-id"), "{stderr}");
    assert!(!stderr.contains("UNIQUE"), "{stderr}");
    // An unfinished run: the message says how to finish it.
    let backend = SqliteBackend::open(&db_path, Durability::Normal).unwrap();
    let mut record = backend.runs().unwrap().remove(0);
    record.run_id = "r2".into();
    backend.register_run(&record).unwrap();
    let out = sagabox(dir.path()).args(["run", saga.to_str().unwrap(), "--db", db, "--run-id", "r2"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("`sagabox resume --db {db} r2`")), "{stderr}");
}

#[test]
fn resumes_started_at_once_run_an_interrupted_run_once() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let db_path = dir.path().join("orphan.db");
    let db = SqliteBackend::open(&db_path, Durability::Normal).unwrap();
    db.seed(&sagabox::store::fixture::load(&dir.path().join("completing.fixture.json")).unwrap()).unwrap();
    db.register_run(&RunRecord {
        run_id: "orphan".into(),
        saga: "completing".into(),
        saga_path: "completing.json".into(),
        definition: std::fs::read_to_string(dir.path().join("completing.json")).unwrap(),
        input: json!({}),
        seed: 1,
        status: "running".into(),
        pid: u32::MAX, // no such process
        started_ms: 0,
        finished_ms: None,
    })
    .unwrap();
    drop(db);
    let children: Vec<_> = (0..4)
        .map(|_| {
            sagabox(dir.path())
                .args(["resume", "--db", db_path.to_str().unwrap()])
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<_> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    let ran = outputs.iter().filter(|o| String::from_utf8_lossy(&o.stdout).contains("(run orphan)")).count();
    let stderr: Vec<_> = outputs.iter().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).collect();
    assert_eq!(ran, 1, "the run was resumed {ran} times: {stderr:?}");
    let db = SqliteBackend::open(&db_path, Durability::Normal).unwrap();
    let events = db.events("orphan").unwrap();
    // It never started before: the one resume starts it.
    let starts = events.iter().filter(|e| matches!(e.event, EventKind::SagaStarted | EventKind::SagaResumed)).count();
    assert_eq!(starts, 1, "{:?}", events.iter().map(|e| e.event).collect::<Vec<_>>());
    assert_eq!(db.runs().unwrap()[0].status, "completed");
}
