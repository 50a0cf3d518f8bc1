//! The saga engine, steno-style: a failure injected at every step of every shipped saga
//! fails the saga there, compensates each completed step exactly once in a valid order, and
//! restores the state; undo and redo twice change nothing; time-outs, binding failures,
//! failing compensators and DAGs behave.

use crate::support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sagabox::backend::{Backend, CommitError, DbError, MemoryBackend, RegisterError, RunRecord};
use sagabox::runtime::{CallContext, CallOptions, Runtime};
use sagabox::saga::journal::EventKind;
use sagabox::saga::{self, Fault, FaultPlan, Phase, RunOptions, RunReport, Saga, Status, StepStatus};
use sagabox::store::{MemoryStore, State, fixture};
use serde_json::{Value, json};
use support::*;
use tokio::sync::OnceCell;

async fn shared_runtime() -> &'static Runtime {
    static RUNTIME: OnceCell<Runtime> = OnceCell::const_new();
    RUNTIME.get_or_init(runtime).await
}

/// A shipped saga with its fixture and input.
struct Case {
    saga: Saga,
    state: State,
    input: Value,
}

async fn case(name: &str) -> Case {
    let path = sagas_dir().join(format!("{name}.json"));
    let saga = Saga::load(&path, shared_runtime().await).unwrap_or_else(|e| panic!("{name}: {e}"));
    let state = fixture::load(saga.companions.fixture.as_ref().expect("a fixture")).unwrap();
    let input =
        serde_json::from_str(&std::fs::read_to_string(saga.companions.input.as_ref().expect("an input")).unwrap())
            .unwrap();
    Case { saga, state, input }
}

impl Case {
    fn options(&self, faults: FaultPlan) -> RunOptions {
        let mut options = RunOptions::new("test-run", self.input.clone());
        options.seed = 7;
        options.faults = faults;
        options.deterministic = true;
        options
    }

    async fn run(&self, faults: FaultPlan) -> (RunReport, State) {
        self.run_with(self.options(faults)).await
    }

    async fn run_with(&self, options: RunOptions) -> (RunReport, State) {
        let backend = MemoryBackend::new(self.state.clone());
        let report = saga::run(shared_runtime().await, &self.saga, &backend, options).await;
        (report, backend.store.snapshot())
    }

    fn ids(&self) -> Vec<String> {
        self.saga.plan.steps.iter().map(|s| s.id.clone()).collect()
    }

    fn restored(&self, state: &State) -> bool {
        state.digest_excluding(&self.saga.plan.ledgers) == self.state.digest_excluding(&self.saga.plan.ledgers)
    }
}

const SHIPPED: [&str; 7] = [
    "travel",
    "ct1-payment-failure",
    "ct2-capacity-overflow",
    "ct3-agent-unavailable",
    "supply-chain",
    "onboarding",
    "trip-dag",
];

#[tokio::test(flavor = "multi_thread")]
async fn shipped_sagas_end_as_designed() {
    let expected: [(&str, Status, Option<&str>, &[&str]); 7] = [
        ("travel", Status::Completed, None, &[]),
        ("ct1-payment-failure", Status::Failed, Some("payment"), &["hotel", "flight"]),
        ("ct2-capacity-overflow", Status::Failed, Some("alloc4"), &["alloc3", "alloc2", "alloc1"]),
        ("ct3-agent-unavailable", Status::Failed, Some("task4"), &["task3", "task2", "task1"]),
        ("supply-chain", Status::Failed, Some("ship"), &["charge", "reserve"]),
        ("onboarding", Status::Completed, None, &[]),
        ("trip-dag", Status::Completed, None, &[]),
    ];
    for (name, status, failed, compensated) in expected {
        let case = case(name).await;
        let (report, state) = case.run(FaultPlan::none()).await;
        assert_eq!(report.status, status, "{name}: {:?}", report.error);
        assert_eq!(report.failed_step.as_deref(), failed, "{name}");
        assert_eq!(report.compensated, compensated, "{name}");
        if status == Status::Completed {
            assert!(
                report.output.as_ref().is_some_and(|o| o.as_object().is_some_and(|m| m.values().all(|v| !v.is_null())))
            );
            assert!(!case.restored(&state), "{name}: a completed saga changed nothing");
        } else {
            assert!(case.restored(&state), "{name}: rollback did not restore the state: {:?}", report.changes);
            assert!(report.error.is_some());
        }
    }
    let travel = case("travel").await.run(FaultPlan::none()).await.0;
    let output = travel.output.unwrap();
    assert!(output["flightConfirmation"].as_str().unwrap().starts_with('R'));
    assert!(output["carConfirmation"].as_str().unwrap().starts_with('C'));
}

/// Index of the step the clean run fails at, if any.
async fn natural_failure(case: &Case) -> Option<usize> {
    let (report, _) = case.run(FaultPlan::none()).await;
    report.failed_step.and_then(|id| case.saga.plan.step(&id).map(|(i, _)| i))
}

/// Checks that every compensated step was compensated once, after all its dependants.
fn assert_valid_compensation(case: &Case, report: &RunReport, context: &str) {
    for id in &report.compensated {
        assert_eq!(
            report.events_of(EventKind::CompensationCompleted, id),
            1,
            "{context}: '{id}' compensated more than once"
        );
    }
    let position: BTreeMap<&str, usize> = report.compensated.iter().enumerate().map(|(i, s)| (s.as_str(), i)).collect();
    for step in &case.saga.plan.steps {
        for &dep in &step.deps {
            let parent = &case.saga.plan.steps[dep].id;
            if let (Some(p), Some(c)) = (position.get(parent.as_str()), position.get(step.id.as_str())) {
                assert!(c < p, "{context}: '{parent}' was compensated before its dependant '{}'", step.id);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failure_at_every_step_fails_there_and_compensates_each_completed_step_once() {
    for name in SHIPPED {
        let case = case(name).await;
        let stop = natural_failure(&case).await.unwrap_or(usize::MAX);
        for (i, id) in case.ids().iter().enumerate().take_while(|(i, _)| *i <= stop) {
            for fault in [Fault::Rejected, Fault::Trap, Fault::Fuel, Fault::Timeout] {
                let context = format!("{name}, {fault} at '{id}'");
                let (report, state) = case.run(FaultPlan::single(id, Phase::Action, fault)).await;
                assert_eq!(report.status, Status::Failed, "{context}: {:?}", report.error);
                assert_eq!(report.failed_step.as_deref(), Some(id.as_str()), "{context}");
                let expected: Vec<String> = case.ids()[..i]
                    .iter()
                    .rev()
                    .filter(|s| case.saga.plan.step(s).unwrap().1.compensator.is_some())
                    .cloned()
                    .collect();
                assert_eq!(report.compensated, expected, "{context}");
                assert_eq!(
                    report.events_of(EventKind::CompensationStarted, id),
                    0,
                    "{context}: the failed step was compensated"
                );
                assert_valid_compensation(&case, &report, &context);
                assert!(case.restored(&state), "{context}: state not restored: {:?}", report.changes);
                if fault != Fault::Rejected {
                    let code = report.error.as_ref().unwrap().code.clone();
                    let want = match fault {
                        Fault::Trap => "trap",
                        Fault::Fuel => "out_of_fuel",
                        _ => "deadline_exceeded",
                    };
                    assert_eq!(code, want, "{context}");
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_response_leaves_the_step_uncertain_and_it_is_compensated_too() {
    for name in SHIPPED {
        let case = case(name).await;
        let stop = natural_failure(&case).await.unwrap_or(usize::MAX);
        // A lost response needs a call that succeeds: the naturally failing step has none.
        for id in case.ids().iter().take(stop) {
            let context = format!("{name}, lost response at '{id}'");
            let (report, state) = case.run(FaultPlan::single(id, Phase::Action, Fault::LostResponse)).await;
            assert_eq!(report.failed_step.as_deref(), Some(id.as_str()), "{context}");
            let step = report.step(id).unwrap();
            if case.saga.plan.step(id).unwrap().1.compensator.is_some() {
                assert_eq!(step.status, StepStatus::Compensated, "{context}");
                assert_eq!(report.compensated.first(), Some(id), "{context}: the uncertain step is undone first");
            }
            assert_valid_compensation(&case, &report, &context);
            assert!(case.restored(&state), "{context}: state not restored: {:?}", report.changes);
        }
    }
}

/// Re-delivers every call of a run's journal of `kind` straight to the runtime (no
/// idempotency cache in between), with its original arguments and key.
async fn redeliver(report: &RunReport, kind: EventKind, state: State) -> State {
    let runtime = shared_runtime().await;
    let store = MemoryStore::new(state);
    for event in report.events.iter().filter(|e| e.event == kind) {
        let options = CallOptions {
            context: CallContext {
                saga_id: report.run_id.clone(),
                step_id: event.step.clone().unwrap(),
                attempt: 2,
                idempotency_key: event.idempotency_key.clone().unwrap(),
            },
            ..CallOptions::default()
        };
        let args = event.data.clone().unwrap();
        let outcome = runtime.call(event.tool.as_deref().unwrap(), &args, &options, &store).await;
        assert!(outcome.result.is_ok(), "re-delivering {:?} failed: {:?}", event.tool, outcome.result);
    }
    store.snapshot()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_undo_twice_leaves_the_state_of_once() {
    for name in SHIPPED {
        let case = case(name).await;
        let last = case.ids().last().unwrap().clone();
        // Sagas that complete are made to fail at their last step, so every step is undone.
        let faults = match natural_failure(&case).await {
            Some(_) => FaultPlan::none(),
            None => FaultPlan::single(&last, Phase::Action, Fault::Rejected),
        };
        let (report, once) = case.run(faults.clone()).await;
        assert!(!report.compensated.is_empty(), "{name}");
        let twice = redeliver(&report, EventKind::CompensationStarted, once.clone()).await;
        assert_eq!(
            twice.digest_excluding(&case.saga.plan.ledgers),
            once.digest_excluding(&case.saga.plan.ledgers),
            "{name}"
        );

        // Delivered twice by the engine (same key): the second is a replay.
        let mut repeat = faults;
        for id in &report.compensated {
            repeat = repeat.with(id, Phase::Compensation, Fault::Repeat);
        }
        let (repeated, state) = case.run(repeat).await;
        assert!(case.restored(&state), "{name}");
        let replays = repeated
            .events
            .iter()
            .filter(|e| e.event == EventKind::CompensationCompleted && e.replayed == Some(true))
            .count();
        assert_eq!(replays, report.compensated.len(), "{name}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_action_delivered_twice_applies_once() {
    for name in SHIPPED {
        let case = case(name).await;
        let (clean, clean_state) = case.run(FaultPlan::none()).await;
        let mut repeat = FaultPlan::none();
        for id in case.ids() {
            repeat = repeat.with(&id, Phase::Action, Fault::Repeat);
        }
        let (report, state) = case.run(repeat).await;
        assert_eq!(report.status, clean.status, "{name}");
        assert_eq!(state.digest(), clean_state.digest(), "{name}: a repeated action changed the outcome");
        let replayed =
            report.events.iter().filter(|e| e.event == EventKind::StepCompleted && e.replayed == Some(true)).count();
        let completed_steps = clean.steps.iter().filter(|s| s.attempts > 0 && s.status != StepStatus::Failed).count();
        assert_eq!(replayed, completed_steps, "{name}");

        // Straight to the tools, bypassing the cache: their own idempotency holds.
        if clean.status == Status::Completed {
            let again = redeliver(&clean, EventKind::StepStarted, clean_state.clone()).await;
            assert_eq!(again.digest(), clean_state.digest(), "{name}: a tool applied a repeated call twice");
        }
    }
}

/// Writes a saga into a temp dir and loads it.
async fn temp_saga(dir: &Path, name: &str, saga: Value) -> Result<Saga, String> {
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&json!({ "saga": saga })).unwrap()).unwrap();
    Saga::load(&path, shared_runtime().await).map_err(|e| e.to_string())
}

fn pools() -> State {
    State::from_json(&json!({ "pools": { "p": { "capacity": 100, "allocated": 0 } } })).unwrap()
}

async fn run_temp(saga: &Saga, state: &State) -> (RunReport, State) {
    let backend = MemoryBackend::new(state.clone());
    let mut options = RunOptions::new("temp", json!({}));
    options.seed = 1;
    let report = saga::run(shared_runtime().await, saga, &backend, options).await;
    (report, backend.store.snapshot())
}

fn allocate(id: &str, amount: u64) -> Value {
    json!({ "id": id, "action": { "name": "resources.allocate", "arguments": { "pool_id": "p", "amount": amount } } })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_whole_saga_time_out_compensates_what_completed() {
    let dir = tempfile::tempdir().unwrap();
    let saga = temp_saga(
        dir.path(),
        "slow",
        json!({
            "steps": [
                allocate("a", 10),
                allocate("b", 20),
                { "id": "wait", "action": { "name": "hostile.sleep", "arguments": { "seconds": 30 } },
                  "limits": { "deadline_ms": 60000 } },
                allocate("never", 5)
            ],
            "timeout": "300ms"
        }),
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let (report, state) = run_temp(&saga, &pools()).await;
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    assert_eq!(report.status, Status::TimedOut, "{:?}", report.error);
    assert_eq!(report.error.as_ref().unwrap().code, "saga_timeout");
    assert_eq!(report.compensated, ["b", "a"]);
    assert_eq!(report.step("wait").unwrap().status, StepStatus::Cancelled);
    assert_eq!(report.step("never").unwrap().status, StepStatus::NotRun);
    assert_eq!(state.digest(), pools().digest());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_runs_results_are_cached_under_the_run_and_its_plugins_see_the_bare_key() {
    // Under the run: a transaction's results share the cache index's last pages.
    let dir = tempfile::tempdir().unwrap();
    let steps = [
        allocate("a", 10),
        json!({ "id": "b", "action": { "name": "resources.allocate", "arguments": { "pool_id": "p" } },
        "input": { "amount": { "path": "$.steps.a.no_such_field" } } }),
    ];
    let saga = temp_saga(dir.path(), "cached", json!({ "steps": steps })).await.unwrap();
    let backend = MemoryBackend::new(pools());
    let report = saga::run(shared_runtime().await, &saga, &backend, RunOptions::new("run-7", json!({}))).await;
    assert_eq!(report.status, Status::Failed);
    let delivered = [EventKind::StepCompleted, EventKind::CompensationCompleted];
    let keys: Vec<&str> = report
        .events
        .iter()
        .filter(|e| delivered.contains(&e.event))
        .map(|e| e.idempotency_key.as_deref().unwrap())
        .collect();
    assert_eq!(keys.len(), 2, "a's action and its compensation");
    for key in keys {
        assert_eq!(key.len(), 64, "the key a plugin sees changed: {key}");
        assert!(backend.cached(&format!("run-7/{key}")).is_some(), "{key} is not cached under its run");
        assert_eq!(backend.cached(key), None, "{key} is cached bare too");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_binding_failure_at_step_k_compensates_the_steps_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let saga = temp_saga(
        dir.path(),
        "binding",
        json!({
            "steps": [
                allocate("a", 10),
                allocate("b", 20),
                { "id": "c", "action": { "name": "resources.allocate", "arguments": { "pool_id": "p" } },
                  "input": { "amount": { "path": "$.steps.b.no_such_field" } } }
            ]
        }),
    )
    .await
    .unwrap();
    let (report, state) = run_temp(&saga, &pools()).await;
    assert_eq!(report.status, Status::Failed);
    assert_eq!(report.failed_step.as_deref(), Some("c"));
    let error = report.error.unwrap();
    assert_eq!(error.code, "binding");
    assert!(error.message.contains("$.steps.b has no field 'no_such_field'"), "{}", error.message);
    assert_eq!(report.compensated, ["b", "a"]);
    assert_eq!(state.digest(), pools().digest());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_compensator_that_always_fails_ends_in_compensation_failed_with_its_residue() {
    let case = case("ct1-payment-failure").await;
    let (report, state) = case.run(FaultPlan::single("flight", Phase::Compensation, Fault::Permanent)).await;
    assert_eq!(report.status, Status::CompensationFailed);
    assert_eq!(report.failed_step.as_deref(), Some("payment"));
    assert_eq!(report.error.as_ref().unwrap().code, "rejected");
    assert_eq!(report.compensated, ["hotel"], "the other compensations still ran");
    assert_eq!(report.compensation_failures.len(), 1);
    assert_eq!(report.compensation_failures[0].step, "flight");
    assert_eq!(report.step("flight").unwrap().compensation_attempts, 5);
    let residue: Vec<String> =
        report.residue.iter().map(|c| format!("{} {}/{}", c.change, c.namespace, c.key)).collect();
    assert!(residue.contains(&"changed flights/HAT001".to_string()), "{residue:?}");
    assert!(residue.iter().any(|r| r.starts_with("added reservations/R")), "{residue:?}");
    assert!(!case.restored(&state));

    // Transient compensator failures are retried until they pass.
    let (report, state) =
        case.run(FaultPlan::single("flight", Phase::Compensation, Fault::Transient { failures: 3 })).await;
    assert_eq!(report.status, Status::Failed);
    assert_eq!(report.step("flight").unwrap().compensation_attempts, 4);
    assert!(case.restored(&state));
}

#[tokio::test(flavor = "multi_thread")]
async fn transient_failures_are_retried_with_seeded_backoff() {
    let case = case("travel").await;
    let faults = FaultPlan::single("hotel", Phase::Action, Fault::Transient { failures: 2 });
    let (report, _) = case.run(faults.clone()).await;
    assert_eq!(report.status, Status::Completed);
    assert_eq!(report.step("hotel").unwrap().attempts, 3);
    let delays = |r: &RunReport| -> Vec<u64> {
        r.events
            .iter()
            .filter(|e| e.event == EventKind::StepRetried)
            .map(|e| e.data.as_ref().unwrap()["delay_ms"].as_u64().unwrap())
            .collect()
    };
    let first = delays(&report);
    assert_eq!(first.len(), 2);
    assert_eq!(delays(&case.run(faults.clone()).await.0), first, "same seed, same jitter");
    let mut other_seed = case.options(faults.clone());
    other_seed.seed = 8;
    assert_ne!(delays(&case.run_with(other_seed).await.0), first, "another seed, other jitter");

    // More failures than attempts: the step fails, and it is not compensated.
    let (report, state) = case.run(FaultPlan::single("hotel", Phase::Action, Fault::Transient { failures: 9 })).await;
    assert_eq!(report.status, Status::Failed);
    assert_eq!(report.step("hotel").unwrap().attempts, 3);
    assert_eq!(report.compensated, ["flight"]);
    assert!(case.restored(&state));

    // Rejections are never retried.
    let (report, _) = case.run(FaultPlan::single("hotel", Phase::Action, Fault::Rejected)).await;
    assert_eq!(report.step("hotel").unwrap().attempts, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn dag_parents_are_compensated_only_after_their_dependants() {
    let case = case("trip-dag").await;
    for concurrent in [false, true] {
        let mut options = case.options(FaultPlan::single("payment", Phase::Action, Fault::Rejected));
        options.deterministic = !concurrent;
        let (report, state) = case.run_with(options).await;
        assert_eq!(report.status, Status::Failed);
        assert_eq!(report.compensated.len(), 3);
        assert_eq!(report.compensated[0], "car", "car depends on flight and hotel: {:?}", report.compensated);
        assert_valid_compensation(&case, &report, "trip-dag");
        assert!(case.restored(&state));
    }
    // A failure in one parallel branch: the other branch's completed step is undone.
    let (report, state) = case.run(FaultPlan::single("hotel", Phase::Action, Fault::Rejected)).await;
    assert_eq!(report.failed_step.as_deref(), Some("hotel"));
    assert_eq!(report.compensated, ["flight"]);
    assert_eq!(report.step("car").unwrap().status, StepStatus::NotRun);
    assert!(case.restored(&state));
}

/// `runs` runs of `case`'s saga started at once on `backend`, their reports in start order.
async fn run_together(case: &Case, backend: &Arc<MemoryBackend>, runs: usize) -> Vec<RunReport> {
    let saga = Arc::new(case.saga.clone());
    let mut tasks = Vec::new();
    for i in 0..runs {
        let (backend, saga, input) = (backend.clone(), saga.clone(), case.input.clone());
        tasks.push(tokio::spawn(async move {
            let runtime = shared_runtime().await;
            saga::run(runtime, &saga, backend.as_ref(), RunOptions::new(format!("run-{i}"), input)).await
        }));
    }
    let mut reports = Vec::new();
    for task in tasks {
        reports.push(task.await.unwrap());
    }
    reports
}

#[tokio::test(flavor = "multi_thread")]
async fn many_sagas_at_once_on_one_store_each_roll_back_their_own_effects() {
    let case = case("ct2-capacity-overflow").await;
    let mut state = case.state.to_json();
    state["pools"]["cluster"]["capacity"] = json!(10_000);
    state["pools"]["cluster"]["allocated"] = json!(9_900);
    let backend = Arc::new(MemoryBackend::new(State::from_json(&state).unwrap()));
    let mut completed = 0;
    for report in run_together(&case, &backend, 16).await {
        assert!(matches!(report.status, Status::Completed | Status::Failed), "{:?}", report.error);
        completed += usize::from(report.status == Status::Completed);
    }
    // 100 units free, each saga wants 75: at most one completes and the others roll back.
    let pool: Value = serde_json::from_str(&backend.store.snapshot().get("pools", "cluster").unwrap().text).unwrap();
    assert_eq!(pool["allocated"], json!(9_900 + 75 * completed));
    assert!(completed <= 1);
}

/// CT1 runs at once on one store, all booking for the same user: each adds its reservation
/// to the user's list and takes it out again while others have theirs in. A run that rolled
/// back reports no change of its own (a worker running 3,000 such runs 64 at a time had 301
/// report the user changed: their list edits were undone as whole lists, taking the other
/// runs' reservations with them).
#[tokio::test(flavor = "multi_thread")]
async fn runs_rolled_back_together_report_no_change_to_a_list_they_shared() {
    let case = case("ct1-payment-failure").await;
    let backend = Arc::new(MemoryBackend::new(case.state.clone()));
    let mut reported = Vec::new();
    for report in run_together(&case, &backend, 256).await {
        assert_eq!(report.status, Status::Failed, "{:?}", report.error);
        if !report.changes.is_empty() {
            reported.push(format!("{}: {:?}", report.run_id, report.changes));
        }
    }
    assert!(case.restored(&backend.store.snapshot()), "the runs together left a change");
    assert!(reported.is_empty(), "{} rolled-back runs reported changes, e.g. {}", reported.len(), reported[0]);
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_sagas_are_refused_naming_file_step_and_problem() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "unknown-tool",
            json!({ "steps": [{ "id": "a", "action": { "name": "airline.fly" } }] }),
            "step 'a': action: no tool named 'airline.fly'",
        ),
        ("duplicate", json!({ "steps": [allocate("a", 1), allocate("a", 2)] }), "step 'a': the step id is used twice"),
        (
            "cycle",
            json!({ "steps": [
                { "id": "a", "action": { "name": "hostile.echo" }, "depends_on": ["b"] },
                { "id": "b", "action": { "name": "hostile.echo" }, "depends_on": ["a"] }
            ] }),
            "the dependencies form a cycle",
        ),
        (
            "unknown-binding",
            json!({ "steps": [{ "id": "a", "action": { "name": "hostile.echo" }, "input": { "x": { "path": "$.steps.zz.id" } } }] }),
            "step 'a': input: $.steps.zz.id names the unknown step 'zz'",
        ),
        (
            "not-ancestor",
            json!({ "steps": [
                { "id": "a", "action": { "name": "hostile.echo" }, "depends_on": [] },
                { "id": "b", "action": { "name": "hostile.echo" }, "depends_on": [], "input": { "x": { "path": "$.steps.a.x" } } }
            ] }),
            "step 'b': input: $.steps.a.x reads step 'a', which is not guaranteed to run before this one",
        ),
        (
            "schema",
            json!({ "steps": [{ "id": "a", "action": { "name": "resources.allocate", "arguments": { "pool_id": "p", "amount": "lots" } } }] }),
            "step 'a': the arguments do not match resources.allocate's schema",
        ),
        (
            "no-compensator",
            json!({ "steps": [{ "id": "a", "action": { "name": "hostile.trespass" } }] }),
            "step 'a': hostile.trespass has side effects and no compensator",
        ),
        (
            "bad-path",
            json!({ "steps": [{ "id": "a", "action": { "name": "hostile.echo" }, "input": { "path": "steps.a" } }] }),
            "a path starts with '$'",
        ),
    ];
    for (name, saga, expected) in cases {
        let error = temp_saga(dir.path(), name, saga).await.expect_err(name);
        assert!(error.contains(&format!("{name}.json")), "{name}: the error does not name the file: {error}");
        assert!(error.contains(expected), "{name}: expected '{expected}' in: {error}");
    }
    let allowed =
        json!({ "steps": [{ "id": "a", "action": { "name": "hostile.trespass" }, "no_compensation": true }] });
    assert!(temp_saga(dir.path(), "allowed", allowed).await.is_ok());
}

fn saga_path(name: &str) -> String {
    sagas_dir().join(format!("{name}.json")).display().to_string()
}

#[test]
fn the_cli_runs_sagas_and_reports_json() {
    let out = sagabox(&["run", &saga_path("ct1-payment-failure"), "--json", "--seed", "3"]);
    assert_eq!(out.status.code(), Some(1));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["status"], "failed");
    assert_eq!(report["failed_step"], "payment");
    assert_eq!(report["compensated"], json!(["hotel", "flight"]));
    assert_eq!(report["output"], Value::Null);

    let dir = tempfile::tempdir().unwrap();
    let journal: PathBuf = dir.path().join("journal.jsonl");
    let out = sagabox(&["run", &saga_path("travel"), "--journal", journal.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("completed") && text.contains("state changes: changed flights/HAT001"), "{text}");
    let lines: Vec<Value> =
        std::fs::read_to_string(&journal).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.first().unwrap()["event"], "saga_started");
    assert_eq!(lines.last().unwrap()["event"], "saga_finished");
    let completed: Vec<&Value> = lines.iter().filter(|l| l["event"] == "step_completed").collect();
    assert_eq!(completed.len(), 3);
    assert!(completed.iter().all(|e| e["idempotency_key"].as_str().unwrap().len() == 64 && e["replayed"] == false));

    let out = sagabox(&["run", &saga_path("ct1-payment-failure"), "--fault", "nope:trap"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the saga has no step 'nope'"));

    let out = sagabox(&["validate", sagas_dir().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), SHIPPED.len());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_native_build_of_the_tools_behaves_exactly_like_the_sandboxed_one() {
    // The benchmarks compare the two; they must do the same work to the same state.
    let native = Runtime::load(sagabox::runtime::RuntimeOptions { native_tools: true, ..options() }).await.unwrap();
    for name in SHIPPED {
        let case = case(name).await;
        for faults in [FaultPlan::none(), FaultPlan::single(case.ids().last().unwrap(), Phase::Action, Fault::Rejected)]
        {
            let (sandboxed, sandboxed_state) = case.run(faults.clone()).await;
            let backend = MemoryBackend::new(case.state.clone());
            let report = saga::run(&native, &case.saga, &backend, case.options(faults)).await;
            assert_eq!(report.status, sandboxed.status, "{name}");
            assert_eq!(report.output, sandboxed.output, "{name}");
            assert_eq!(report.compensated, sandboxed.compensated, "{name}");
            assert_eq!(backend.store.snapshot().digest(), sandboxed_state.digest(), "{name}");
        }
    }
}

// ---- Time-outs, parallel branches, scale, retries, compensation of DAGs, resume ----

/// A saga of `n` one-unit allocations from pool `p` (of `capacity`), one after another.
fn chain_of_allocations(n: usize) -> Value {
    let steps: Vec<Value> = (0..n).map(|i| allocate(&format!("s{i}"), 1)).collect();
    json!({ "steps": steps })
}

fn pool_of(capacity: u64) -> State {
    State::from_json(&json!({ "pools": { "p": { "capacity": capacity, "allocated": 0 } } })).unwrap()
}

/// `at_us` of the first event of `kind` for `step`.
fn event_at(report: &RunReport, kind: EventKind, step: &str) -> Option<u64> {
    report.events.iter().find(|e| e.event == kind && e.step.as_deref() == Some(step)).map(|e| e.at_us)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_saga_time_out_stops_a_long_chain_and_no_step_runs_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut definition = chain_of_allocations(3000);
    definition["timeout"] = json!("20ms");
    let saga = temp_saga(dir.path(), "long", definition).await.unwrap();
    let (report, state) = run_temp(&saga, &pool_of(1_000_000)).await;
    assert_eq!(report.status, Status::TimedOut, "{:?}", report.error);
    let completed = report.events.iter().filter(|e| e.event == EventKind::StepCompleted).count();
    assert!(completed < 3000, "every step ran although the saga timed out");
    // A step whose start was recorded after the deadline never ran: its call is refused.
    for event in report.events.iter().filter(|e| e.event == EventKind::StepStarted && e.at_us > 20_000) {
        let step = event.step.as_deref().unwrap();
        assert_eq!(event_at(&report, EventKind::StepCompleted, step), None, "{step} ran after the deadline");
    }
    assert_eq!(report.compensated.len(), completed);
    assert_eq!(state.digest(), pool_of(1_000_000).digest());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_saga_time_out_cuts_a_spinning_guest() {
    let dir = tempfile::tempdir().unwrap();
    let saga = temp_saga(
        dir.path(),
        "spin",
        json!({
            "steps": [
                allocate("a", 10),
                { "id": "spin", "action": { "name": "hostile.spin", "arguments": {} },
                  "timeout": "20s", "limits": { "fuel": 1_000_000_000_000u64 } }
            ],
            "timeout": "300ms"
        }),
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let (report, state) = run_temp(&saga, &pools()).await;
    // Cut at the saga's 300 ms, not at the step's own 20 s.
    assert!(started.elapsed() < std::time::Duration::from_secs(10), "the guest ran past the saga's deadline");
    assert_eq!(report.status, Status::TimedOut, "{:?}", report.error);
    assert_eq!(report.step("spin").unwrap().status, StepStatus::Cancelled);
    assert_eq!(report.compensated, ["a"]);
    assert_eq!(state.digest(), pools().digest());
}

#[tokio::test]
async fn independent_branches_progress_while_one_spins() {
    // One thread: the quick branch can only progress if the spinning guest lets it.
    let dir = tempfile::tempdir().unwrap();
    let step = |id: &str, deps: &[&str]| {
        let mut s = allocate(id, 1);
        s["depends_on"] = json!(deps);
        s
    };
    let saga = temp_saga(
        dir.path(),
        "branches",
        json!({
            "steps": [
                { "id": "spin", "action": { "name": "hostile.spin", "arguments": {} }, "depends_on": [],
                  "timeout": "1s", "limits": { "fuel": 1_000_000_000_000u64 } },
                step("b1", &[]), step("b2", &["b1"]), step("b3", &["b2"])
            ]
        }),
    )
    .await
    .unwrap();
    let backend = MemoryBackend::new(pools());
    let mut options = RunOptions::new("branches", json!({}));
    options.max_concurrency = 4;
    let report = saga::run(shared_runtime().await, &saga, &backend, options).await;
    assert_eq!(report.status, Status::Failed, "{:?}", report.error);
    assert_eq!(report.failed_step.as_deref(), Some("spin"));
    let b3_done = event_at(&report, EventKind::StepCompleted, "b3").expect("b3 completed");
    let spin_failed = event_at(&report, EventKind::StepFailed, "spin").expect("spin failed");
    assert!(b3_done < spin_failed, "the quick branch waited for the spinning one ({b3_done} >= {spin_failed} µs)");
    assert_eq!(report.compensated, ["b3", "b2", "b1"]);
    assert_eq!(backend.store.snapshot().digest(), pools().digest());
}

#[tokio::test(flavor = "multi_thread")]
async fn ten_thousand_steps_validate_run_and_roll_back() {
    let dir = tempfile::tempdir().unwrap();
    // The pool holds 9,999 units: the last step is refused and 9,999 are undone.
    let saga = temp_saga(dir.path(), "huge", chain_of_allocations(10_000)).await.unwrap();
    let backend = MemoryBackend::new(pool_of(9_999));
    let mut options = RunOptions::new("huge", json!({}));
    options.deterministic = true;
    let report = saga::run(shared_runtime().await, &saga, &backend, options).await;
    assert_eq!(report.status, Status::Failed, "{:?}", report.error);
    assert_eq!(report.failed_step.as_deref(), Some("s9999"));
    let expected: Vec<String> = (0..9_999).rev().map(|i| format!("s{i}")).collect();
    assert_eq!(report.compensated, expected);
    assert_eq!(backend.store.snapshot().digest(), pool_of(9_999).digest());
}

#[tokio::test(flavor = "multi_thread")]
async fn retry_jitter_differs_between_runs_of_one_saga() {
    let dir = tempfile::tempdir().unwrap();
    let mut step = allocate("a", 1);
    step["retry"] = json!({ "max_attempts": 4, "backoff": "10s", "jitter": 1.0 });
    let saga = temp_saga(dir.path(), "jitter", json!({ "steps": [step] })).await.unwrap();
    let delays = |run_id: &'static str| {
        let saga = saga.clone();
        async move {
            let backend = MemoryBackend::new(pools());
            let mut options = RunOptions::new(run_id, json!({}));
            options.deterministic = true;
            options.faults = FaultPlan::none().with("a", Phase::Action, Fault::Transient { failures: 3 });
            let report = saga::run(shared_runtime().await, &saga, &backend, options).await;
            assert_eq!(report.status, Status::Completed);
            let delays: Vec<u64> = report
                .events
                .iter()
                .filter(|e| e.event == EventKind::StepRetried)
                .map(|e| e.data.as_ref().unwrap()["delay_ms"].as_u64().unwrap())
                .collect();
            assert_eq!(delays.len(), 3);
            delays
        }
    };
    assert_eq!(delays("run-a").await, delays("run-a").await, "the same run backs off the same way");
    assert_ne!(delays("run-a").await, delays("run-b").await, "two runs backed off in lockstep");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_step_timeout_over_a_day_is_refused_when_validating() {
    let dir = tempfile::tempdir().unwrap();
    let mut step = allocate("a", 1);
    step["timeout"] = json!("25h");
    let error = temp_saga(dir.path(), "day", json!({ "steps": [step] })).await.unwrap_err();
    assert!(error.contains("step 'a'") && error.contains("timeout"), "{error}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_compensation_leaves_the_steps_it_depends_on_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let step = |id: &str, amount: u64, deps: &[&str]| {
        let mut s = allocate(id, amount);
        s["depends_on"] = json!(deps);
        s
    };
    // parent <- child; other is independent; last needs both and is refused.
    let saga = temp_saga(
        dir.path(),
        "stuck",
        json!({ "steps": [
            step("parent", 5, &[]), step("child", 3, &["parent"]), step("other", 1, &[]),
            step("last", 1, &["child", "other"])
        ] }),
    )
    .await
    .unwrap();
    let backend = MemoryBackend::new(pools());
    let mut options = RunOptions::new("stuck", json!({}));
    options.deterministic = true;
    options.faults = FaultPlan::none().with("last", Phase::Action, Fault::Rejected).with(
        "child",
        Phase::Compensation,
        Fault::Permanent,
    );
    let report = saga::run(shared_runtime().await, &saga, &backend, options).await;
    assert_eq!(report.status, Status::CompensationFailed);
    assert_eq!(report.compensated, ["other"]);
    assert_eq!(report.step("child").unwrap().status, StepStatus::CompensationFailed);
    // Undoing the parent under a child that is still in place could break it: it stays.
    assert_eq!(report.step("parent").unwrap().status, StepStatus::Completed);
    assert_eq!(report.step("parent").unwrap().compensation_attempts, 0);
    let pool = report.residue.iter().find(|c| c.namespace == "pools").expect("the pool is residue");
    assert_eq!(pool.after.as_ref().unwrap().parse().unwrap()["allocated"], 8);
}

/// A backend that dies after `commits` commits: later commits and records fail, as if the
/// process were gone. What it committed (state, result cache and journal) is what a
/// resumed run finds.
struct Dying<'a> {
    inner: &'a MemoryBackend,
    commits: std::sync::atomic::AtomicI64,
    journal: std::sync::Mutex<Vec<sagabox::saga::journal::Event>>,
}

impl<'a> Dying<'a> {
    fn new(inner: &'a MemoryBackend, commits: i64) -> Dying<'a> {
        Dying { inner, commits: commits.into(), journal: Default::default() }
    }

    fn alive(&self) -> bool {
        self.commits.load(std::sync::atomic::Ordering::SeqCst) > 0
    }

    fn journal(&self) -> Vec<sagabox::saga::journal::Event> {
        self.journal.lock().unwrap().clone()
    }
}

impl Backend for Dying<'_> {
    fn snapshot(&self) -> State {
        self.inner.snapshot()
    }

    fn commit(
        &self,
        txn: &sagabox::store::Txn,
        result: Option<(&str, &Value)>,
        events: &[sagabox::saga::journal::Event],
    ) -> Result<Vec<sagabox::store::Change>, CommitError> {
        if self.commits.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) <= 0 {
            return Err(CommitError::Backend("the process is gone".into()));
        }
        let changes = self.inner.commit(txn, result, events)?;
        self.journal.lock().unwrap().extend_from_slice(events);
        Ok(changes)
    }

    fn record(&self, events: &[sagabox::saga::journal::Event]) -> Result<(), CommitError> {
        if !self.alive() {
            return Err(CommitError::Backend("the process is gone".into()));
        }
        self.journal.lock().unwrap().extend_from_slice(events);
        Ok(())
    }

    fn cached(&self, key: &str) -> Option<Value> {
        self.inner.cached(key)
    }

    fn register_run(&self, run: &RunRecord) -> Result<(), RegisterError> {
        self.inner.register_run(run)
    }

    fn adopt_run(&self, run_id: &str, seen: &RunRecord, lease_until_ms: u64) -> Result<bool, DbError> {
        self.inner.adopt_run(run_id, seen, lease_until_ms)
    }

    fn claim_runs(
        &self,
        now_ms: u64,
        lease_until_ms: u64,
        limit: usize,
        held: &[String],
    ) -> Result<Vec<RunRecord>, DbError> {
        self.inner.claim_runs(now_ms, lease_until_ms, limit, held)
    }

    fn renew_leases(&self, lease_until_ms: u64) -> Result<u64, DbError> {
        self.inner.renew_leases(lease_until_ms)
    }

    fn name(&self) -> String {
        self.inner.name()
    }

    fn current_state(&self) -> Result<State, DbError> {
        self.inner.current_state()
    }

    fn seed_if_new(&self, state: &State) -> Result<bool, DbError> {
        self.inner.seed_if_new(state)
    }

    fn runs(&self) -> Result<Vec<RunRecord>, DbError> {
        self.inner.runs()
    }

    fn unfinished_runs(&self) -> Result<Vec<RunRecord>, DbError> {
        self.inner.unfinished_runs()
    }

    fn events(&self, run_id: &str) -> Result<Vec<sagabox::saga::journal::Event>, DbError> {
        self.inner.events(run_id)
    }

    fn journal_bytes(&self, run_id: &str) -> Result<u64, DbError> {
        self.inner.journal_bytes(run_id)
    }
}

/// Runs `options` on a backend that dies after `commits` commits, then resumes the run from
/// what its journal kept (with `between` run on the store in the meantime).
async fn die_and_resume(
    saga: &Saga,
    backend: &MemoryBackend,
    options: RunOptions,
    commits: i64,
    between: impl AsyncFnOnce(),
) -> RunReport {
    let dying = Dying::new(backend, commits);
    saga::run(shared_runtime().await, saga, &dying, options.clone()).await;
    between().await;
    let mut resumed = options;
    resumed.resume = dying.journal();
    saga::run(shared_runtime().await, saga, backend, resumed).await
}

/// The bundled plugins and `slow_pool` (the resources tools after sleeping `delay_ms`).
async fn runtime_with_slow_pool(dir: &Path) -> Runtime {
    runtime_with(&[&install_slow_pool(dir)]).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_reply_is_compensated_after_a_resume_wherever_the_run_died() {
    // `quick`'s reply is lost while `slow` still runs; `slow` completes after it, so it is
    // compensated first. A run that dies after undoing `slow` must still undo `quick`.
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime_with_slow_pool(dir.path()).await;
    let path = dir.path().join("lost.json");
    let saga = json!({ "saga": { "steps": [
        { "id": "slow", "depends_on": [], "action": { "name": "slow_pool.allocate",
          "arguments": { "pool_id": "p", "amount": 2, "delay_ms": 300 } } },
        { "id": "quick", "depends_on": [], "action": { "name": "resources.allocate",
          "arguments": { "pool_id": "p", "amount": 1 } } }
    ] } });
    std::fs::write(&path, saga.to_string()).unwrap();
    let saga = Saga::load(&path, &runtime).unwrap();
    let ours = |state: &State| state.digest_excluding(&["executions".to_string()]);
    for k in 0..=4 {
        let backend = MemoryBackend::new(pools());
        let mut options = RunOptions::new("lost", json!({}));
        options.max_concurrency = 2;
        options.faults = FaultPlan::none().with("quick", Phase::Action, Fault::LostResponse);
        let dying = Dying::new(&backend, k);
        saga::run(&runtime, &saga, &dying, options.clone()).await;
        options.resume = dying.journal();
        let report = saga::run(&runtime, &saga, &backend, options).await;
        assert_eq!(report.status, Status::Failed, "died after {k} commits: {:?}", report.error);
        assert_eq!(ours(&backend.store.snapshot()), ours(&pools()), "died after {k} commits: {:?}", report.changes);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn residue_counts_every_life_of_a_run_and_none_of_another_runs_writes() {
    let dir = tempfile::tempdir().unwrap();
    let saga =
        temp_saga(dir.path(), "residue", json!({ "steps": [allocate("a1", 5), allocate("a2", 3), allocate("a3", 1)] }))
            .await
            .unwrap();
    let other = temp_saga(dir.path(), "other", json!({ "steps": [allocate("b", 2)] })).await.unwrap();
    let backend = MemoryBackend::new(pools());
    let mut options = RunOptions::new("residue", json!({}));
    options.deterministic = true;
    options.faults =
        FaultPlan::none().with("a3", Phase::Action, Fault::Rejected).with("a2", Phase::Compensation, Fault::Permanent);
    // Dies after a1; another run allocates 2 from the same pool; the run resumes.
    let between = async || {
        let report = saga::run(shared_runtime().await, &other, &backend, RunOptions::new("other", json!({}))).await;
        assert_eq!(report.status, Status::Completed);
    };
    let report = die_and_resume(&saga, &backend, options, 1, between).await;
    assert_eq!(report.status, Status::CompensationFailed, "{:?}", report.error);
    let pool = report.residue.iter().find(|c| c.namespace == "pools").expect("the pool is residue");
    // This run took 5 + 3 of the 10 allocated now; the other run's 2 are not its residue.
    assert_eq!(pool.before.as_ref().unwrap().parse().unwrap()["allocated"], 2, "{pool:?}");
    assert_eq!(pool.after.as_ref().unwrap().parse().unwrap()["allocated"], 10, "{pool:?}");
    let allocations = report.residue.iter().filter(|c| c.namespace == "allocations").count();
    assert_eq!(allocations, 2, "a1's and a2's allocations, not b's: {:?}", report.residue);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_resumed_run_suffers_the_faults_it_was_started_with() {
    let dir = tempfile::tempdir().unwrap();
    let saga =
        temp_saga(dir.path(), "faulted", json!({ "steps": [allocate("a1", 5), allocate("a2", 3)] })).await.unwrap();
    let backend = MemoryBackend::new(pools());
    let mut options = RunOptions::new("faulted", json!({}));
    options.deterministic = true;
    options.faults = FaultPlan::none().with("a2", Phase::Action, Fault::Rejected);
    let dying = Dying::new(&backend, 1);
    saga::run(shared_runtime().await, &saga, &dying, options.clone()).await;
    // A resume (as `sagabox resume` makes it) knows nothing of the faults but the journal.
    let mut resumed = RunOptions::new("faulted", json!({}));
    resumed.deterministic = true;
    resumed.resume = dying.journal();
    let report = saga::run(shared_runtime().await, &saga, &backend, resumed).await;
    assert_eq!(report.status, Status::Failed, "{:?}", report.error);
    assert_eq!(report.failed_step.as_deref(), Some("a2"));
    assert_eq!(backend.store.snapshot().digest(), pools().digest());
}

#[test]
fn a_durable_run_is_cut_at_the_saga_time_out_too() {
    let dir = tempfile::tempdir().unwrap();
    let mut definition = chain_of_allocations(3000);
    definition["timeout"] = json!("20ms");
    let saga = dir.path().join("long.json");
    std::fs::write(&saga, json!({ "saga": definition }).to_string()).unwrap();
    std::fs::write(dir.path().join("long.fixture.json"), pool_of(1_000_000).to_json().to_string()).unwrap();
    let db = dir.path().join("runs.db");
    let out = sagabox(&["run", saga.to_str().unwrap(), "--db", db.to_str().unwrap(), "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["status"], "timed_out", "{}", report["error"]);
    let out = sagabox(&["state", "--db", db.to_str().unwrap(), "--digest"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), pool_of(1_000_000).digest());
}

/// A claim whose answer was lost (its connection broke after it committed) leaves a run that
/// this process holds and nothing here runs: `RunRecord::starting` is such a run (this
/// process's, running, its lease live). The worker's heartbeat keeps renewing its lease, so
/// no other worker takes it. The worker's next claim must take it back and finish it; a
/// worker with `until_done` waited for it for ever.
#[tokio::test(flavor = "multi_thread")]
async fn a_worker_finishes_a_run_its_process_holds_without_running_it() {
    use sagabox::durable::worker::{self, Finished, WorkerOptions};
    let name = "ct1-payment-failure";
    let case = case(name).await;
    let path = sagas_dir().join(format!("{name}.json"));
    let definition = std::fs::read_to_string(&path).unwrap();
    let backend = Arc::new(MemoryBackend::new(case.state.clone()));
    let lost = RunRecord::starting("lost-claim", name, &path.to_string_lossy(), definition.clone(), &case.input, 7);
    backend.register_run(&lost).unwrap();
    // And a queued run beside it, which a claim takes as usual.
    let queued = RunRecord::starting("queued", name, &path.to_string_lossy(), definition, &case.input, 8).queued();
    backend.register_run(&queued).unwrap();

    let options = WorkerOptions { until_done: true, lease: std::time::Duration::from_secs(2), ..Default::default() };
    let mut finished = Vec::new();
    let work = worker::work(
        Arc::new(runtime().await),
        Arc::clone(&backend) as Arc<dyn Backend>,
        &options,
        tokio_util::sync::CancellationToken::new(),
        |run, outcome| {
            let status = match outcome {
                Finished::Ran { report, .. } => report.status.as_str().to_string(),
                Finished::Failed(e) => format!("not finished: {e}"),
            };
            finished.push((run.run_id.clone(), status));
        },
    );
    let tally = tokio::time::timeout(std::time::Duration::from_secs(120), work)
        .await
        .expect("the worker never finished the run its process held without running it")
        .unwrap();
    finished.sort();
    // CT1's payment is declined: both runs roll back, the store as it was.
    let rolled_back = |id: &str| (id.to_string(), "failed".to_string());
    assert_eq!(finished, [rolled_back("lost-claim"), rolled_back("queued")], "{tally:?}");
    assert!(backend.unfinished_runs().unwrap().is_empty());
    assert!(case.restored(&backend.store.snapshot()));
}
