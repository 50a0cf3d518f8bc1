//! The conformance suite every backend passes: written once over the `Backend` trait, and
//! instantiated per backend by `conformance!` at the bottom (a new backend is one more name
//! there and a constructor).

use std::sync::Arc;

use crate::support;

use sagabox::backend::{
    Backend, BeforeCall, CommitError, Durability, MemoryBackend, PostgresBackend, RegisterError, RunRecord,
    SqliteBackend,
};
use sagabox::saga::journal::{Event, EventKind};
use sagabox::store::{Change, State, Txn, WriteQuota};
use serde_json::{Value, json};

/// A backend seeded with a state, a way to open a second handle on the same database (as
/// another process would), and what must outlive them (a database's directory or schema).
struct Subject {
    backend: Arc<dyn Backend>,
    reopen: Box<dyn Fn() -> Arc<dyn Backend> + Send + Sync>,
    _keep: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl std::ops::Deref for Subject {
    type Target = dyn Backend;
    fn deref(&self) -> &(dyn Backend + 'static) {
        &*self.backend
    }
}

/// Memory lives in one process: its second handle is the first.
fn memory(state: &State) -> Subject {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new(state.clone()));
    let same = Arc::clone(&backend);
    Subject { backend, reopen: Box::new(move || Arc::clone(&same)), _keep: None }
}

fn sqlite(state: &State) -> Subject {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db.sqlite");
    let open = move || -> Arc<dyn Backend> { Arc::new(SqliteBackend::open(&path, Durability::Normal).unwrap()) };
    let backend = open();
    assert!(backend.seed_if_new(state).unwrap());
    Subject { backend, reopen: Box::new(open), _keep: Some(Box::new(dir)) }
}

fn postgres(state: &State) -> Subject {
    let schema = support::postgres::Schema::new("conformance");
    let url = schema.url.clone();
    let open = move || -> Arc<dyn Backend> { Arc::new(PostgresBackend::open(&url).unwrap()) };
    let backend = open();
    assert!(backend.seed_if_new(state).unwrap());
    Subject { backend, reopen: Box::new(open), _keep: Some(Box::new(schema)) }
}

type Open = fn(&State) -> Subject;

fn pools() -> State {
    State::from_json(&json!({ "pools": { "p": { "allocated": 0 } }, "users": { "u": { "n": 1 } } })).unwrap()
}

fn txn(backend: &dyn Backend) -> Txn {
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

fn now_ms() -> u64 {
    sagabox::durable::now_ms()
}

fn seqs(backend: &dyn Backend, run_id: &str) -> Vec<u64> {
    backend.events(run_id).unwrap().iter().map(|e| e.seq).collect()
}

fn commit_applies_writes_and_returns_changes(open: Open) {
    let backend = open(&pools());
    let mut t = txn(&*backend);
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
    let (mut first, mut second) = (txn(&*backend), txn(&*backend));
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
    assert_eq!(seqs(&*backend, "r"), [0], "a refused commit wrote to the journal");
}

fn a_second_commit_under_one_key_returns_the_first_output_and_writes_nothing(open: Open) {
    let backend = open(&pools());
    backend.register_run(&record("r")).unwrap();
    // Both deliveries of one call ran before either committed.
    let (mut first, mut second) = (txn(&*backend), txn(&*backend));
    first.put("allocations", "A1", r#"{"n":1}"#).unwrap();
    second.put("allocations", "A1", r#"{"n":2}"#).unwrap();
    second.put("orders", "o", "{}").unwrap();
    backend.commit(&first, Some(("k", &json!({ "n": 1 }))), &[event("r", 0, EventKind::StepCompleted)]).unwrap();
    let before = backend.snapshot().digest();
    let err = backend.commit(&second, Some(("k", &json!({ "n": 2 }))), &[event("r", 1, EventKind::StepCompleted)]);
    assert!(matches!(&err, Err(CommitError::AlreadyCommitted(v)) if *v == json!({ "n": 1 })), "{err:?}");
    assert_eq!(backend.snapshot().digest(), before, "the second delivery wrote to the store");
    assert_eq!(backend.cached("k"), Some(json!({ "n": 1 })));
    assert_eq!(seqs(&*backend, "r"), [0], "the second delivery wrote to the journal");
}

fn a_seeded_state_larger_than_a_batch_reads_back_whole(open: Open) {
    // Three namespaces of 4,000 to 6,000 documents: more than one batch of inserts each.
    let seed: serde_json::Map<String, Value> = (0..3)
        .map(|n| {
            let docs = (0..4_000 + 1_000 * n).map(|k| (format!("k{k}"), json!({ "n": n, "k": k }))).collect();
            (format!("ns{n}"), Value::Object(docs))
        })
        .collect();
    let state = State::from_json(&Value::Object(seed)).unwrap();
    let subject = open(&state);
    let read_back = (subject.reopen)().current_state().unwrap();
    assert_eq!(read_back.doc_count(), 15_000);
    assert_eq!(read_back.digest(), state.digest());
}

fn cached_returns_only_committed_results(open: Open) {
    let backend = open(&pools());
    assert_eq!(backend.cached("k"), None);
    let mut t = txn(&*backend);
    t.put("orders", "o", "{}").unwrap();
    backend.commit(&t, Some(("k", &json!({ "id": "o" }))), &[]).unwrap();
    assert_eq!(backend.cached("k"), Some(json!({ "id": "o" })));
    assert_eq!(backend.cached("other"), None);
    // A commit with no result caches nothing, and leaves the cache as it was.
    backend.commit(&txn(&*backend), None, &[]).unwrap();
    assert_eq!(backend.cached("k"), Some(json!({ "id": "o" })));
}

fn before_a_call_its_cached_result_or_else_a_caught_up_state_is_read(open: Open) {
    let subject = open(&pools());
    let (a, b) = (&subject.backend, (subject.reopen)());
    // b, as another process, commits a write and a result; a has not looked since.
    let mut t = txn(&*b);
    t.put("pools", "p", r#"{"allocated":7}"#).unwrap();
    b.commit(&t, Some(("k", &json!({ "id": 1 }))), &[]).unwrap();
    match a.cached_or_snapshot("k") {
        BeforeCall::Cached(output) => assert_eq!(output, json!({ "id": 1 })),
        BeforeCall::Fresh(_) => panic!("the result cached by the other handle was not found"),
    }
    let fresh = match a.cached_or_snapshot("other") {
        BeforeCall::Fresh(state) => state,
        BeforeCall::Cached(output) => panic!("nothing is cached under 'other', found {output}"),
    };
    assert_eq!(text(&fresh, "pools", "p").as_deref(), Some(r#"{"allocated":7}"#), "a did not catch up");
    // A call run on that state commits without a false conflict.
    let mut after = Txn::new(fresh, WriteQuota::default());
    after.get("pools", "p");
    after.put("pools", "p", r#"{"allocated":8}"#).unwrap();
    a.commit(&after, None, &[]).unwrap();
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
    let mut t = txn(&*backend);
    t.put("orders", "o", "{}").unwrap();
    backend.commit(&t, Some(("k", &json!(1))), &[event("r", 2, EventKind::StepCompleted)]).unwrap();
    backend.record(&[event("r", 3, EventKind::StepStarted)]).unwrap();
    let mut t = txn(&*backend);
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
    assert_eq!(seqs(&*backend, "other"), [0]);
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
    let mut t = txn(&*backend);
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

    // Only the holder the caller saw hands it over, and only once.
    let lease = now_ms() + 60_000;
    let seen = runs[0].clone();
    let other = RunRecord { owner: "elsewhere/1/0".into(), ..seen.clone() };
    assert!(!backend.adopt_run("a", &other, lease).unwrap());
    assert!(backend.adopt_run("a", &seen, lease).unwrap());
    assert!(!backend.adopt_run("a", &seen, lease).unwrap());
    let adopted = backend.runs().unwrap().remove(0);
    assert_eq!((adopted.pid, adopted.owner.as_str()), (std::process::id(), sagabox::backend::this_process()));
    assert_eq!(adopted.lease_until_ms, Some(lease));
    assert!(!backend.adopt_run("missing", &seen, lease).unwrap());
    // A finished run is nobody's to take over.
    let end = event("b", 0, EventKind::SagaFinished).data(json!({ "status": "failed" }));
    backend.record(&[end]).unwrap();
    let b = backend.runs().unwrap().remove(1);
    assert_eq!(b.status, "failed");
    assert!(!backend.adopt_run("b", &b, lease).unwrap());
}

fn snapshots_are_isolated_from_later_commits(open: Open) {
    let backend = open(&pools());
    let before = backend.snapshot();
    let digest = before.digest();
    let mut t = txn(&*backend);
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
                        let mut t = txn(&**backend);
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

/// Adds `n` to the pool as a call would: read, modify, write, again on a conflict.
fn add(backend: &dyn Backend, n: u64) {
    loop {
        let mut t = txn(backend);
        let pool: Value = serde_json::from_str(&t.get("pools", "p").unwrap()).unwrap();
        let next = pool["allocated"].as_u64().unwrap() + n;
        t.put("pools", "p", &json!({ "allocated": next }).to_string()).unwrap();
        match backend.commit(&t, None, &[]) {
            Ok(_) => return,
            Err(CommitError::Conflict(_)) => continue,
            Err(e) => panic!("{e}"),
        }
    }
}

fn two_handles_never_lose_an_update_and_see_each_others_writes(open: Open) {
    let subject = open(&pools());
    let (a, b) = (&subject.backend, (subject.reopen)());
    let (mut from_a, mut from_b) = (txn(&**a), txn(&*b));
    from_a.get("pools", "p");
    from_b.get("pools", "p");
    from_a.put("pools", "p", r#"{"allocated":1}"#).unwrap();
    from_b.put("pools", "p", r#"{"allocated":2}"#).unwrap();
    a.commit(&from_a, None, &[]).unwrap();
    assert!(matches!(b.commit(&from_b, None, &[]), Err(CommitError::Conflict(_))));
    assert_eq!(text(&b.snapshot(), "pools", "p").as_deref(), Some(r#"{"allocated":1}"#), "b did not catch up");
    // Deletes and new keys reach the other handle too.
    let mut more = txn(&**a);
    more.delete("users", "u").unwrap();
    more.put("orders", "o1", "{}").unwrap();
    a.commit(&more, None, &[]).unwrap();
    let seen = b.snapshot();
    assert!(seen.namespace("users").is_none());
    assert!(seen.get("orders", "o1").is_some());
    assert_eq!(seen.digest(), a.current_state().unwrap().digest());
    // b's next commit is validated against the caught-up state: no false conflict.
    let mut after = txn(&*b);
    after.get("orders", "o1");
    after.put("orders", "o2", "{}").unwrap();
    b.commit(&after, None, &[]).unwrap();
    // Four handles, as four processes, each adding 25 times.
    let handles: Vec<_> = (0..4).map(|_| (subject.reopen)()).collect();
    std::thread::scope(|scope| {
        for handle in &handles {
            scope.spawn(|| (0..25).for_each(|_| add(&**handle, 1)));
        }
    });
    let end = a.current_state().unwrap();
    assert_eq!(text(&end, "pools", "p").as_deref(), Some(r#"{"allocated":101}"#), "an update was lost");
    for handle in &handles {
        assert_eq!(handle.snapshot().digest(), end.digest());
    }
}

fn a_commit_that_writes_nothing_never_hides_another_handles_commit(open: Open) {
    let subject = open(&pools());
    let (a, b) = (&subject.backend, (subject.reopen)());
    a.register_run(&record("ra")).unwrap();
    // a commits a read-only step (its journal record and nothing else)...
    let mut read_only = txn(&**a);
    read_only.get("pools", "p");
    a.commit(&read_only, None, &[event("ra", 0, EventKind::StepCompleted)]).unwrap();
    // ...b allocates 5, and then a allocates 10 on top of what it sees.
    add(&*b, 5);
    add(&**a, 10);
    assert_eq!(text(&a.current_state().unwrap(), "pools", "p").as_deref(), Some(r#"{"allocated":15}"#));
    assert_eq!(a.snapshot().digest(), b.snapshot().digest());
}

fn of_two_handles_only_one_adopts_a_run_and_one_delivery_commits(open: Open) {
    let subject = open(&pools());
    let (a, b) = (&subject.backend, (subject.reopen)());
    let mut run = record("r");
    run.pid = 4_000_000;
    a.register_run(&run).unwrap();
    assert!(matches!(b.register_run(&run), Err(RegisterError::Exists { .. })));
    // Both saw the dead process 4000000 running it; only the first takes it over.
    let lease = now_ms() + 60_000;
    let (first, second) = (a.adopt_run("r", &run, lease).unwrap(), b.adopt_run("r", &run, lease).unwrap());
    assert!(first && !second);
    // Two deliveries of one call, one per handle: the second writes nothing.
    let (mut one, mut two) = (txn(&**a), txn(&*b));
    one.put("allocations", "A1", r#"{"n":1}"#).unwrap();
    two.put("allocations", "A1", r#"{"n":2}"#).unwrap();
    a.commit(&one, Some(("k", &json!({ "n": 1 }))), &[event("r", 0, EventKind::StepCompleted)]).unwrap();
    let err = b.commit(&two, Some(("k", &json!({ "n": 2 }))), &[event("r", 1, EventKind::StepCompleted)]);
    assert!(matches!(&err, Err(CommitError::AlreadyCommitted(v)) if *v == json!({ "n": 1 })), "{err:?}");
    assert_eq!(b.cached("k"), Some(json!({ "n": 1 })));
    assert_eq!(seqs(&*b, "r"), [0]);
    // And a journal record written by one is never overwritten by the other.
    let err = b.record(&[event("r", 0, EventKind::SagaResumed)]);
    assert!(matches!(&err, Err(CommitError::Backend(m)) if m.contains("seq 0")), "{err:?}");
    assert_eq!(a.events("r").unwrap()[0].event, EventKind::StepCompleted);
}

fn the_queue_hands_each_run_to_one_claimer_and_leases_renew(open: Open) {
    let subject = open(&pools());
    let (a, b) = (&subject.backend, (subject.reopen)());
    let now = now_ms();
    let elsewhere = |id: &str, lease_until_ms: u64| RunRecord {
        owner: "elsewhere/1/0".into(),
        pid: 1,
        lease_until_ms: Some(lease_until_ms),
        ..record(id)
    };
    for n in 1..=5 {
        a.register_run(&record(&format!("q{n}")).queued()).unwrap();
    }
    a.register_run(&elsewhere("live", now + 60_000)).unwrap();
    a.register_run(&elsewhere("dead", now - 1)).unwrap();
    a.register_run(&RunRecord { status: "completed".into(), ..elsewhere("done", now - 1) }).unwrap();
    // Registered within a millisecond or two: the ids, not their order, are what to check.
    let mut unfinished: Vec<String> = b.unfinished_runs().unwrap().into_iter().map(|r| r.run_id).collect();
    unfinished.sort();
    assert_eq!(unfinished, ["dead", "live", "q1", "q2", "q3", "q4", "q5"], "a finished run is listed as unfinished");
    let queued = a.runs().unwrap().into_iter().find(|r| r.run_id == "q1").unwrap();
    assert_eq!((queued.status.as_str(), queued.owner.as_str(), queued.lease_until_ms), ("queued", "", None));

    // Two claimers at once, two runs at a time, until nothing is left. They are one process
    // here, and hold every run on purpose: a claim gives back none of this process's own.
    let lease = now + 30_000;
    let every: Vec<String> = ["q1", "q2", "q3", "q4", "q5", "live", "dead", "done"].map(String::from).into();
    let every = &every;
    let claimed: Vec<RunRecord> = std::thread::scope(|scope| {
        let claimers: Vec<_> = [&**a, &*b]
            .into_iter()
            .map(|handle| {
                scope.spawn(move || {
                    let mut mine = Vec::new();
                    loop {
                        let got = handle.claim_runs(now, lease, 2, every).unwrap();
                        if got.is_empty() {
                            return mine;
                        }
                        mine.extend(got);
                    }
                })
            })
            .collect();
        claimers.into_iter().flat_map(|c| c.join().unwrap()).collect()
    });
    let mut ids: Vec<&str> = claimed.iter().map(|r| r.run_id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["dead", "q1", "q2", "q3", "q4", "q5"], "each claimable run once; never a live or finished one");
    for run in &claimed {
        assert_eq!((run.status.as_str(), run.owner.as_str()), ("running", sagabox::backend::this_process()));
        assert_eq!((run.pid, run.lease_until_ms), (std::process::id(), Some(lease)));
    }
    // Renewing extends exactly this process's unfinished runs.
    assert_eq!(a.renew_leases(lease + 1).unwrap(), 6);
    let runs = b.runs().unwrap();
    let lease_of = |id: &str| runs.iter().find(|r| r.run_id == id).unwrap().lease_until_ms;
    assert_eq!(
        (lease_of("q3"), lease_of("dead"), lease_of("live")),
        (Some(lease + 1), Some(lease + 1), Some(now + 60_000))
    );
    // Once their leases run out, this process still does not take them back: it holds them
    // (its worker is running them; another process's run is taken below).
    let held: Vec<String> = claimed.iter().map(|r| r.run_id.clone()).collect();
    assert!(b.claim_runs(lease + 2, lease + 10_000, 100, &held).unwrap().is_empty(), "a process took back its runs");
}

/// Claims take queued runs and runs whose holder's lease ran out in one order, oldest first,
/// whichever kind they are, and never more than asked for.
fn claims_take_queued_and_expired_runs_oldest_first(open: Open) {
    let subject = open(&pools());
    let backend = &subject.backend;
    let now = now_ms();
    let expired =
        |id: &str| RunRecord { owner: "elsewhere/1/0".into(), pid: 1, lease_until_ms: Some(now - 1), ..record(id) };
    // Registered in this order, a few milliseconds apart: their start times order them.
    let order = ["e1", "q1", "q2", "e2", "q3", "e3"];
    for id in order {
        let run = if id.starts_with('e') { expired(id) } else { record(id).queued() };
        backend.register_run(&run).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(3));
    }
    let lease = now + 30_000;
    let mut taken = Vec::new();
    for limit in [1, 2, 1, 5] {
        let got = backend.claim_runs(now, lease, limit, &taken).unwrap();
        assert!(got.len() <= limit, "{} runs for a claim of {limit}", got.len());
        taken.extend(got.into_iter().map(|r| r.run_id));
    }
    assert_eq!(taken, order, "claims out of order");
    assert!(backend.claim_runs(now, lease, 5, &taken).unwrap().is_empty());
}

/// A claim whose answer was lost (the connection broke after the claim committed, or an
/// adoption's did) leaves runs this process holds and nothing here runs. The next claim
/// returns them again, under its new lease, oldest first with the queued ones; it never returns
/// a run the caller says it holds on purpose (it is running it, or gave up on it).
fn a_claim_returns_runs_this_process_holds_but_does_not_run(open: Open) {
    let subject = open(&pools());
    let backend = &subject.backend;
    let now = now_ms();
    for id in ["q1", "q2", "q3", "q4"] {
        backend.register_run(&record(id).queued()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(3));
    }
    let lease = now + 30_000;
    let ids = |runs: Vec<RunRecord>| runs.into_iter().map(|r| r.run_id).collect::<Vec<_>>();
    // Its answer lost: the caller never learns that it took q1 and q2.
    assert_eq!(ids(backend.claim_runs(now, lease, 2, &[]).unwrap()), ["q1", "q2"]);
    // The caller runs nothing yet: the oldest run, q1, comes back.
    assert_eq!(ids(backend.claim_runs(now, lease, 1, &[]).unwrap()), ["q1"], "a lost run not returned");
    // Now it runs q1: q2 comes back, with the queued runs.
    let held = ["q1".to_string()];
    assert_eq!(ids(backend.claim_runs(now, lease + 1, 5, &held).unwrap()), ["q2", "q3", "q4"]);
    let all = ["q1", "q2", "q3", "q4"].map(String::from);
    assert!(backend.claim_runs(now, lease, 5, &all).unwrap().is_empty(), "a held run claimed again");
    let runs = backend.runs().unwrap();
    let q2 = runs.iter().find(|r| r.run_id == "q2").unwrap();
    assert_eq!((q2.owner.as_str(), q2.lease_until_ms), (sagabox::backend::this_process(), Some(lease + 1)));
}

/// A fence: once another process holds a run (this one stalled past its lease, and the
/// other took the run over), this process's writes of it are refused and write nothing,
/// records it held back are dropped without failing other runs' commits, and its end does
/// not overwrite the registry. Runs this process holds are never claimed back by it.
fn a_run_another_process_took_over_gets_nothing_more_from_this_one(open: Open) {
    let subject = open(&pools());
    let (a, b) = (&subject.backend, (subject.reopen)());
    let elsewhere = "elsewhere/1/0";
    let theirs =
        RunRecord { owner: elsewhere.into(), pid: 1, lease_until_ms: Some(now_ms() + 60_000), ..record("theirs") };
    a.register_run(&theirs).unwrap();
    a.register_run(&record("mine")).unwrap();
    let put = |backend: &dyn Backend, allocated: u64| {
        let mut t = txn(backend);
        t.put("pools", "p", &format!(r#"{{"allocated":{allocated}}}"#)).unwrap();
        t
    };
    let taken_over = |result: Result<(), CommitError>| {
        let ok = matches!(&result, Err(CommitError::TakenOver { run_id, owner }) if run_id == "theirs" && owner == elsewhere);
        assert!(ok, "{result:?}");
    };

    // A record held back (or, in memory, refused at once) is never written, and the next
    // commit of another run goes on.
    let held_back = a.record(&[event("theirs", 0, EventKind::StepStarted)]);
    assert!(held_back.is_ok() || matches!(held_back, Err(CommitError::TakenOver { .. })), "{held_back:?}");
    a.commit(&put(&**a, 1), Some(("k1", &json!(1))), &[event("mine", 0, EventKind::StepCompleted)]).unwrap();
    assert_eq!((seqs(&*b, "mine"), seqs(&*b, "theirs")), (vec![0], vec![]));

    // A step of their run: refused before anything is written (state, cache, journal).
    taken_over(
        a.commit(&put(&**a, 2), Some(("k2", &json!(2))), &[event("theirs", 0, EventKind::StepCompleted)]).map(drop),
    );
    assert_eq!(text(&b.current_state().unwrap(), "pools", "p").as_deref(), Some(r#"{"allocated":1}"#));
    assert_eq!(b.cached("k2"), None);
    // Even when the call's result is already cached: the fence comes first.
    taken_over(
        a.commit(&put(&**a, 2), Some(("k1", &json!(1))), &[event("theirs", 0, EventKind::StepCompleted)]).map(drop),
    );
    // Its end: refused, and the registry keeps the holder's status.
    let end = event("theirs", 1, EventKind::SagaFinished).data(json!({ "status": "failed" }));
    taken_over(a.record(std::slice::from_ref(&end)));
    let status =
        |backend: &dyn Backend| backend.runs().unwrap().into_iter().find(|r| r.run_id == "theirs").unwrap().status;
    assert_eq!((status(&*b), seqs(&*b, "theirs")), ("running".to_string(), vec![]));

    // With every lease run out, a claim takes their run, never this process's own.
    let later = now_ms() + 120_000;
    // A claim skips rows locked at that moment (SKIP LOCKED), as PostgreSQL's are for a moment
    // while the refused commits' transactions roll back; a worker polls again, and so does this.
    let mut claimed: Vec<String> = Vec::new();
    for _ in 0..100 {
        let running = ["mine".to_string()];
        claimed = b.claim_runs(later, later + 60_000, 10, &running).unwrap().into_iter().map(|r| r.run_id).collect();
        if !claimed.is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(claimed, ["theirs"]);
    // Then this process writes it again.
    a.commit(&put(&**a, 3), Some(("k3", &json!(3))), &[event("theirs", 0, EventKind::StepCompleted)]).unwrap();
    a.record(&[end]).unwrap();
    assert_eq!((status(&*b), seqs(&*b, "theirs")), ("failed".to_string(), vec![0, 1]));
}

/// One module per backend, each with every test of the suite.
macro_rules! conformance {
    ($($backend:ident),* $(,)?) => {$(
        mod $backend {
            conformance!(@tests $backend:
                commit_applies_writes_and_returns_changes,
                a_conflicting_commit_is_refused_and_writes_nothing,
                a_second_commit_under_one_key_returns_the_first_output_and_writes_nothing,
                a_seeded_state_larger_than_a_batch_reads_back_whole,
                cached_returns_only_committed_results,
                before_a_call_its_cached_result_or_else_a_caught_up_state_is_read,
                the_journal_keeps_every_event_in_order_without_gaps,
                the_run_registry_round_trips,
                snapshots_are_isolated_from_later_commits,
                concurrent_increments_lose_no_update,
                two_handles_never_lose_an_update_and_see_each_others_writes,
                a_commit_that_writes_nothing_never_hides_another_handles_commit,
                of_two_handles_only_one_adopts_a_run_and_one_delivery_commits,
                the_queue_hands_each_run_to_one_claimer_and_leases_renew,
                claims_take_queued_and_expired_runs_oldest_first,
                a_claim_returns_runs_this_process_holds_but_does_not_run,
                a_run_another_process_took_over_gets_nothing_more_from_this_one,
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

conformance!(memory, sqlite, postgres);

/// What only the PostgreSQL backend has: a server that may be away, connections that may
/// break, and a schema it migrates itself.
mod postgres_server {
    use super::*;
    use support::postgres::{Schema, execute};

    #[test]
    fn an_unreachable_server_is_named_without_its_password() {
        // Nothing listens on port 1.
        let url = "postgres://postgres:s3cret@127.0.0.1:1/test";
        let err = PostgresBackend::open(url).err().expect("opened a database on a closed port");
        let message = err.to_string();
        assert!(message.contains("postgres://postgres:***@127.0.0.1:1/test"), "{message}");
        assert!(!message.contains("s3cret"), "{message}");
        // The command line says the same, and exits 2 (the command could not run).
        let out =
            std::process::Command::new(env!("CARGO_BIN_EXE_sagabox")).args(["runs", "--db", url]).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("postgres://postgres:***@127.0.0.1:1/test") && !stderr.contains("s3cret"), "{stderr}");
    }

    #[test]
    fn processes_opening_a_new_database_at_once_migrate_it_once() {
        let schema = Schema::new("migrate");
        let opened: Vec<_> = std::thread::scope(|scope| {
            let openers: Vec<_> = (0..4).map(|_| scope.spawn(|| PostgresBackend::open(&schema.url))).collect();
            openers.into_iter().map(|o| o.join().unwrap()).collect()
        });
        for backend in opened {
            backend.unwrap();
        }
        // Every migration recorded once, and the tables usable.
        let db = PostgresBackend::open(&schema.url).unwrap();
        assert!(db.seed_if_new(&pools()).unwrap());
        assert!(!db.seed_if_new(&pools()).unwrap(), "seeded twice");
        execute(&format!(
            "DO $$ BEGIN IF (SELECT COUNT(*) FROM {0}.sagabox_migrations) <> (SELECT MAX(version) FROM {0}.sagabox_migrations)
             THEN RAISE EXCEPTION 'a migration ran twice'; END IF; END $$",
            schema.name
        ));
        // A database a newer sagabox migrated is refused, not misread.
        execute(&format!("INSERT INTO {}.sagabox_migrations VALUES (999, 0)", schema.name));
        let err = PostgresBackend::open(&schema.url).err().expect("opened a newer schema").to_string();
        assert!(err.contains("version 999") && err.contains("upgrade sagabox"), "{err}");
    }

    #[test]
    fn results_an_earlier_sagabox_cached_are_found_under_their_runs() {
        let schema = Schema::new("results");
        drop(PostgresBackend::open(&schema.url).unwrap());
        // A database as an earlier sagabox left it: results cached under their bare keys.
        // The migration that moved them (PostgreSQL's fourth, SQLite's schema 5) only copies
        // rows, so a fresh database without its record is one.
        execute(&format!(
            r#"DELETE FROM {0}.sagabox_migrations WHERE version >= 4;
               INSERT INTO {0}.results VALUES ('k1', 'r1', '"booked"'), ('client-key', 'r2', '{{"paid":3}}')"#,
            schema.name
        ));
        let db = PostgresBackend::open(&schema.url).unwrap();
        // A resumed run looks its results up under itself...
        assert_eq!(db.cached("r1/k1"), Some(json!("booked")));
        assert_eq!(db.cached("r2/client-key"), Some(json!({ "paid": 3 })));
        // ...a client's retry under its own key, whichever run it comes in.
        assert_eq!(db.cached("client-key"), Some(json!({ "paid": 3 })));
        drop(db);
        let again = PostgresBackend::open(&schema.url).unwrap();
        assert_eq!(again.cached("r1/k1"), Some(json!("booked")), "migrated twice");
        let copies = support::postgres::query(&format!("SELECT COUNT(*) FROM {}.results", schema.name));
        assert_eq!(copies, ["4"], "each result copied once, the old rows kept");
    }

    #[test]
    fn a_server_out_of_connection_slots_is_waited_for_not_failed() {
        // Many workers on one server can take every connection slot for a moment. A role
        // limited to two connections stands in for a full server: the same refusal (53300,
        // "too many connections") without starving the other tests of slots.
        let schema = Schema::new("slots");
        let role = "sagabox_t_two_slots";
        execute(&format!(
            "DO $$ BEGIN CREATE ROLE {role} LOGIN CONNECTION LIMIT 2;
             EXCEPTION WHEN duplicate_object THEN NULL; END $$;
             GRANT ALL ON SCHEMA {0} TO {role}",
            schema.name
        ));
        let url = format!("{}&user={role}", schema.url);
        let (held, release) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
        let holder = {
            let (url, held) = (url.clone(), held.0);
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                runtime.block_on(async {
                    let mut clients = Vec::new();
                    for _ in 0..2 {
                        clients.push(support::postgres::connect(&url).await.unwrap());
                    }
                    held.send(()).unwrap();
                    // Both slots stay taken until the test lets them go.
                    tokio::task::spawn_blocking(move || release.1.recv()).await.unwrap().ok();
                    drop(clients);
                })
            })
        };
        held.1.recv().unwrap();
        let opener = {
            let url = url.clone();
            std::thread::spawn(move || PostgresBackend::open(&url))
        };
        std::thread::sleep(std::time::Duration::from_millis(1500));
        assert!(!opener.is_finished(), "opened with every slot taken: {:?}", opener.join().unwrap().err());
        release.0.send(()).unwrap();
        holder.join().unwrap();
        let db = opener.join().unwrap().unwrap_or_else(|e| panic!("a full server was not waited for: {e}"));
        assert!(db.seed_if_new(&pools()).unwrap());
        add(&db, 1);
        assert_eq!(text(&db.current_state().unwrap(), "pools", "p").as_deref(), Some(r#"{"allocated":1}"#));
    }

    #[test]
    fn commits_go_on_after_the_server_terminates_every_connection() {
        let schema = Schema::new("terminate");
        let app = format!("{}_app", schema.name);
        let db = PostgresBackend::open(&format!("{}&application_name={app}", schema.url)).unwrap();
        assert!(db.seed_if_new(&pools()).unwrap());
        db.register_run(&record("r")).unwrap();
        for seq in 0..20u64 {
            if seq % 4 == 0 {
                // As an administrator (or a failover) would: every connection of ours goes.
                execute(&format!(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = '{app}'"
                ));
            }
            add(&db, 1);
            let mut t = txn(&db);
            t.put("orders", &format!("o{seq}"), "{}").unwrap();
            db.commit(&t, Some((&format!("k{seq}"), &json!(seq))), &[event("r", seq, EventKind::StepCompleted)])
                .unwrap_or_else(|e| panic!("commit {seq} after a terminated connection: {e}"));
        }
        let state = db.current_state().unwrap();
        assert_eq!(text(&state, "pools", "p").as_deref(), Some(r#"{"allocated":20}"#));
        assert_eq!(seqs(&db, "r"), (0..20).collect::<Vec<_>>(), "the journal has a gap or a duplicate");
        assert_eq!(db.cached("k19"), Some(json!(19)));
    }
}
