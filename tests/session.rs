//! Sessions and transactions: sagas whose steps arrive one call at a time (what an MCP
//! client drives), tested through the library. The MCP protocol itself is tested with the
//! official Python SDK in `tests/serve.rs`.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use sagabox::backend::{Backend, Durability, MemoryBackend, RunRecord, SqliteBackend};
use sagabox::saga::session::{self, CallOutcome, SESSION_SOURCE, Session};
use sagabox::saga::{RunOptions, Status};
use sagabox::serve::transaction::{CallReply, CallRequest, Context, OnFailure, Transactions, ending_reason};
use sagabox::store::State;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

fn pools(capacity: u64) -> State {
    State::from_json(&json!({ "pools": { "p": { "capacity": capacity, "allocated": 0 } } })).unwrap()
}

fn allocated(backend: &dyn Backend) -> i64 {
    let state = backend.snapshot();
    let pool: Value = serde_json::from_str(&state.get("pools", "p").unwrap().text).unwrap();
    pool["allocated"].as_i64().unwrap()
}

fn request(tool: &str, args: Value) -> CallRequest {
    CallRequest { tool: tool.into(), args, client_key: None, cancel: CancellationToken::new(), log: None }
}

fn transactions(runtime: sagabox::runtime::Runtime, backend: Arc<dyn Backend>) -> Arc<Transactions> {
    transactions_idle_after(runtime, backend, Duration::from_secs(600))
}

fn transactions_idle_after(
    runtime: sagabox::runtime::Runtime,
    backend: Arc<dyn Backend>,
    idle_timeout: Duration,
) -> Arc<Transactions> {
    Transactions::new(Arc::new(Context {
        runtime: Arc::new(runtime),
        backend,
        register_runs: false,
        on_failure: OnFailure::Compensate,
        idle_timeout,
    }))
}

/// Waits (up to 10 s) until no transaction is open.
async fn until_all_closed(transactions: &Transactions) {
    for _ in 0..1000 {
        if transactions.open_count() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{} transaction(s) still open after 10 s", transactions.open_count());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ten_thousand_call_session_is_undone_call_by_call_latest_first() {
    let runtime = support::runtime().await;
    let initial = pools(100_000);
    let backend = MemoryBackend::new(initial.clone());
    let shell = session::shell("big", None);
    let session = Session::open(&runtime, &shell, &backend, RunOptions::new("big-session", json!({})));
    for n in 0..10_000 {
        let outcome = session.call("resources.allocate", json!({ "pool_id": "p", "amount": 1 }), None).await;
        assert!(matches!(outcome, CallOutcome::Completed { replayed: false, .. }), "call {n}: {outcome:?}");
    }
    assert_eq!(allocated(&backend), 10_000);
    let report = session.abort(ending_reason("aborted", "test")).await;
    assert_eq!(report.status, Status::Failed);
    assert_eq!(report.compensated.len(), 10_000);
    // Reverse completion order: call-10000 first.
    assert_eq!(report.compensated.first().map(String::as_str), Some("call-10000"));
    assert_eq!(report.compensated.last().map(String::as_str), Some("call-1"));
    assert_eq!(backend.snapshot().digest(), initial.digest());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_off_its_schema_is_refused_without_becoming_a_step_or_failing_the_transaction() {
    let runtime = support::runtime().await;
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new(pools(10)));
    let transactions = transactions(runtime, Arc::clone(&backend));
    let tx = transactions.begin(Some("schema"), None).unwrap();
    let first = tx.call(request("resources.allocate", json!({ "pool_id": "p", "amount": 2 }))).await.unwrap();
    assert!(matches!(first, CallReply::Completed { .. }), "{first:?}");
    let bad = tx.call(request("resources.allocate", json!({ "pool_id": "p", "amount": "lots" }))).await.unwrap();
    match bad {
        CallReply::Failed { step: None, error, ending: None, .. } => {
            assert!(error.message.contains("schema"), "{}", error.message)
        }
        other => panic!("expected a refusal that ends nothing, got {other:?}"),
    }
    // The transaction is still open with its one effect.
    let status = tx.status().await.unwrap();
    assert_eq!(status.steps.len(), 1);
    assert_eq!(allocated(&*backend), 2);
    let ending = tx.end(false, Some(ending_reason("aborted", "test"))).await.unwrap();
    assert_eq!(ending.compensated.len(), 1);
    assert_eq!(allocated(&*backend), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_call_rolls_back_the_calls_before_it_and_closes_the_transaction() {
    let runtime = support::runtime().await;
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new(pools(10)));
    let transactions = transactions(runtime, Arc::clone(&backend));
    let tx = transactions.begin(None, None).unwrap();
    for _ in 0..3 {
        let reply = tx.call(request("resources.allocate", json!({ "pool_id": "p", "amount": 3 }))).await.unwrap();
        assert!(matches!(reply, CallReply::Completed { .. }), "{reply:?}");
    }
    // 9 of 10 allocated: 3 more is rejected.
    let reply = tx.call(request("resources.allocate", json!({ "pool_id": "p", "amount": 3 }))).await.unwrap();
    let CallReply::Failed { step: Some(step), error, ending: Some(ending), .. } = reply else {
        panic!("expected a failure that ended the transaction, got {reply:?}")
    };
    assert_eq!(step, "call-4");
    assert_eq!(error.code, "rejected");
    assert_eq!(ending.status, "rolled_back");
    let undone: Vec<&str> = ending.compensated.iter().map(|u| u.step.as_str()).collect();
    assert_eq!(undone, ["call-3", "call-2", "call-1"]);
    assert_eq!(allocated(&*backend), 0);
    // The handle is closed now.
    assert!(tx.call(request("resources.allocate", json!({ "pool_id": "p", "amount": 1 }))).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_call_stops_and_writes_nothing() {
    let runtime = support::runtime().await;
    let initial = pools(10);
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new(initial.clone()));
    let transactions = transactions(runtime, Arc::clone(&backend));
    let tx = transactions.begin(None, None).unwrap();
    let cancel = CancellationToken::new();
    // `hostile.spin` loops until it is stopped: by the cancel, or by its fuel (10⁹ units, a
    // hundred ms or so of CPU on a fast core). So the cancel comes as soon as the call is in
    // flight, not after a fixed sleep that a loaded machine can stretch past the fuel.
    let mut spin = request("hostile.spin", json!({}));
    spin.cancel = cancel.clone();
    let call = tokio::spawn({
        let tx = tx.clone();
        async move { tx.call(spin).await }
    });
    let started = tokio::time::timeout(Duration::from_secs(5), async {
        while tx.status().await.unwrap().in_flight == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    started.await.expect("the call started");
    cancel.cancel();
    let reply = tokio::time::timeout(Duration::from_secs(5), call).await.expect("cancelled in time").unwrap().unwrap();
    match reply {
        CallReply::Failed { error, .. } => assert_eq!(error.code, "cancelled", "{error:?}"),
        other => panic!("expected a cancelled call, got {other:?}"),
    }
    assert_eq!(backend.snapshot().digest(), initial.digest());
    // The transaction still serves.
    let reply = tx.call(request("resources.allocate", json!({ "pool_id": "p", "amount": 1 }))).await.unwrap();
    assert!(matches!(reply, CallReply::Completed { .. }), "{reply:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_transactions_at_once_each_undo_only_their_own_effects() {
    let runtime = support::runtime().await;
    // Ten pools, a hundred transactions on each: enough contention to conflict, not so
    // much that every commit does.
    let pool = |i: usize| format!("p{}", i % 10);
    let state: serde_json::Map<String, Value> =
        (0..10).map(|i| (pool(i), json!({ "capacity": 1_000_000, "allocated": 0 }))).collect();
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new(State::from_json(&json!({ "pools": state })).unwrap()));
    let transactions = transactions(runtime, Arc::clone(&backend));
    let runs = (0..1_000).map(|i| {
        let transactions = Arc::clone(&transactions);
        async move {
            let tx = transactions.begin(None, None).unwrap();
            let amount = i % 7 + 1;
            let reply = tx.call(request("resources.allocate", json!({ "pool_id": pool(i), "amount": amount }))).await;
            assert!(matches!(reply, Ok(CallReply::Completed { .. })), "{reply:?}");
            // Even ones keep their effect, odd ones undo it.
            let commit = i % 2 == 0;
            tx.end(commit, (!commit).then(|| ending_reason("aborted", "test"))).await.unwrap();
            if commit { amount as i64 } else { 0 }
        }
    });
    let kept: i64 = futures::future::join_all(runs).await.into_iter().sum();
    let state = backend.snapshot();
    let total: i64 = (0..10)
        .map(|i| {
            let doc: Value = serde_json::from_str(&state.get("pools", &pool(i)).unwrap().text).unwrap();
            doc["allocated"].as_i64().unwrap()
        })
        .sum();
    assert_eq!(total, kept);
    assert_eq!(transactions.open_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_a_crash_left_open_is_compensated_once_from_its_journal() {
    let runtime = support::runtime().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sessions.db");
    let initial = pools(10);
    let run_id = "tx-crashed";
    {
        let db = SqliteBackend::open(&path, Durability::Normal).unwrap();
        db.seed_if_new(&initial).unwrap();
        db.register_run(&RunRecord {
            run_id: run_id.into(),
            saga: "session:crashed".into(),
            saga_path: SESSION_SOURCE.into(),
            definition: String::new(),
            input: json!({}),
            seed: 0,
            status: "running".into(),
            pid: 0,
            owner: String::new(),
            lease_until_ms: None,
            started_ms: 0,
            finished_ms: None,
        })
        .unwrap();
        let shell = session::shell("crashed", None);
        let session = Session::open(&runtime, &shell, &db, RunOptions::new(run_id, json!({})));
        for amount in [2, 3] {
            let outcome = session.call("resources.allocate", json!({ "pool_id": "p", "amount": amount }), None).await;
            assert!(matches!(outcome, CallOutcome::Completed { .. }), "{outcome:?}");
        }
        // The process dies here: the session is never finished.
    }
    let db = SqliteBackend::open_existing(&path, Durability::Normal).unwrap();
    assert_eq!(allocated(&db), 5);
    let mut options = RunOptions::new(run_id, json!({}));
    options.resume = db.events(run_id).unwrap();
    let report = session::abort_interrupted(&runtime, &db, "session:crashed", options).await;
    assert_eq!(report.compensated, ["call-2", "call-1"]);
    assert!(report.compensation_failures.is_empty());
    assert_eq!(db.current_state().unwrap().digest(), initial.digest());
    let record = db.runs().unwrap().into_iter().find(|r| r.run_id == run_id).unwrap();
    assert_ne!(record.status, "running");

    // Interrupted again in the middle of its compensation, it does not undo twice.
    let mut options = RunOptions::new(run_id, json!({}));
    options.resume = db.events(run_id).unwrap();
    let again = session::abort_interrupted(&runtime, &db, "session:crashed", options).await;
    assert!(again.compensation_failures.is_empty());
    assert_eq!(db.current_state().unwrap().digest(), initial.digest());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exported_session_is_a_saga_whose_fixture_is_the_store_before_it() {
    let runtime = support::runtime().await;
    let initial = pools(10);
    let backend = MemoryBackend::new(initial.clone());
    let shell = session::shell("export", None);
    let session = Session::open(&runtime, &shell, &backend, RunOptions::new("export", json!({})));
    session.call("resources.allocate", json!({ "pool_id": "p", "amount": 4 }), None).await;
    // An argument that reads like a binding stays a literal.
    session.call("hostile.echo", json!({ "path": "$.input.x" }), None).await;
    let report = session.commit().await;
    assert_eq!(report.status, Status::Completed);
    let saga = session::as_saga("export", &report.events);
    let steps = saga["saga"]["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 2);
    assert_eq!(steps[0]["action"]["arguments"], json!({ "pool_id": "p", "amount": 4 }));
    assert_eq!(steps[0]["compensate"]["name"], "resources.release");
    assert_eq!(steps[1]["action"]["arguments"], json!({ "$literal": { "path": "$.input.x" } }));
    let before = session::state_before(&report.events, &backend.snapshot()).unwrap();
    assert_eq!(before.digest(), initial.digest());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_waits_for_the_calls_in_flight_and_undoes_them_too() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = support::runtime_with(&[&support::install_slow_pool(dir.path())]).await;
    let initial = pools(10);
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new(initial.clone()));
    let transactions = transactions(runtime, Arc::clone(&backend));
    let tx = transactions.begin(None, None).unwrap();
    let quick = tx.call(request("resources.allocate", json!({ "pool_id": "p", "amount": 1 }))).await.unwrap();
    assert!(matches!(quick, CallReply::Completed { .. }), "{quick:?}");
    // A slow call is in flight when the abort arrives: it completes, then is undone first.
    let slow = tokio::spawn({
        let tx = tx.clone();
        async move { tx.call(request("slow_pool.allocate", json!({ "pool_id": "p", "amount": 2, "delay_ms": 300 }))).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let ending = tx.end(false, Some(ending_reason("aborted", "test"))).await.unwrap();
    let undone: Vec<&str> = ending.compensated.iter().map(|u| u.step.as_str()).collect();
    assert_eq!(undone, ["call-2", "call-1"]);
    // The slow call's client learns that its effect was rolled back.
    match slow.await.unwrap().unwrap() {
        CallReply::Failed { step: Some(step), error, ending: Some(_), .. } => {
            assert_eq!(step, "call-2");
            assert_eq!(error.code, "rolled_back");
        }
        other => panic!("expected the in-flight call to report its rollback, got {other:?}"),
    }
    assert_eq!(allocated(&*backend), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_transaction_and_one_past_its_time_out_are_undone() {
    let runtime = support::runtime().await;
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new(pools(10)));
    let transactions = transactions_idle_after(runtime, Arc::clone(&backend), Duration::from_millis(300));
    // Idle: nothing after its first call.
    let idle = transactions.begin(Some("idle"), None).unwrap();
    idle.call(request("resources.allocate", json!({ "pool_id": "p", "amount": 1 }))).await.unwrap();
    // Busy, but past its own 400 ms time-out.
    let late = transactions.begin(Some("late"), Some(Duration::from_millis(400))).unwrap();
    for _ in 0..8 {
        let reply = late.call(request("resources.allocate", json!({ "pool_id": "p", "amount": 1 }))).await;
        if reply.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    until_all_closed(&transactions).await;
    assert!(!idle.is_open() && !late.is_open());
    assert_eq!(allocated(&*backend), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_with_the_clients_key_answers_from_the_first_delivery_and_is_undone_by_its_owner_only() {
    let runtime = support::runtime().await;
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new(pools(10)));
    let transactions = transactions(runtime, Arc::clone(&backend));
    let keyed = || {
        let mut r = request("resources.allocate", json!({ "pool_id": "p", "amount": 3 }));
        r.client_key = Some("order-42".into());
        r
    };
    let first = transactions.begin(None, None).unwrap();
    let CallReply::Completed { output, replayed: false, .. } = first.call(keyed()).await.unwrap() else {
        panic!("the first delivery runs")
    };
    // Retried in the same transaction (a reply lost on the way): the same answer, no new step.
    let CallReply::Completed { output: again, replayed: true, step, .. } = first.call(keyed()).await.unwrap() else {
        panic!("a retry is answered from the first delivery")
    };
    assert_eq!((again, step.as_str()), (output.clone(), "call-1"));
    first.end(true, None).await.unwrap();
    // Retried from another transaction (the client reconnected): same answer; aborting that
    // transaction does not undo the first one's effect.
    let second = transactions.begin(None, None).unwrap();
    let CallReply::Completed { output: later, replayed: true, .. } = second.call(keyed()).await.unwrap() else {
        panic!("a retry in another transaction is answered from the first delivery")
    };
    assert_eq!(later, output);
    let ending = second.end(false, Some(ending_reason("aborted", "test"))).await.unwrap();
    assert!(ending.compensated.is_empty(), "{:?}", ending.compensated);
    assert_eq!(allocated(&*backend), 3);
}
