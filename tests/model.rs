//! The saga engine against a reference model, property-based: random DAGs of up to 12 steps
//! over the `counter` test plugin (`guest-tools/fixtures/counter`), random fault schedules
//! (every [`Fault`] kind, on actions and on compensators), random retry budgets, and both the
//! deterministic mode and the concurrent one (`max_concurrency` 1 to 4).
//!
//! The model predicts, from the saga and its faults alone (and, in concurrent runs, from the
//! order in which the journal says forward steps completed): the final status; which steps
//! are compensated, which compensations fail, which are skipped (a step whose compensation
//! failed keeps its ancestors' effects: they are not compensated afterwards, steno-style;
//! independent branches still are); every counter's final value (the initial one plus the
//! residue of the steps whose effect stayed); how many attempts each call took; that every
//! effect applied once (repeats replay); and the order constraints of the journal.
//!
//! `SAGABOX_MODEL_CASES=N` (or `PROPTEST_CASES=N`) sets the number of cases; see FUZZING.md
//! for the long command.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{LazyLock, OnceLock};

use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError};
use sagabox::backend::MemoryBackend;
use sagabox::runtime::{Runtime, RuntimeOptions};
use sagabox::saga::journal::{Event, EventKind};
use sagabox::saga::{self, Fault, FaultPlan, Phase, RunOptions, RunReport, Saga, Status, StepStatus};
use sagabox::store::State;
use serde_json::{Value, json};
use support::*;

/// Counters the steps act on.
const COUNTERS: usize = 4;
/// The forward-fault densities a case draws from.
const RATES: [f64; 4] = [0.0, 0.04, 0.12, 0.3];
/// The saga time-out of the timed-out scenario (its wait step never finishes).
const SAGA_TIMEOUT_MS: u64 = 300;

// ---------------------------------------------------------------------------------------
// The generated sagas
// ---------------------------------------------------------------------------------------

/// How an `add` step is undone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Undo {
    /// The manifest's compensator (`counter.sub`), no arguments of its own.
    Manifest,
    /// An explicit `compensate` whose `op_id` is bound from the step's own output (which an
    /// uncertain step does not have: the engine then passes only the forward envelope).
    Explicit,
    /// `"no_compensation": true`: the effect stays when the saga fails.
    Keep,
}

#[derive(Clone, Debug)]
struct StepSpec {
    /// `counter.read` (no side effects, no compensator) instead of `counter.add`.
    read: bool,
    counter: usize,
    by: i64,
    undo: Undo,
    /// The counter's name comes from `$.input` instead of the static arguments.
    bound: bool,
    /// Indices of earlier steps.
    deps: Vec<usize>,
    action: Option<Fault>,
    compensation: Option<Fault>,
    max_attempts: u32,
    /// In the timed-out scenario's DAGs, for a step after the wait step: it depends on it.
    on_wait: bool,
}

impl StepSpec {
    fn compensable(&self) -> bool {
        !self.read && self.undo != Undo::Keep
    }
}

#[derive(Clone, Debug)]
struct SagaSpec {
    steps: Vec<StepSpec>,
    /// `depends_on` everywhere; otherwise the steps run in file order (deps = previous step).
    dag: bool,
    compensation_attempts: u32,
    initial: Vec<i64>,
    deterministic: bool,
    max_concurrency: usize,
    seed: u64,
    /// The timed-out scenario: a `hostile.sleep` step inserted before the step of this index
    /// (or last), with these dependencies, under a saga time-out. In file order, the step
    /// after it waits for it; in a DAG, the later steps with `on_wait` do.
    wait: Option<(usize, Vec<usize>)>,
    /// The saga's time-out when it has a wait step.
    timeout_ms: u64,
}

fn fault(max_transient: u32) -> impl Strategy<Value = Fault> {
    prop_oneof![
        1 => Just(Fault::Rejected),
        1 => Just(Fault::Trap),
        1 => Just(Fault::Fuel),
        1 => Just(Fault::Timeout),
        1 => Just(Fault::LostResponse),
        2 => (1..=max_transient).prop_map(|failures| Fault::Transient { failures }),
        1 => Just(Fault::Permanent),
        2 => Just(Fault::Repeat),
    ]
}

/// A fault that lets the action complete (the timed-out scenario wants no forward failure).
fn benign_fault() -> impl Strategy<Value = Fault> {
    prop_oneof![Just(Fault::Repeat), (1u32..=3).prop_map(|failures| Fault::Transient { failures })]
}

/// `Some` fault with probability `rate`.
fn maybe(rate: f64, fault: BoxedStrategy<Fault>) -> BoxedStrategy<Option<Fault>> {
    if rate > 0.0 { prop::option::weighted(rate, fault).boxed() } else { Just(None).boxed() }
}

fn step_spec(action_rate: f64, compensation_rate: f64, benign: bool) -> impl Strategy<Value = StepSpec> {
    let action = if benign { benign_fault().boxed() } else { fault(4).boxed() };
    let undo = prop_oneof![6 => Just(Undo::Manifest), 3 => Just(Undo::Explicit), 1 => Just(Undo::Keep)];
    (
        (prop::bool::weighted(0.2), 0..COUNTERS, 1i64..=50, undo, any::<bool>()),
        (any::<u16>(), any::<u16>()),
        maybe(action_rate, action),
        maybe(compensation_rate, fault(6).boxed()),
        1u32..=4,
        prop::bool::weighted(0.3),
    )
        .prop_map(
            move |((read, counter, by, undo, bound), (m1, m2), action, compensation, max_attempts, on_wait)| {
                let action = match (benign, action) {
                    // Transient failures must stay below the attempts to be benign.
                    (true, Some(Fault::Transient { failures })) if failures >= max_attempts => None,
                    (_, action) => action,
                };
                StepSpec {
                    read,
                    counter,
                    by,
                    undo,
                    bound,
                    // Fixed up to earlier steps by `saga_spec`; about a quarter of the bits are set.
                    deps: (0..16).filter(|b| (m1 & m2) >> b & 1 == 1).collect(),
                    action,
                    compensation,
                    max_attempts,
                    on_wait,
                }
            },
        )
}

fn saga_spec(timed_out: bool) -> impl Strategy<Value = SagaSpec> {
    (1usize..=12, 0..RATES.len(), 0..RATES.len(), prop::bool::weighted(0.8))
        .prop_flat_map(move |(n, a, c, dag)| {
            let action_rate = if timed_out { RATES[a].min(0.12) } else { RATES[a] };
            (
                prop::collection::vec(step_spec(action_rate, RATES[c], timed_out), n),
                Just(dag),
                1u32..=5,
                prop::collection::vec(0i64..1000, COUNTERS),
                any::<bool>(),
                1usize..=4,
                any::<u64>(),
                0..=n,
                (any::<u16>(), any::<u16>()),
            )
        })
        .prop_map(
            move |(mut steps, dag, compensation_attempts, initial, deterministic, max_concurrency, seed, w, m)| {
                for (i, step) in steps.iter_mut().enumerate() {
                    step.deps = if dag {
                        step.deps.iter().copied().filter(|&d| d < i).collect()
                    } else {
                        (i.checked_sub(1)).into_iter().collect()
                    };
                }
                let wait = timed_out.then(|| {
                    let deps = if dag {
                        (0..w).filter(|b| (m.0 & m.1) >> b & 1 == 1).collect()
                    } else {
                        w.checked_sub(1).into_iter().collect()
                    };
                    (w, deps)
                });
                SagaSpec {
                    steps,
                    dag,
                    compensation_attempts,
                    initial,
                    deterministic,
                    max_concurrency,
                    seed,
                    wait,
                    timeout_ms: SAGA_TIMEOUT_MS,
                }
            },
        )
}

/// The ids of the steps: `s0`, `s1`, ... and `wait` (the timed-out scenario's sleeper).
fn id(i: usize) -> String {
    format!("s{i}")
}

const WAIT: &str = "wait";

fn retry(max_attempts: u32) -> Value {
    json!({ "max_attempts": max_attempts, "backoff": "1ms", "max_backoff": "2ms" })
}

impl SagaSpec {
    /// The saga as file text.
    fn text(&self) -> String {
        let mut steps: Vec<Value> = Vec::new();
        for (i, s) in self.steps.iter().enumerate() {
            if let Some((w, deps)) = &self.wait
                && *w == i
            {
                steps.push(self.wait_step(deps));
            }
            let name = format!("c{}", s.counter);
            let mut step = json!({ "id": id(i), "retry": retry(s.max_attempts) });
            let mut arguments = if s.read { json!({}) } else { json!({ "by": s.by }) };
            if s.bound {
                step["input"] = json!({ "name": { "path": format!("$.input.names[{}]", s.counter) } });
            } else {
                arguments["name"] = json!(name);
            }
            let tool = if s.read { "counter.read" } else { "counter.add" };
            step["action"] = json!({ "name": tool, "arguments": arguments });
            if !s.read {
                match s.undo {
                    Undo::Manifest => {}
                    Undo::Explicit => {
                        step["compensate"] = json!({ "name": "counter.sub",
                            "arguments": { "op_id": { "path": format!("$.steps.{}.op_id", id(i)) } } })
                    }
                    Undo::Keep => step["no_compensation"] = json!(true),
                }
            }
            if self.dag {
                let mut deps: Vec<String> = s.deps.iter().map(|&d| id(d)).collect();
                if self.waits_on(i) {
                    deps.push(WAIT.into());
                }
                step["depends_on"] = json!(deps);
            }
            steps.push(step);
        }
        if let Some((w, deps)) = &self.wait
            && *w == self.steps.len()
        {
            steps.push(self.wait_step(deps));
        }
        let mut saga = json!({ "steps": steps, "compensation_retry": retry(self.compensation_attempts) });
        if self.wait.is_some() {
            saga["timeout"] = json!(format!("{}ms", self.timeout_ms));
        }
        serde_json::to_string_pretty(&json!({ "saga": saga })).unwrap()
    }

    fn wait_step(&self, deps: &[usize]) -> Value {
        let mut step = json!({ "id": WAIT, "action": { "name": "hostile.sleep", "arguments": { "seconds": 30 } },
                               "limits": { "deadline_ms": 60_000 } });
        if self.dag {
            step["depends_on"] = json!(deps.iter().map(|&d| id(d)).collect::<Vec<_>>());
        }
        step
    }

    fn input(&self) -> Value {
        json!({ "names": (0..COUNTERS).map(|k| format!("c{k}")).collect::<Vec<_>>() })
    }

    fn state(&self) -> State {
        let counters: serde_json::Map<String, Value> =
            self.initial.iter().enumerate().map(|(k, v)| (format!("c{k}"), json!({ "value": v }))).collect();
        State::from_json(&json!({ "counters": counters })).unwrap()
    }

    fn faults(&self) -> FaultPlan {
        let mut plan = FaultPlan::none();
        for (i, s) in self.steps.iter().enumerate() {
            if let Some(f) = s.action {
                plan = plan.with(&id(i), Phase::Action, f);
            }
            if let Some(f) = s.compensation {
                plan = plan.with(&id(i), Phase::Compensation, f);
            }
        }
        plan
    }

    /// Effective concurrency: deterministic runs go one step at a time.
    fn sequential(&self) -> bool {
        self.deterministic || self.max_concurrency == 1
    }

    /// Whether `a` is a (transitive) ancestor of `b`.
    fn ancestor(&self, a: usize, b: usize) -> bool {
        let mut seen = BTreeSet::new();
        let mut stack = self.steps[b].deps.clone();
        while let Some(d) = stack.pop() {
            if d == a {
                return true;
            }
            if seen.insert(d) {
                stack.extend(self.steps[d].deps.iter().copied());
            }
        }
        false
    }

    /// Whether step `i` depends (transitively) on the wait step.
    fn after_wait(&self, i: usize) -> bool {
        let mut stack = vec![i];
        let mut seen = BTreeSet::new();
        while let Some(j) = stack.pop() {
            if !seen.insert(j) {
                continue;
            }
            if self.waits_on(j) {
                return true;
            }
            stack.extend(self.steps[j].deps.iter().copied());
        }
        false
    }

    /// Whether step `j` depends directly on the wait step.
    fn waits_on(&self, j: usize) -> bool {
        match &self.wait {
            None => false,
            Some((w, _)) if self.dag => j >= *w && self.steps[j].on_wait,
            Some((w, _)) => j == *w,
        }
    }
}

// ---------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------

/// What a step's action comes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Forward {
    Completed,
    /// The effect applied, the reply was lost: the step failed, and is compensated.
    Uncertain,
    Failed,
}

/// A forward action's outcome, attempts and error code under `fault`.
fn forward(fault: Option<Fault>, max_attempts: u32) -> (Forward, u32, &'static str) {
    match fault {
        None | Some(Fault::Repeat) => (Forward::Completed, 1, ""),
        Some(Fault::Transient { failures }) if failures < max_attempts => (Forward::Completed, failures + 1, ""),
        Some(Fault::Transient { .. }) | Some(Fault::Permanent) => (Forward::Failed, max_attempts, "transient"),
        Some(Fault::Rejected) => (Forward::Failed, 1, "rejected"),
        Some(Fault::Trap) => (Forward::Failed, 1, "trap"),
        Some(Fault::Fuel) => (Forward::Failed, 1, "out_of_fuel"),
        Some(Fault::Timeout) => (Forward::Failed, 1, "deadline_exceeded"),
        Some(Fault::LostResponse) => (Forward::Uncertain, 1, "lost_response"),
    }
}

/// Whether a compensator under `fault` succeeds, and in how many attempts.
fn compensation(fault: Option<Fault>, max_attempts: u32) -> (bool, u32) {
    match fault {
        None | Some(Fault::Repeat) | Some(Fault::LostResponse) => (true, 1),
        Some(Fault::Transient { failures }) if failures < max_attempts => (true, failures + 1),
        Some(Fault::Transient { .. }) | Some(Fault::Permanent) => (false, max_attempts),
        Some(Fault::Rejected) | Some(Fault::Trap) | Some(Fault::Fuel) | Some(Fault::Timeout) => (false, 1),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Undone {
    Compensated,
    Failed,
    /// Not attempted: a (transitive) dependant's compensation failed, so its effect stays.
    Skipped,
}

/// The compensation of the steps that completed (or are uncertain), `completed` in
/// completion order: each candidate's fate and attempts.
fn compensations(spec: &SagaSpec, completed: &[usize]) -> BTreeMap<usize, (Undone, u32)> {
    let mut out: BTreeMap<usize, (Undone, u32)> = BTreeMap::new();
    // Reverse completion order is a reverse topological order: dependants come first.
    for &i in completed.iter().rev().filter(|&&i| spec.steps[i].compensable()) {
        let blocked = out.iter().any(|(&j, (fate, _))| *fate != Undone::Compensated && spec.ancestor(i, j));
        let fate = if blocked {
            (Undone::Skipped, 0)
        } else {
            match compensation(spec.steps[i].compensation, spec.compensation_attempts) {
                (true, n) => (Undone::Compensated, n),
                (false, n) => (Undone::Failed, n),
            }
        };
        out.insert(i, fate);
    }
    out
}

/// The deterministic forward run: steps in plan order until one fails (or, in the timed-out
/// scenario, until the wait step, which never finishes).
fn deterministic_forward(spec: &SagaSpec) -> (Vec<usize>, Option<usize>) {
    let mut completed = Vec::new();
    for (i, s) in spec.steps.iter().enumerate() {
        if spec.wait.as_ref().is_some_and(|(w, _)| *w == i) {
            return (completed, None);
        }
        match forward(s.action, s.max_attempts).0 {
            Forward::Completed => completed.push(i),
            Forward::Uncertain => {
                completed.push(i);
                return (completed, Some(i));
            }
            Forward::Failed => return (completed, Some(i)),
        }
    }
    (completed, None)
}

// ---------------------------------------------------------------------------------------
// Running and checking
// ---------------------------------------------------------------------------------------

static TOKIO: LazyLock<tokio::runtime::Runtime> =
    LazyLock::new(|| tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap());

/// The bundled plugins plus `counter`, loaded once.
fn runtime() -> &'static Runtime {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    static PLUGINS: OnceLock<tempfile::TempDir> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        let dir = PLUGINS.get_or_init(|| tempfile::tempdir().unwrap()).path();
        std::fs::copy(artifact("counter"), dir.join("counter.wasm")).unwrap();
        std::fs::write(dir.join("counter.policy.toml"), "[store]\nwrite = [\"counters\", \"counter_ops\"]\n").unwrap();
        let options = RuntimeOptions { plugin_dirs: vec![dir.to_path_buf()], ..options() };
        TOKIO.block_on(Runtime::load(options)).expect("plugins load")
    })
}

fn cases(default: u32) -> u32 {
    ["SAGABOX_MODEL_CASES", "PROPTEST_CASES"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
        .unwrap_or(default)
}

fn config(cases: u32) -> Config {
    Config {
        cases,
        max_shrink_iters: 2048,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/model.proptest-regressions"
        )))),
        ..Config::default()
    }
}

fn run(spec: &SagaSpec) -> (RunReport, State) {
    let runtime = runtime();
    let saga = Saga::from_text(&spec.text(), Path::new("model.json"), runtime)
        .unwrap_or_else(|e| panic!("the generated saga is invalid: {e}\n{}", spec.text()));
    let backend = MemoryBackend::new(spec.state());
    let mut options = RunOptions::new(format!("model-{}", spec.seed), spec.input());
    options.seed = spec.seed;
    options.faults = spec.faults();
    options.deterministic = spec.deterministic;
    options.max_concurrency = spec.max_concurrency;
    let report = TOKIO.block_on(saga::run(runtime, &saga, &backend, options));
    (report, backend.store.snapshot())
}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

fn ensure_eq<T: PartialEq + std::fmt::Debug>(got: T, want: T, what: &str) -> Result<(), String> {
    ensure!(got == want, "{what}: got {got:?}, the model says {want:?}");
    Ok(())
}

/// The journal, read per step.
struct Journal<'a> {
    events: &'a [Event],
}

impl Journal<'_> {
    fn of<'b>(&'b self, kind: EventKind, step: &'b str) -> impl Iterator<Item = &'b Event> + 'b {
        self.events.iter().filter(move |e| e.event == kind && e.step.as_deref() == Some(step))
    }

    fn first(&self, kind: EventKind, step: &str) -> Option<u64> {
        self.of(kind, step).map(|e| e.seq).next()
    }

    fn count(&self, kind: EventKind, step: &str) -> usize {
        self.of(kind, step).count()
    }

    /// Forward steps in the order they completed (the uncertain ones when they failed).
    fn completion_order(&self, spec: &SagaSpec) -> Vec<usize> {
        let mut out: Vec<usize> = Vec::new();
        for e in self.events.iter().take_while(|e| e.event != EventKind::CompensationTriggered) {
            let Some(i) = e.step.as_deref().and_then(|s| s.strip_prefix('s')).and_then(|s| s.parse().ok()) else {
                continue;
            };
            let done = match e.event {
                EventKind::StepCompleted => true,
                EventKind::StepFailed => e.error.as_ref().is_some_and(|err| err.code == "lost_response"),
                _ => false,
            };
            if done && i < spec.steps.len() && !out.contains(&i) {
                out.push(i);
            }
        }
        out
    }
}

/// Checks one run against the model.
fn check(spec: &SagaSpec, report: &RunReport, state: &State) -> Result<(), String> {
    let journal = Journal { events: &report.events };
    // The forward phase's part of the journal.
    let cut = report.events.iter().position(|e| e.event == EventKind::CompensationTriggered);
    let fwd = Journal { events: &report.events[..cut.unwrap_or(report.events.len())] };
    ensure!(
        report.events.first().map(|e| e.event) == Some(EventKind::SagaStarted)
            && report.events.last().map(|e| e.event) == Some(EventKind::SagaFinished),
        "the journal does not run from saga_started to saga_finished"
    );
    ensure!(report.events.iter().enumerate().all(|(i, e)| e.seq == i as u64), "journal seq numbers have gaps");
    // Once compensation began, the journal records compensations, not forward steps.
    if !tolerated(LOST_COMPENSATION_EVENT) {
        let late = report
            .events
            .iter()
            .skip_while(|e| e.event != EventKind::CompensationTriggered)
            .find(|e| matches!(e.event, EventKind::StepStarted | EventKind::StepCompleted | EventKind::StepFailed));
        ensure!(late.is_none(), "a forward-step event after compensation began: {:?}", late.map(|e| (e.seq, e.event)));
    }

    // Forward: which steps ran, and how each ended.
    let completed = fwd.completion_order(spec);
    let started: BTreeSet<usize> =
        (0..spec.steps.len()).filter(|&i| fwd.first(EventKind::StepStarted, &id(i)).is_some()).collect();
    let mut failed: Vec<usize> = Vec::new();
    for &i in &started {
        let s = &spec.steps[i];
        let (outcome, attempts, code) = forward(s.action, s.max_attempts);
        let sid = id(i);
        for &d in &s.deps {
            let dep_done = fwd.of(EventKind::StepCompleted, &id(d)).map(|e| e.seq).next();
            let first_start = fwd.first(EventKind::StepStarted, &sid);
            ensure!(
                dep_done.is_some_and(|d| Some(d) < first_start),
                "step {sid} started before its dependency {} completed",
                id(d)
            );
        }
        ensure_eq(fwd.count(EventKind::StepStarted, &sid), attempts as usize, &format!("attempts of {sid}"))?;
        ensure_eq(report.step(&sid).map(|r| r.attempts), Some(attempts), &format!("reported attempts of {sid}"))?;
        let failures: Vec<&str> =
            fwd.of(EventKind::StepFailed, &sid).filter_map(|e| e.error.as_ref().map(|e| e.code.as_str())).collect();
        match outcome {
            Forward::Completed => {
                ensure!(failures.is_empty(), "step {sid} should complete, it failed: {failures:?}");
                ensure!(completed.contains(&i), "step {sid} should complete");
            }
            Forward::Uncertain | Forward::Failed => {
                ensure_eq(failures, vec![code], &format!("failure of {sid}"))?;
                ensure_eq(completed.contains(&i), outcome == Forward::Uncertain, &format!("{sid} counted as done"))?;
                failed.push(i);
            }
        }
        // Each effect once: a repeated add is replayed from the cache.
        if s.action == Some(Fault::Repeat) && !s.read {
            let replays: Vec<Option<bool>> = fwd.of(EventKind::StepCompleted, &sid).map(|e| e.replayed).collect();
            ensure_eq(replays, vec![Some(false), Some(true)], &format!("deliveries of repeated {sid}"))?;
        }
    }
    for i in 0..spec.steps.len() {
        if !started.contains(&i) {
            ensure_eq(
                report.step(&id(i)).map(|r| r.status),
                Some(StepStatus::NotRun),
                &format!("status of {}", id(i)),
            )?;
        }
    }

    // The forward phase against the model.
    let timed_out = spec.wait.is_some();
    if spec.sequential() {
        let (want_completed, want_failed) = deterministic_forward(spec);
        ensure_eq(&completed, &want_completed, "forward steps completed, in order")?;
        ensure_eq(report.failed_step.clone(), want_failed.map(id), "failed step")?;
        let want_started: BTreeSet<usize> = want_completed.iter().copied().chain(want_failed).collect();
        ensure_eq(&started, &want_started, "steps started")?;
    } else if failed.is_empty() && !timed_out {
        ensure_eq(completed.len(), spec.steps.len(), "completed steps (nothing failed)")?;
    } else if timed_out {
        // Everything that does not wait on the sleeper completes.
        let want: BTreeSet<usize> = (0..spec.steps.len()).filter(|&i| !spec.after_wait(i)).collect();
        ensure_eq(completed.iter().copied().collect::<BTreeSet<_>>(), want, "steps completed before the time-out")?;
    } else {
        ensure!(
            report.failed_step.as_deref().is_some_and(|f| failed.iter().any(|&i| id(i) == f)),
            "failed step {:?} is not one of the steps that failed {:?}",
            report.failed_step,
            failed
        );
    }
    if timed_out {
        ensure_eq(report.step(WAIT).map(|r| r.status), Some(StepStatus::Cancelled), "status of the wait step")?;
        ensure_eq(report.error.as_ref().map(|e| e.code.as_str()), Some("saga_timeout"), "error")?;
    }

    // Compensation.
    let fates = compensations(spec, &completed);
    let saga_failed = timed_out || !failed.is_empty();
    let fates = if saga_failed { fates } else { BTreeMap::new() };
    let any_failed = fates.values().any(|(f, _)| *f == Undone::Failed);
    let want_status = match (saga_failed, any_failed, timed_out) {
        (false, _, _) => Status::Completed,
        (true, true, _) => Status::CompensationFailed,
        (true, false, true) => Status::TimedOut,
        (true, false, false) => Status::Failed,
    };
    ensure_eq(report.status, want_status, "status")?;
    let fate_of = |i: usize| fates.get(&i).map(|f| f.0);

    let want_compensated: Vec<String> =
        completed.iter().rev().filter(|&&i| fate_of(i) == Some(Undone::Compensated)).map(|&i| id(i)).collect();
    if spec.sequential() {
        ensure_eq(&report.compensated, &want_compensated, "compensations, in order")?;
    } else {
        let mut got = report.compensated.clone();
        got.sort();
        let mut want = want_compensated.clone();
        want.sort();
        ensure_eq(got, want, "compensated steps")?;
    }
    let want_failures: BTreeSet<String> =
        fates.iter().filter(|(_, f)| f.0 == Undone::Failed).map(|(&i, _)| id(i)).collect();
    let got_failures: BTreeSet<String> = report.compensation_failures.iter().map(|f| f.step.clone()).collect();
    ensure_eq(got_failures, want_failures, "failed compensations")?;

    for i in 0..spec.steps.len() {
        let sid = id(i);
        let s = &spec.steps[i];
        let (fate, attempts) = fates.get(&i).copied().map_or((None, 0), |(f, n)| (Some(f), n));
        ensure_eq(
            journal.count(EventKind::CompensationStarted, &sid),
            attempts as usize,
            &format!("{sid} undo attempts"),
        )?;
        ensure_eq(
            report.step(&sid).map(|r| r.compensation_attempts),
            Some(attempts),
            &format!("reported {sid} undo attempts"),
        )?;
        let status = report.step(&sid).map(|r| r.status);
        match fate {
            Some(Undone::Compensated) => {
                ensure_eq(status, Some(StepStatus::Compensated), &format!("status of {sid}"))?;
                let deliveries: Vec<Option<bool>> =
                    journal.of(EventKind::CompensationCompleted, &sid).map(|e| e.replayed).collect();
                let want: Vec<Option<bool>> = match s.compensation {
                    Some(Fault::Repeat) => vec![Some(false), Some(true)],
                    Some(Fault::LostResponse) => vec![],
                    _ => vec![Some(false)],
                };
                ensure_eq(deliveries, want, &format!("undo deliveries of {sid}"))?;
            }
            Some(Undone::Failed) => {
                ensure_eq(status, Some(StepStatus::CompensationFailed), &format!("status of {sid}"))?
            }
            Some(Undone::Skipped) => {
                ensure!(status != Some(StepStatus::Compensated), "{sid} is reported compensated, but was skipped")
            }
            None if started.contains(&i) => {
                let want = match forward(s.action, s.max_attempts).0 {
                    Forward::Completed => StepStatus::Completed,
                    Forward::Uncertain => StepStatus::Uncertain,
                    Forward::Failed => StepStatus::Failed,
                };
                ensure_eq(status, Some(want), &format!("status of {sid}"))?;
            }
            None => {}
        }
    }
    // A step's compensation starts only after every compensation of its dependants ended.
    let ended = |sid: &str| {
        journal
            .of(EventKind::CompensationCompleted, sid)
            .chain(journal.of(EventKind::CompensationFailed, sid))
            .map(|e| e.seq)
            .min()
    };
    for (&a, _) in fates.iter().filter(|(_, f)| f.0 != Undone::Skipped) {
        for (&b, _) in fates.iter().filter(|(_, f)| f.0 != Undone::Skipped) {
            if spec.ancestor(a, b) {
                let start = journal.first(EventKind::CompensationStarted, &id(a));
                let end =
                    ended(&id(b)).or_else(|| journal.of(EventKind::CompensationStarted, &id(b)).last().map(|e| e.seq));
                ensure!(
                    end.is_some() && start.is_some() && end < start,
                    "{} was compensated before its dependant {} was done",
                    id(a),
                    id(b)
                );
            }
        }
    }

    // The state: every effect that stayed, once.
    let stays = |i: usize| {
        let s = &spec.steps[i];
        !s.read && completed.contains(&i) && (!saga_failed || fate_of(i) != Some(Undone::Compensated))
    };
    let mut want_values = spec.initial.clone();
    for i in (0..spec.steps.len()).filter(|&i| stays(i)) {
        want_values[spec.steps[i].counter] += spec.steps[i].by;
    }
    let json = state.to_json();
    let got_values: Vec<i64> =
        (0..COUNTERS).map(|k| json["counters"][format!("c{k}")]["value"].as_i64().unwrap_or(i64::MIN)).collect();
    ensure_eq(&got_values, &want_values, "counter values")?;
    let mut got_ops: Vec<String> = json
        .get("counter_ops")
        .and_then(Value::as_object)
        .map(|ops| ops.values().map(|op| op["step"].as_str().unwrap_or_default().to_string()).collect())
        .unwrap_or_default();
    got_ops.sort();
    let mut want_ops: Vec<String> = (0..spec.steps.len()).filter(|&i| stays(i)).map(id).collect();
    want_ops.sort();
    ensure_eq(got_ops, want_ops, "operations left in the store")?;

    // Residue: named exactly when a compensation failed.
    let residue: BTreeSet<String> =
        report.residue.iter().filter(|c| c.namespace == "counters").map(|c| c.key.clone()).collect();
    let want_residue: BTreeSet<String> = if want_status == Status::CompensationFailed {
        (0..COUNTERS).filter(|&k| want_values[k] != spec.initial[k]).map(|k| format!("c{k}")).collect()
    } else {
        BTreeSet::new()
    };
    ensure_eq(residue, want_residue, "residue counters")?;
    if want_status == Status::Completed {
        ensure!(report.output.is_none() && report.error.is_none(), "a completed run reports an error");
    } else {
        ensure!(report.error.is_some(), "a run that did not complete reports no error");
    }
    Ok(())
}

/// Known engine bugs a long run may be told to look past (`SAGABOX_MODEL_TOLERATE=a,b`), to
/// hunt for others while they are open. See FUZZING.md.
const LOST_COMPENSATION_EVENT: &str = "lost_compensation_event";
const TIMEOUT_RACE: &str = "timeout_race";

fn tolerated(bug: &str) -> bool {
    std::env::var("SAGABOX_MODEL_TOLERATE").is_ok_and(|v| v.split(',').any(|b| b.trim() == bug))
}

fn model_case(spec: &SagaSpec) -> Result<(), TestCaseError> {
    let (report, state) = run(spec);
    let wait_failed = report.step(WAIT).is_some_and(|s| s.status == StepStatus::Failed);
    if wait_failed && tolerated(TIMEOUT_RACE) {
        return Ok(());
    }
    check(spec, &report, &state).map_err(|e| {
        let events: Vec<String> = report
            .events
            .iter()
            .map(|e| {
                let error = e.error.as_ref().map(|x| format!(" {}", x.code)).unwrap_or_default();
                let replayed = e.replayed.map(|r| format!(" replayed={r}")).unwrap_or_default();
                format!("  {} {:?} {}{error}{replayed}", e.seq, e.event, e.step.as_deref().unwrap_or("-"))
            })
            .collect();
        TestCaseError::fail(format!(
            "{e}\nstatus {:?}, compensated {:?}, failures {:?}\njournal:\n{}\nsaga:\n{}",
            report.status,
            report.compensated,
            report.compensation_failures.iter().map(|f| &f.step).collect::<Vec<_>>(),
            events.join("\n"),
            spec.text()
        ))
    })
}

proptest! {
    #![proptest_config(config(cases(5000)))]

    /// Random sagas with random faults end as the model says.
    #[test]
    fn the_engine_agrees_with_the_model(spec in saga_spec(false)) {
        model_case(&spec)?;
    }
}

proptest! {
    #![proptest_config(config((cases(5000) / 100).max(8)))]

    /// A saga cut by its time-out compensates exactly what completed before it.
    #[test]
    fn timed_out_sagas_agree_with_the_model(spec in saga_spec(true)) {
        model_case(&spec)?;
    }
}

// ---------------------------------------------------------------------------------------
// Minimal cases of engine bugs the model found (see FUZZING.md)
// ---------------------------------------------------------------------------------------

fn add(counter: usize, by: i64, deps: Vec<usize>) -> StepSpec {
    StepSpec {
        read: false,
        counter,
        by,
        undo: Undo::Manifest,
        bound: false,
        deps,
        action: None,
        compensation: None,
        max_attempts: 1,
        on_wait: false,
    }
}

fn spec(steps: Vec<StepSpec>, deterministic: bool) -> SagaSpec {
    SagaSpec {
        steps,
        dag: false,
        compensation_attempts: 1,
        initial: vec![0; COUNTERS],
        deterministic,
        max_concurrency: 1,
        seed: 1,
        wait: None,
        timeout_ms: SAGA_TIMEOUT_MS,
    }
}

/// A compensator whose reply is lost committed its undo; the journal must say so with a
/// compensation event, not with a `step_failed` (`lost_response`) of the forward step, which
/// a resumed run reads as the forward step's own lost reply.
#[test]
fn a_lost_compensation_reply_is_journaled_as_a_compensation() {
    let mut steps = vec![add(0, 1, vec![]), add(1, 1, vec![0])];
    steps[0].compensation = Some(Fault::LostResponse);
    steps[1].action = Some(Fault::Rejected);
    model_case(&spec(steps, true)).unwrap();
}

/// A saga whose time-out cuts a running step ends `timed_out`, however close to the
/// deadline the step's own (shortened) deadline fired.
#[test]
fn a_saga_time_out_is_never_reported_as_the_cut_steps_failure() {
    // The race is lost in a few percent of runs: try enough of them.
    for seed in 0..100 {
        let mut case = spec(vec![add(0, 1, vec![])], seed % 2 == 0);
        case.seed = seed;
        case.wait = Some((1, vec![]));
        case.timeout_ms = 20;
        model_case(&case).unwrap_or_else(|e| panic!("run {seed}: {e}"));
    }
}
