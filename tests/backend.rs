//! The conformance suite every backend passes: written once over the `Backend` trait, and
//! instantiated per backend by `conformance!` at the bottom (a new backend is one more name
//! there and a constructor).

use std::sync::Arc;

use sagabox::backend::{Backend, CommitError, Durability, MemoryBackend, RegisterError, RunRecord, SqliteBackend};
use sagabox::saga::journal::{Event, EventKind};
use sagabox::store::{Change, State, Txn, WriteQuota};
use serde_json::{Value, json};

/// A backend seeded with a state, and what must outlive it (a database's directory).
struct Subject {
    backend: Box<dyn Backend>,
    _dir: Option<tempfile::TempDir>,
}

impl std::ops::Deref for Subject {
    type Target = dyn Backend;
    fn deref(&self) -> &(dyn Backend + 'static) {
        &*self.backend
    }
}

fn memory(state: &State) -> Subject {
    Subject { backend: Box::new(MemoryBackend::new(state.clone())), _dir: None }
}

fn sqlite(state: &State) -> Subject {
    let dir = tempfile::tempdir().unwrap();
    let db = SqliteBackend::open(&dir.path().join("db.sqlite"), Durability::Normal).unwrap();
    db.seed(state).unwrap();
    Subject { backend: Box::new(db), _dir: Some(dir) }
}

type Open = fn(&State) -> Subject;

fn pools() -> State {
    State::from_json(&json!({ "pools": { "p": { "allocated": 0 } }, "users": { "u": { "n": 1 } } })).unwrap()
}

fn txn(backend: &Subject) -> Txn {
    Txn::new(backend.snapshot(), WriteQuota::default())
}

fn text(state: &State, ns: &str, key: &str) -> Option<String> {
    state.get(ns, key).map(|d| d.text.to_string())
}

fn event(run_id: &str, seq: u64, kind: EventKind) -> Event {
    let mut event = Event::new(kind);
    event.run_id = run_id.into();
    event.seq = seq;
    event
}

fn record(run_id: &str) -> RunRecord {
    RunRecord::starting(run_id, "s", "s.json", "{\"steps\":[]}".into(), &json!({ "x": 1 }), 7)
}

fn seqs(backend: &Subject, run_id: &str) -> Vec<u64> {
    backend.events(run_id).unwrap().iter().map(|e| e.seq).collect()
}

fn commit_applies_writes_and_returns_changes(open: Open) {
    let backend = open(&pools());
    let mut t = txn(&backend);
    t.put("pools", "p", r#"{"allocated": 5}"#).unwrap();
    t.put("orders", "o1", "{}").unwrap();
    t.delete("users", "u").unwrap();
    let mut changes = backend.commit(&t, None, &[]).unwrap();
    changes.sort_by(|a, b| (&a.namespace, &a.key).cmp(&(&b.namespace, &b.key)));
    let change = |ns: &str, key: &str, before: Option<&str>, after: Option<&str>| Change {
        namespace: ns.into(),
        key: key.into(),
        before: before.map(Into::into),
        after: after.map(Into::into),
    };
    assert_eq!(
        changes,
        [
            change("orders", "o1", None, Some("{}")),
            change("pools", "p", Some(r#"{"allocated":0}"#), Some(r#"{"allocated":5}"#)),
            change("users", "u", Some(r#"{"n":1}"#), None),
        ]
    );
    let now = backend.snapshot();
    assert_eq!(text(&now, "pools", "p").as_deref(), Some(r#"{"allocated":5}"#));
    assert_eq!(text(&now, "orders", "o1").as_deref(), Some("{}"));
    assert!(now.namespace("users").is_none(), "a namespace whose last document was deleted is still listed");
}

fn a_conflicting_commit_is_refused_and_writes_nothing(open: Open) {
    let backend = open(&pools());
    backend.register_run(&record("r")).unwrap();
    let (mut first, mut second) = (txn(&backend), txn(&backend));
    first.get("pools", "p");
    second.get("pools", "p");
    first.put("pools", "p", r#"{"allocated":1}"#).unwrap();
    second.put("pools", "p", r#"{"allocated":2}"#).unwrap();
    second.put("orders", "o2", "{}").unwrap();
    backend.commit(&first, None, &[event("r", 0, EventKind::StepCompleted)]).unwrap();
    let before = backend.snapshot().digest();
    let err = backend.commit(&second, Some(("k2", &json!(2))), &[event("r", 1, EventKind::StepCompleted)]);
    assert!(matches!(err, Err(CommitError::Conflict(_))), "{err:?}");
    assert_eq!(backend.snapshot().digest(), before, "a refused commit wrote to the store");
    assert_eq!(backend.cached("k2"), None, "a refused commit cached its result");
    assert_eq!(seqs(&backend, "r"), [0], "a refused commit wrote to the journal");
}

fn a_second_commit_under_one_key_returns_the_first_output_and_writes_nothing(open: Open) {
    let backend = open(&pools());
    backend.register_run(&record("r")).unwrap();
    // Both deliveries of one call ran before either committed.
    let (mut first, mut second) = (txn(&backend), txn(&backend));
    first.put("allocations", "A1", r#"{"n":1}"#).unwrap();
    second.put("allocations", "A1", r#"{"n":2}"#).unwrap();
    second.put("orders", "o", "{}").unwrap();
    backend.commit(&first, Some(("k", &json!({ "n": 1 }))), &[event("r", 0, EventKind::StepCompleted)]).unwrap();
    let before = backend.snapshot().digest();
    let err = backend.commit(&second, Some(("k", &json!({ "n": 2 }))), &[event("r", 1, EventKind::StepCompleted)]);
    assert!(matches!(&err, Err(CommitError::AlreadyCommitted(v)) if *v == json!({ "n": 1 })), "{err:?}");
    assert_eq!(backend.snapshot().digest(), before, "the second delivery wrote to the store");
    assert_eq!(backend.cached("k"), Some(json!({ "n": 1 })));
    assert_eq!(seqs(&backend, "r"), [0], "the second delivery wrote to the journal");
}

fn cached_returns_only_committed_results(open: Open) {
    let backend = open(&pools());
    assert_eq!(backend.cached("k"), None);
    let mut t = txn(&backend);
    t.put("orders", "o", "{}").unwrap();
    backend.commit(&t, Some(("k", &json!({ "id": "o" }))), &[]).unwrap();
    assert_eq!(backend.cached("k"), Some(json!({ "id": "o" })));
    assert_eq!(backend.cached("other"), None);
    // A commit with no result caches nothing, and leaves the cache as it was.
    backend.commit(&txn(&backend), None, &[]).unwrap();
    assert_eq!(backend.cached("k"), Some(json!({ "id": "o" })));
}

fn the_journal_keeps_every_event_in_order_without_gaps(open: Open) {
    let backend = open(&pools());
    backend.register_run(&record("r")).unwrap();
    backend.register_run(&record("other")).unwrap();
    // As the engine writes a run: events with no state change and commits, interleaved
    // with another run's.
    backend.record(&[event("r", 0, EventKind::SagaStarted)]).unwrap();
    backend.record(&[event("r", 1, EventKind::StepStarted)]).unwrap();
    backend.record(&[event("other", 0, EventKind::SagaStarted)]).unwrap();
    let mut t = txn(&backend);
    t.put("orders", "o", "{}").unwrap();
    backend.commit(&t, Some(("k", &json!(1))), &[event("r", 2, EventKind::StepCompleted)]).unwrap();
    backend.record(&[event("r", 3, EventKind::StepStarted)]).unwrap();
    let mut t = txn(&backend);
    t.put("orders", "o2", "{}").unwrap();
    backend.commit(&t, None, &[event("r", 4, EventKind::StepCompleted)]).unwrap();
    let end = event("r", 5, EventKind::SagaFinished).data(json!({ "status": "completed" }));
    backend.record(std::slice::from_ref(&end)).unwrap();

    let journal = backend.events("r").unwrap();
    assert_eq!(journal.iter().map(|e| e.seq).collect::<Vec<_>>(), [0, 1, 2, 3, 4, 5]);
    assert_eq!(journal[5], end);
    let kinds: Vec<EventKind> = journal.iter().map(|e| e.event).collect();
    use EventKind::*;
    assert_eq!(kinds, [SagaStarted, StepStarted, StepCompleted, StepStarted, StepCompleted, SagaFinished]);
    assert_eq!(seqs(&backend, "other"), [0]);
    let bytes: usize = journal.iter().map(|e| serde_json::to_string(e).unwrap().len()).sum();
    assert_eq!(backend.journal_bytes("r").unwrap(), bytes as u64);
    assert!(backend.events("missing").unwrap().is_empty());
    assert_eq!(backend.journal_bytes("missing").unwrap(), 0);

    // The last event finishes the run.
    let run = backend.runs().unwrap().into_iter().find(|r| r.run_id == "r").unwrap();
    assert_eq!(run.status, "completed");
    assert!(run.finished_ms.is_some_and(|t| t >= run.started_ms));

    // A record is never overwritten, and a commit that carries one writes nothing.
    let err = backend.record(&[event("r", 0, EventKind::SagaResumed)]);
    assert!(matches!(&err, Err(CommitError::Backend(m)) if m.contains("'r'") && m.contains("seq 0")), "{err:?}");
    let mut t = txn(&backend);
    t.put("orders", "o3", "{}").unwrap();
    let before = backend.snapshot().digest();
    let err = backend.commit(&t, Some(("k3", &json!(3))), &[event("r", 2, EventKind::StepCompleted)]);
    assert!(matches!(err, Err(CommitError::Backend(_))), "{err:?}");
    assert_eq!(backend.snapshot().digest(), before);
    assert_eq!(backend.cached("k3"), None);
    assert_eq!(backend.events("r").unwrap(), journal);
}

fn the_run_registry_round_trips(open: Open) {
    let backend = open(&pools());
    assert!(backend.runs().unwrap().is_empty());
    let mut a = record("a");
    a.pid = 4_000_000;
    backend.register_run(&a).unwrap();
    backend.register_run(&record("b")).unwrap();
    let err = backend.register_run(&record("a")).unwrap_err();
    assert!(matches!(&err, RegisterError::Exists { run_id, .. } if run_id == "a"), "{err}");

    let runs = backend.runs().unwrap();
    assert_eq!(runs.iter().map(|r| r.run_id.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    let got = &runs[0];
    assert!(got.started_ms > 0, "the registry sets the start time");
    assert_eq!(RunRecord { started_ms: 0, ..got.clone() }, a);

    // Only the process the caller saw running a run hands it over, and only once.
    assert!(!backend.adopt_run("a", 4_000_001).unwrap());
    assert!(backend.adopt_run("a", 4_000_000).unwrap());
    assert!(!backend.adopt_run("a", 4_000_000).unwrap());
    assert_eq!(backend.runs().unwrap()[0].pid, std::process::id());
    assert!(!backend.adopt_run("missing", 4_000_000).unwrap());
    // A finished run is nobody's to take over.
    let end = event("b", 0, EventKind::SagaFinished).data(json!({ "status": "failed" }));
    backend.record(&[end]).unwrap();
    assert_eq!(backend.runs().unwrap()[1].status, "failed");
    assert!(!backend.adopt_run("b", std::process::id()).unwrap());
}

fn snapshots_are_isolated_from_later_commits(open: Open) {
    let backend = open(&pools());
    let before = backend.snapshot();
    let digest = before.digest();
    let mut t = txn(&backend);
    t.put("pools", "p", r#"{"allocated":9}"#).unwrap();
    t.delete("users", "u").unwrap();
    backend.commit(&t, None, &[]).unwrap();
    assert_eq!(text(&before, "pools", "p").as_deref(), Some(r#"{"allocated":0}"#));
    assert_eq!(text(&before, "users", "u").as_deref(), Some(r#"{"n":1}"#));
    assert_eq!(before.digest(), digest);
    let after = backend.snapshot();
    assert_ne!(after.digest(), digest);
    assert_eq!(text(&after, "pools", "p").as_deref(), Some(r#"{"allocated":9}"#));
}

fn concurrent_increments_lose_no_update(open: Open) {
    let backend: Arc<Subject> = Arc::new(open(&pools()));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let backend = Arc::clone(&backend);
            std::thread::spawn(move || {
                for _ in 0..25 {
                    loop {
                        let mut t = txn(&backend);
                        let pool: Value = serde_json::from_str(&t.get("pools", "p").unwrap()).unwrap();
                        let next = pool["allocated"].as_u64().unwrap() + 1;
                        t.put("pools", "p", &json!({ "allocated": next }).to_string()).unwrap();
                        match backend.commit(&t, None, &[]) {
                            Ok(_) => break,
                            Err(CommitError::Conflict(_)) => continue,
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    assert_eq!(text(&backend.snapshot(), "pools", "p").as_deref(), Some(r#"{"allocated":100}"#));
}

/// One module per backend, each with every test of the suite.
macro_rules! conformance {
    ($($backend:ident),* $(,)?) => {$(
        mod $backend {
            conformance!(@tests $backend:
                commit_applies_writes_and_returns_changes,
                a_conflicting_commit_is_refused_and_writes_nothing,
                a_second_commit_under_one_key_returns_the_first_output_and_writes_nothing,
                cached_returns_only_committed_results,
                the_journal_keeps_every_event_in_order_without_gaps,
                the_run_registry_round_trips,
                snapshots_are_isolated_from_later_commits,
                concurrent_increments_lose_no_update,
            );
        }
    )*};
    (@tests $backend:ident: $($test:ident),* $(,)?) => {$(
        #[test]
        fn $test() {
            super::$test(super::$backend);
        }
    )*};
}

conformance!(memory, sqlite);
