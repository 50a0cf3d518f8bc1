//! Durable runs: `sagabox run --db` killed with SIGKILL at seeded random instants, then
//! `sagabox resume`. After the resume the state is the completed saga's or the initial one,
//! never a mix; every effect and every compensation was applied at most once.
//!
//! The suite runs 50 kill points; `SAGABOX_CRASH_POINTS=1000 cargo test --release --test
//! crash` runs more.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sagabox::durable::{Durability, SqliteBackend};
use sagabox::saga::Backend;
use sagabox::saga::journal::EventKind;
use serde_json::{Value, json};
use support::*;

/// A directory with the slow plugin, its policy, and two sagas: one that fails at its 4th
/// allocation and rolls back, one that completes.
fn setup(dir: &Path) {
    let plugins = dir.join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    std::fs::copy(artifact("slow_pool"), plugins.join("slow_pool.wasm")).unwrap();
    std::fs::write(
        plugins.join("slow_pool.policy.toml"),
        "[store]\nwrite = [\"pools\", \"allocations\", \"executions\"]\n[limits]\ndeadline_ms = 10000\n",
    )
    .unwrap();
    let step = |id: &str, amount: u64| {
        json!({ "id": id, "action": { "name": "slow_pool.allocate",
                "arguments": { "pool_id": "cluster", "amount": amount, "delay_ms": 40 } } })
    };
    let failing = json!({ "saga": {
        "steps": [step("a1", 10), step("a2", 15), step("a3", 20), step("a4", 30)],
        "ledgers": ["executions"], "timeout": "60s" } });
    let completing = json!({ "saga": {
        "steps": [step("a1", 10), step("a2", 15), step("a3", 20)],
        "ledgers": ["executions"], "timeout": "60s" } });
    let fixture = json!({ "pools": { "cluster": { "pool_id": "cluster", "capacity": 50, "allocated": 0 } } });
    for (name, saga) in [("failing", failing), ("completing", completing)] {
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

/// Where a run was when it was killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    NotStarted,
    Forward,
    Compensating,
    Finished,
}

fn phase_of(db: &SqliteBackend) -> Phase {
    let Some(run) = db.runs().unwrap().into_iter().next() else { return Phase::NotStarted };
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

/// Runs one kill point; returns where the run was when killed.
fn kill_and_resume(dir: &Path, point: u64) -> Phase {
    let mut rng = ChaCha8Rng::seed_from_u64(point);
    let saga = if point.is_multiple_of(2) { "failing" } else { "completing" };
    let db_path: PathBuf = dir.join(format!("crash-{point}.db"));
    // Start-up takes ~20 ms; then each call sleeps 40 ms (7 calls failing, 3 completing).
    let window = if saga == "failing" { 340 } else { 180 };
    let kill_after = Duration::from_millis(rng.random_range(5..window));

    let mut child = sagabox(dir)
        .args(["run", dir.join(format!("{saga}.json")).to_str().unwrap(), "--db", db_path.to_str().unwrap()])
        .spawn()
        .unwrap();
    std::thread::sleep(kill_after);
    let _ = child.kill(); // SIGKILL
    let _ = child.wait();

    let phase = if db_path.exists() {
        phase_of(&SqliteBackend::open(&db_path, Durability::Normal).unwrap())
    } else {
        Phase::NotStarted
    };
    let resumed = sagabox(dir).args(["resume", "--db", db_path.to_str().unwrap()]).output().unwrap();
    assert!(
        resumed.status.code().is_some_and(|c| c <= 1),
        "point {point}: resume failed: {}",
        String::from_utf8_lossy(&resumed.stderr)
    );

    if !db_path.exists() {
        return phase;
    }
    let db = SqliteBackend::open(&db_path, Durability::Normal).unwrap();
    let runs = db.runs().unwrap();
    assert!(runs.iter().all(|r| r.status != "running"), "point {point}: a run is still unfinished: {runs:?}");
    let state = db.snapshot();
    let doc =
        |ns: &str, key: &str| -> Option<Value> { state.get(ns, key).map(|d| serde_json::from_str(&d.text).unwrap()) };
    let allocations = state.namespace("allocations").map_or(0, |n| n.len());
    let context = format!("point {point} ({saga}, killed after {kill_after:?} in {phase:?})");
    match (runs.first(), saga) {
        // Killed before the run was registered: nothing may have happened.
        (None, _) => assert_eq!(allocations, 0, "{context}"),
        (Some(run), "failing") => {
            assert_eq!(run.status, "failed", "{context}");
            assert_eq!(doc("pools", "cluster").unwrap()["allocated"], 0, "{context}: not the initial state");
            assert_eq!(allocations, 0, "{context}");
        }
        (Some(run), _) => {
            assert_eq!(run.status, "completed", "{context}");
            assert_eq!(doc("pools", "cluster").unwrap()["allocated"], 45, "{context}: not the completed state");
            assert_eq!(allocations, 3, "{context}");
        }
    }
    // Every effect and every compensation applied at most once.
    let mut executions: BTreeMap<(String, String), usize> = BTreeMap::new();
    for (_, record) in state.namespace("executions").into_iter().flat_map(|n| n.iter()) {
        let record: Value = serde_json::from_str(&record.text).unwrap();
        let key = (record["tool"].as_str().unwrap().to_string(), record["key"].as_str().unwrap().to_string());
        *executions.entry(key).or_default() += 1;
    }
    for ((tool, key), count) in &executions {
        assert_eq!(*count, 1, "{context}: {tool} with key {key} was applied {count} times");
    }
    if let Some(run) = runs.first() {
        let events = db.events(&run.run_id).unwrap();
        for kind in [EventKind::StepCompleted, EventKind::CompensationCompleted] {
            let mut per_step: BTreeMap<&str, usize> = BTreeMap::new();
            for e in events.iter().filter(|e| e.event == kind && e.replayed != Some(true)) {
                *per_step.entry(e.step.as_deref().unwrap()).or_default() += 1;
            }
            assert!(per_step.values().all(|n| *n == 1), "{context}: {kind:?} recorded twice: {per_step:?}");
        }
        let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{context}: journal out of order");
        assert_eq!(events.last().unwrap().event, EventKind::SagaFinished, "{context}");
    }
    phase
}

#[test]
fn a_run_killed_at_any_instant_resumes_to_all_or_nothing() {
    let points: u64 = std::env::var("SAGABOX_CRASH_POINTS").ok().and_then(|v| v.parse().ok()).unwrap_or(50);
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let mut phases: BTreeMap<String, usize> = BTreeMap::new();
    for point in 0..points {
        let phase = kill_and_resume(dir.path(), point);
        *phases.entry(format!("{phase:?}")).or_default() += 1;
        let _ = std::fs::remove_file(dir.path().join(format!("crash-{point}.db")));
    }
    println!("{points} kill points, killed while: {phases:?}");
    // The seeded instants must catch runs mid-flight, both forward and compensating.
    assert!(phases.get("Forward").copied().unwrap_or(0) >= points as usize / 5, "{phases:?}");
    assert!(phases.get("Compensating").copied().unwrap_or(0) >= 1, "{phases:?}");
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
    let record = |run_id: &str, definition: String| sagabox::durable::RunRecord {
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
