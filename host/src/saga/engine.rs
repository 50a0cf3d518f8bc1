//! Runs a saga: forward steps in order or as a DAG, retries, time-outs, idempotency, and on
//! failure the compensation of every completed step in reverse completion order, a step
//! only after every step that depends on it.
//!
//! A step's store writes, its cached result and the journal event recording its completion
//! commit together (see [`Backend::commit`]), right after the call returns: a run either
//! committed a step or left no trace of it.
//!
//! The saga's time-out is a deadline every forward call carries: a guest running when it
//! passes is cut there (its writes are dropped), a backoff wait ends there, and no step
//! starts after it. Compensation then runs without it.
//!
//! Scheduling is linear in the saga's size: steps wait on counters of unfinished
//! dependencies (forward) or uncompensated dependants (backward), never on scans.

use crate::sync::lock;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::stream::{FuturesUnordered, StreamExt};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tracing::Instrument;

use super::Saga;
use super::binding::{self, Scope};
use super::fault::{Fault, FaultPlan, Phase};
use super::journal::{DocWrite, ErrorInfo, Event, EventKind, JournalSink};
use super::plan::{Plan, PlannedStep, merge_args};
use super::report::{CompensationFailure, NetChange, RunReport, Status, StepReport, StepStatus};
use crate::backend::{Backend, BeforeCall, CommitError};
use crate::ids::{cache_key, idempotency_key_of_text};
use crate::json::DocText;
use crate::runtime::{
    CallArgs, CallContext, CallError, CallFailure, CallOptions, CommitAttempt, FailureKind, InjectedFault, Runtime,
};
use crate::store::undo::without_writes;
use crate::store::{State, Txn};

/// How to run a saga.
#[derive(Clone)]
pub struct RunOptions {
    pub run_id: String,
    /// Drives retry jitter (and, when `deterministic`, the plugins' clocks and randomness).
    pub seed: u64,
    /// The saga's input (`$.input`).
    pub input: Value,
    pub faults: FaultPlan,
    /// Reproducible runs: steps run one at a time in plan order, backoff delays are recorded
    /// but not slept, and plugins see clocks and randomness derived from the seed.
    pub deterministic: bool,
    /// Record backoff delays without sleeping them (implied by `deterministic`): for
    /// campaigns, whose verdicts do not depend on how long a retry waited.
    pub virtual_backoff: bool,
    /// Steps (or compensations) in flight at once.
    pub max_concurrency: usize,
    /// Where events go as they happen (a JSON Lines file).
    pub journal: Option<Arc<dyn JournalSink>>,
    /// The journal of an earlier, interrupted life of this run: resume it instead of
    /// starting afresh. Completed steps are not run again; a compensation in progress is
    /// finished; a step that never committed runs (with the same idempotency key).
    pub resume: Vec<Event>,
}

impl RunOptions {
    pub fn new(run_id: impl Into<String>, input: Value) -> RunOptions {
        RunOptions {
            run_id: run_id.into(),
            seed: 0,
            input,
            faults: FaultPlan::none(),
            deterministic: false,
            virtual_backoff: false,
            max_concurrency: 8,
            journal: None,
            resume: Vec::new(),
        }
    }
}

/// Why a step did not complete.
#[derive(Clone, Debug)]
struct StepFailure {
    step: usize,
    error: ErrorInfo,
}

/// A forward step that committed, or may have (`lost`: its reply was lost). Its output, when
/// it has one, is in [`Progress::outputs`].
#[derive(Clone, Debug)]
struct Completed {
    /// Shared with the step's started events: copying a `Completed` copies no tree.
    args: Arc<Value>,
    key: String,
    lost: bool,
}

/// What the run has learned so far.
struct Progress {
    /// Completed (or uncertain) steps in completion order.
    completed: Vec<(usize, Completed)>,
    /// Position in `completed` by idempotency key (a session looks retries up there).
    by_key: HashMap<String, usize>,
    /// Whether each step is in `completed`.
    done: Vec<bool>,
    /// Outputs of the completed steps, by step id: what `$.steps.<id>` bindings read.
    outputs: BTreeMap<String, Arc<Value>>,
    status: BTreeMap<usize, StepStatus>,
    attempts: BTreeMap<(usize, Phase), u32>,
    failure: Option<StepFailure>,
    /// The saga's deadline passed before every step completed.
    timed_out: bool,
    /// A resumed run whose compensation had begun: why it began.
    compensating: Option<ErrorInfo>,
    /// Steps compensated in an earlier life of a resumed run, in order.
    compensated_before: Vec<usize>,
}

impl Progress {
    fn new(steps: usize) -> Progress {
        Progress {
            completed: Vec::new(),
            by_key: HashMap::new(),
            done: vec![false; steps],
            outputs: BTreeMap::new(),
            status: BTreeMap::new(),
            attempts: BTreeMap::new(),
            failure: None,
            timed_out: false,
            compensating: None,
            compensated_before: Vec::new(),
        }
    }

    /// A copy of a completed step's output, for what hands it out or builds on it.
    fn output_copy(&self, id: &str) -> Option<Value> {
        self.outputs.get(id).map(|o| Value::clone(o))
    }

    fn is_done(&self, index: usize) -> bool {
        self.done.get(index).copied().unwrap_or(false)
    }

    /// Records a step that committed (`output: None` when its reply was lost).
    fn complete(&mut self, index: usize, id: &str, completed: Completed, output: Option<Arc<Value>>) {
        if self.is_done(index) {
            return;
        }
        if index >= self.done.len() {
            // A session's step, added after the run began.
            self.done.resize(index + 1, false);
        }
        self.done[index] = true;
        let status = if completed.lost { StepStatus::Uncertain } else { StepStatus::Completed };
        self.status.insert(index, status);
        if let Some(output) = output {
            self.outputs.insert(id.to_string(), output);
        }
        self.by_key.insert(completed.key.clone(), self.completed.len());
        self.completed.push((index, completed));
    }
}

/// The steps a run knows: a saga file's plan, or a session's, which grows as its calls arrive.
pub(super) enum Steps<'a> {
    Planned(&'a Plan),
    /// Appended to while calls run (`boxcar` hands out references that stay valid).
    Arriving(Box<boxcar::Vec<PlannedStep>>),
}

impl Steps<'_> {
    fn get(&self, index: usize) -> &PlannedStep {
        match self {
            Steps::Planned(plan) => &plan.steps[index],
            Steps::Arriving(steps) => &steps[index],
        }
    }

    fn len(&self) -> usize {
        match self {
            Steps::Planned(plan) => plan.steps.len(),
            Steps::Arriving(steps) => steps.count(),
        }
    }

    fn find(&self, id: &str) -> Option<(usize, &PlannedStep)> {
        match self {
            Steps::Planned(plan) => plan.step(id),
            Steps::Arriving(steps) => {
                // A session's `call-N` is usually its N-th step.
                let guess =
                    id.strip_prefix("call-").and_then(|n| n.parse::<usize>().ok()).and_then(|n| n.checked_sub(1));
                match guess.and_then(|i| steps.get(i).map(|s| (i, s))) {
                    Some((i, s)) if s.id == id => Some((i, s)),
                    _ => steps.iter().find(|(_, s)| s.id == id),
                }
            }
        }
    }

    /// The steps that depend on `index` directly (a session's calls depend on none).
    fn dependants(&self, index: usize) -> &[usize] {
        match self {
            Steps::Planned(plan) => plan.dependants(index),
            Steps::Arriving(_) => &[],
        }
    }
}

/// One run in progress.
pub(super) struct Run<'a> {
    runtime: &'a Runtime,
    saga: &'a Saga,
    steps: Steps<'a>,
    backend: &'a dyn Backend,
    options: RunOptions,
    started: Instant,
    /// When the saga's time runs out (`None`: no time-out).
    deadline: Option<Instant>,
    /// Whether calls may be in flight together (a DAG run with concurrency): each then runs
    /// in a task of its own, so branches use every worker.
    parallel: bool,
    events: Mutex<Vec<Event>>,
    progress: Mutex<Progress>,
    /// Set when the backend refused a write because another process took the run over: the
    /// run then stops where it is, starts no call and writes nothing more.
    taken_over: std::sync::OnceLock<ErrorInfo>,
}

/// One call the run makes: a step's action or its compensator.
struct Call<'a> {
    step: &'a PlannedStep,
    phase: Phase,
    tool: &'a str,
    /// With their canonical text, printed once for the key and handed to every attempt.
    args: CallArgs<'a>,
    key: &'a str,
    /// Where its result is cached ([`crate::ids::cache_key`]); none for a call without side
    /// effects, which is simply run again.
    cache_key: Option<&'a str>,
}

/// What one attempt of a call came to.
enum Attempt {
    Delivered {
        output: Value,
    },
    /// The call committed but its reply was lost (an injected fault).
    Lost,
    Failed(ErrorInfo),
    /// The saga's deadline passed before or while it ran; it wrote nothing.
    TimedOut,
}

/// What the cache said of a call about to be delivered.
enum Replay {
    /// An earlier delivery's result, recorded as a replay.
    Delivered(Value),
    /// Run it, on this state if the backend read one with the cache.
    Run(Option<State>),
}

/// Runs `saga` on `backend`. Never panics on plugin or input behaviour: every failure ends
/// in a report.
pub async fn run(runtime: &Runtime, saga: &Saga, backend: &dyn Backend, options: RunOptions) -> RunReport {
    let span = tracing::info_span!("saga", saga = %saga.name, run_id = %options.run_id);
    let mut options = options;
    if let Some(faults) = recorded_faults(&options.resume) {
        // A resumed run suffers the faults it was started with (a campaign's or `--fault`'s).
        options.faults = faults;
    }
    let parallel = saga.plan.has_branches();
    let run = Run::new(runtime, saga, Steps::Planned(&saga.plan), backend, options, parallel);
    run.execute().instrument(span).await
}

impl<'a> Run<'a> {
    /// `branches`: whether calls may overlap (a DAG, or a session's concurrent calls).
    pub(super) fn new(
        runtime: &'a Runtime,
        saga: &'a Saga,
        steps: Steps<'a>,
        backend: &'a dyn Backend,
        options: RunOptions,
        branches: bool,
    ) -> Run<'a> {
        let started = Instant::now();
        let count = steps.len();
        Run {
            runtime,
            saga,
            steps,
            backend,
            deadline: saga.plan.timeout.and_then(|t| started.checked_add(t)),
            parallel: !options.deterministic && options.max_concurrency > 1 && branches,
            events: Mutex::new(options.resume.clone()),
            options,
            started,
            progress: Mutex::new(Progress::new(count)),
            taken_over: std::sync::OnceLock::new(),
        }
    }

    fn step(&self, index: usize) -> &PlannedStep {
        self.steps.get(index)
    }

    /// Adds a step to a session's run; its index (`None` for a saga file's fixed plan).
    pub(super) fn add_step(&self, step: PlannedStep) -> Option<usize> {
        match &self.steps {
            Steps::Arriving(steps) => Some(steps.push(step)),
            Steps::Planned(_) => None,
        }
    }

    pub(super) fn run_id(&self) -> &str {
        &self.options.run_id
    }

    /// The output of a completed step.
    pub(super) fn output_of(&self, id: &str) -> Option<Value> {
        lock(&self.progress).output_copy(id)
    }

    /// The completed step whose effect `key` names, with its output.
    pub(super) fn completed_with_key(&self, key: &str) -> Option<(String, Value)> {
        let progress = lock(&self.progress);
        let (index, _) = &progress.completed[*progress.by_key.get(key)?];
        let index = *index;
        let id = &self.step(index).id;
        Some((id.clone(), progress.output_copy(id).unwrap_or(Value::Null)))
    }

    /// The completed steps in completion order: step, arguments, output, idempotency key.
    pub(super) fn completed_steps(&self) -> Vec<(&PlannedStep, Value, Option<Value>, String)> {
        let progress = lock(&self.progress);
        progress
            .completed
            .iter()
            .map(|(i, c)| {
                let step = self.step(*i);
                (step, Value::clone(&c.args), progress.output_copy(&step.id), c.key.clone())
            })
            .collect()
    }

    /// Takes the failure recorded by the last failed step: a session decides for itself
    /// whether it ends the run.
    pub(super) fn take_failure(&self) -> Option<ErrorInfo> {
        lock(&self.progress).failure.take().map(|f| f.error)
    }

    /// Whether the run's deadline stopped a step.
    pub(super) fn timed_out(&self) -> bool {
        lock(&self.progress).timed_out
    }

    /// The result of an earlier delivery of the call cached under `cache_key`.
    pub(super) fn cached(&self, cache_key: &str) -> Option<Value> {
        self.blocking(|| self.backend.cached(cache_key))
    }

    /// Records a call answered from the cache without becoming a step of this run.
    pub(super) fn record_cached_reply(&self, id: &str, tool: &str, key: &str, output: &Value) {
        let mut event = Event::new(EventKind::StepCompleted).step(id, tool).attempt(1, key);
        event.replayed = Some(true);
        event.duration_us = Some(0);
        self.emit(event.data(output.clone()));
    }

    fn concurrency(&self) -> usize {
        if self.options.deterministic { 1 } else { self.options.max_concurrency.max(1) }
    }

    fn past_deadline(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// Whether the forward phase must start nothing more.
    fn stopping(&self) -> bool {
        let progress = lock(&self.progress);
        progress.failure.is_some() || progress.timed_out || self.taken_over.get().is_some()
    }

    /// Runs `f`, which may block on the backend's storage, off the async workers.
    fn blocking<R>(&self, f: impl FnOnce() -> R) -> R {
        crate::backend::blocking(self.backend, f)
    }

    /// Stamps and records events that come with no state change.
    fn emit(&self, event: Event) {
        if self.taken_over.get().is_some() {
            return;
        }
        let recorded = self.append(vec![event], |events| self.backend.record(events));
        if let Err(e) = recorded {
            tracing::error!("cannot record a journal event: {e}");
        }
    }

    /// Stamps `events`, hands them to `commit` (which stores them with whatever else it
    /// commits), and on success adds them to the run's journal. The journal's lock is held
    /// across the commit so that events are numbered in commit order, without gaps.
    fn append(
        &self,
        mut events: Vec<Event>,
        commit: impl FnOnce(&[Event]) -> Result<(), CommitError>,
    ) -> Result<(), CommitError> {
        self.blocking(|| {
            let mut log = lock(&self.events);
            let at_us = self.started.elapsed().as_micros() as u64;
            for (i, event) in events.iter_mut().enumerate() {
                event.seq = (log.len() + i) as u64;
                event.run_id = self.options.run_id.clone();
                event.at_us = at_us;
            }
            if let Err(e) = commit(&events) {
                if let CommitError::TakenOver { .. } = &e {
                    tracing::warn!("{e}: this process stops the run");
                    let _ = self.taken_over.set(taken_over_error(&e));
                }
                return Err(e);
            }
            if let Some(sink) = &self.options.journal {
                sink.append(&events);
            }
            log.extend(events);
            Ok(())
        })
    }

    /// Commits a call's writes with its events and cached result. The documents it writes
    /// ride on the first event, so the journal holds every effect of the run (its net
    /// changes are computed from there, earlier lives included).
    fn commit(&self, txn: &Txn, result: Option<(&str, &Value)>, mut events: Vec<Event>) -> Result<(), CommitError> {
        let writes: Vec<DocWrite> = txn
            .writes()
            .filter_map(|(ns, key, after)| {
                // What the call saw; exact for every document it read (the commit validates those).
                let before = txn.base().get(ns, key).map(|d| d.text.clone());
                (before.as_deref() != after.map(|a| &**a)).then(|| DocWrite {
                    ns: ns.to_string(),
                    key: key.to_string(),
                    before,
                    after: after.cloned(),
                })
            })
            .collect();
        if let Some(first) = events.first_mut() {
            first.writes = writes;
        }
        self.append(events, |events| self.backend.commit(txn, result, events).map(drop))
    }

    /// A number in [0, 1) fixed by the seed, the run, the step, the phase and the attempt:
    /// runs of one saga do not back off in lockstep.
    fn draw(&self, step: &str, phase: Phase, attempt: u32) -> f64 {
        let mut hasher = Sha256::new();
        hasher.update(self.options.seed.to_le_bytes());
        hasher.update(self.options.run_id.as_bytes());
        hasher.update([0]);
        hasher.update(step.as_bytes());
        hasher.update([phase as u8]);
        hasher.update(attempt.to_le_bytes());
        let bytes: [u8; 8] = hasher.finalize()[..8].try_into().unwrap_or_default();
        (u64::from_le_bytes(bytes) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Rebuilds the progress of an interrupted run from its journal.
    fn restore(&self) {
        for event in &self.options.resume {
            let Some((index, step)) = event.step.as_deref().and_then(|id| self.steps.find(id)) else {
                if event.event == EventKind::CompensationTriggered {
                    lock(&self.progress).compensating = event.error.clone();
                }
                continue;
            };
            match event.event {
                EventKind::StepCompleted => self.restore_completed(index, step, event, false),
                EventKind::StepFailed if event.error.as_ref().is_some_and(|e| e.code == LOST_RESPONSE) => {
                    // The effect committed with this record; only the reply was lost.
                    self.restore_completed(index, step, event, true);
                    let error = event.error.clone().unwrap_or_else(|| lost_response(&step.tool));
                    lock(&self.progress).failure.get_or_insert(StepFailure { step: index, error });
                }
                EventKind::StepFailed => {
                    let error = event.error.clone().unwrap_or_else(|| ErrorInfo {
                        code: "unknown".into(),
                        kind: FailureKind::Contained,
                        message: "failed before the run was interrupted".into(),
                    });
                    let mut progress = lock(&self.progress);
                    progress.status.entry(index).or_insert(StepStatus::Failed);
                    progress.failure.get_or_insert(StepFailure { step: index, error });
                }
                EventKind::CompensationCompleted => {
                    let mut progress = lock(&self.progress);
                    if !progress.compensated_before.contains(&index) {
                        progress.compensated_before.push(index);
                        progress.status.insert(index, StepStatus::Compensated);
                    }
                }
                _ => {}
            }
        }
    }

    fn restore_completed(&self, index: usize, step: &PlannedStep, event: &Event, lost: bool) {
        if lock(&self.progress).is_done(index) {
            return;
        }
        // Arguments are bound again: binding is deterministic given the input and the
        // outputs of the steps completed before.
        let args = Arc::new(self.bind(step).unwrap_or(Value::Null));
        let key = event.idempotency_key.clone().unwrap_or_default();
        let output = if lost { None } else { event.data.clone() };
        let mut progress = lock(&self.progress);
        progress.attempts.insert((index, Phase::Action), event.attempt.unwrap_or(1));
        progress.complete(index, &step.id, Completed { args, key, lost }, output);
    }

    /// Records the run's start, or rebuilds an interrupted run and records its resumption.
    pub(super) fn begin(&self) {
        if self.options.resume.is_empty() {
            // The input cloned, not through `json!`, which would serialize it into a new tree.
            let mut data = serde_json::Map::new();
            data.insert("saga".into(), Value::String(self.saga.name.clone()));
            data.insert("seed".into(), self.options.seed.into());
            data.insert("input".into(), self.options.input.clone());
            data.insert("faults".into(), json!(self.options.faults));
            self.emit(Event::new(EventKind::SagaStarted).data(Value::Object(data)));
            return;
        }
        self.restore();
        let done: Vec<String> = lock(&self.progress).completed.iter().map(|(i, _)| self.step(*i).id.clone()).collect();
        self.emit(Event::new(EventKind::SagaResumed).data(json!({ "completed": done })));
    }

    async fn execute(&self) -> RunReport {
        self.begin();
        // A resumed run that had already failed goes straight to compensation.
        let decided = {
            let progress = lock(&self.progress);
            progress.compensating.is_some() || progress.failure.is_some()
        };
        if !decided {
            self.forward().await;
        }
        let error = {
            let progress = lock(&self.progress);
            progress
                .compensating
                .clone()
                .or_else(|| progress.failure.as_ref().map(|f| f.error.clone()))
                .or_else(|| progress.timed_out.then(|| self.timeout_error()))
        };
        self.finish(error).await
    }

    /// Ends the run: its output when nothing went wrong, else the compensation of every
    /// completed step because of `error`; the final record; the report.
    pub(super) async fn finish(&self, error: Option<ErrorInfo>) -> RunReport {
        let (failure, completed) = {
            let progress = lock(&self.progress);
            (progress.failure.clone(), progress.completed.clone())
        };
        let mut output = None;
        let mut error = error;
        if error.is_none() {
            match self.saga_output() {
                Ok(value) => output = value,
                Err(e) => error = Some(e),
            }
        }

        let mut compensated = Vec::new();
        let mut compensation_failures = Vec::new();
        if let Some(error) = error.as_ref().filter(|_| self.taken_over.get().is_none()) {
            (compensated, compensation_failures) = self.compensate(&completed, error).await;
        }
        let status = if let Some(taken_over) = self.taken_over.get() {
            // Taken over, before or during compensation: the new holder finishes the run.
            error = Some(taken_over.clone());
            Status::TakenOver
        } else {
            match &error {
                None => Status::Completed,
                Some(_) if !compensation_failures.is_empty() => Status::CompensationFailed,
                Some(e) if e.code == SAGA_TIMEOUT => Status::TimedOut,
                Some(_) => Status::Failed,
            }
        };
        let (changes, residue) = self.net_changes(status);
        self.emit(Event::new(EventKind::SagaFinished).data(json!({
            "status": status,
            "compensated": compensated,
            "output": output,
        })));
        let failed_step = failure.map(|f| self.step(f.step).id.clone());
        RunReport {
            run_id: self.options.run_id.clone(),
            saga: self.saga.name.clone(),
            status,
            output,
            failed_step,
            error,
            compensated,
            compensation_failures,
            steps: self.step_reports(),
            changes,
            residue,
            events: std::mem::take(&mut lock(&self.events)),
            duration_us: self.started.elapsed().as_micros() as u64,
        }
    }

    pub(super) fn timeout_error(&self) -> ErrorInfo {
        let limit = self.saga.plan.timeout.unwrap_or_default();
        ErrorInfo {
            code: SAGA_TIMEOUT.into(),
            kind: FailureKind::Contained,
            message: format!("the saga did not finish within {} ms", limit.as_millis()),
        }
    }

    /// Runs forward steps as their dependencies complete, until all completed, one failed
    /// or the deadline passed (steps in flight then finish, and are compensated if they
    /// completed).
    async fn forward(&self) {
        let count = self.steps.len();
        let (mut waiting, mut ready) = {
            let progress = lock(&self.progress);
            let waiting: Vec<usize> =
                (0..count).map(|i| self.step(i).deps.iter().filter(|&&d| !progress.is_done(d)).count()).collect();
            let ready: BTreeSet<usize> = (0..count).filter(|&i| !progress.is_done(i) && waiting[i] == 0).collect();
            (waiting, ready)
        };
        // Boxed: FuturesUnordered keeps a spare task the size of its future type, so an
        // unboxed step (a few KB with the call inside) costs a run twice that, held as long
        // as the run lives (1,000 sessions waiting on calls hold 1,000 of them).
        let mut running = FuturesUnordered::new();
        loop {
            while running.len() < self.concurrency() && !self.stopping() {
                let Some(i) = ready.pop_first() else { break };
                if self.past_deadline() {
                    lock(&self.progress).timed_out = true;
                    break;
                }
                running.push(Box::pin(async move { (i, self.forward_step(i).await) }));
            }
            let Some((i, completed)) = running.next().await else { break };
            if completed {
                for &j in self.steps.dependants(i) {
                    waiting[j] -= 1;
                    if waiting[j] == 0 {
                        ready.insert(j);
                    }
                }
            }
        }
    }

    /// Binds, calls (with retries) and records one forward step; whether it completed.
    pub(super) async fn forward_step(&self, index: usize) -> bool {
        let step = self.step(index);
        let span = tracing::info_span!("step", step = %step.id, tool = %step.tool);
        self.forward_attempts(index, step).instrument(span).await
    }

    async fn forward_attempts(&self, index: usize, step: &PlannedStep) -> bool {
        let args = match self.bind(step) {
            Ok(args) => Arc::new(args),
            Err(message) => {
                lock(&self.progress).attempts.insert((index, Phase::Action), 0);
                self.fail(index, ErrorInfo { code: "binding".into(), kind: FailureKind::InvalidInput, message });
                return false;
            }
        };
        let canonical = crate::json::canonical(&args);
        let key = match step.key.fixed() {
            Some(key) => key.to_string(),
            None => idempotency_key_of_text(&self.options.run_id, &step.id, &step.tool, &canonical),
        };
        let cache_key = step.side_effects.then(|| cache_key(&self.options.run_id, &key, step.key.is_client_named()));
        let call = Call {
            step,
            phase: Phase::Action,
            tool: &step.tool,
            args: CallArgs::with_canonical(&args, &canonical),
            key: &key,
            cache_key: cache_key.as_deref(),
        };
        let fault = self.options.faults.get(&step.id, Phase::Action);
        let mut attempt = 0;
        loop {
            attempt += 1;
            lock(&self.progress).attempts.insert((index, Phase::Action), attempt);
            let mut started = Event::new(EventKind::StepStarted).step(&step.id, &step.tool).attempt(attempt, &key);
            started.compensator = step.compensator.as_ref().map(|c| c.tool.clone());
            self.emit(started.data(args.clone()));
            let outcome = self.attempt(&call, attempt, fault).await;
            match outcome {
                Attempt::Delivered { output } => {
                    let completed = Completed { args: args.clone(), key: key.clone(), lost: false };
                    lock(&self.progress).complete(index, &step.id, completed, Some(Arc::new(output)));
                    if fault == Some(Fault::Repeat) {
                        // A second delivery of the same call must not apply it again.
                        self.attempt(&call, attempt, None).await;
                    }
                    return true;
                }
                Attempt::Lost => {
                    // Its effect committed with a `lost_response` failure record: compensate it.
                    let mut progress = lock(&self.progress);
                    progress.complete(index, &step.id, Completed { args, key, lost: true }, None);
                    let error = lost_response(&step.tool);
                    progress.failure.get_or_insert(StepFailure { step: index, error });
                    return false;
                }
                Attempt::TimedOut => {
                    self.cancel(index);
                    return false;
                }
                Attempt::Failed(error) => {
                    if error.kind == FailureKind::Transient && attempt < step.retry.max_attempts {
                        if self.backoff(&call, attempt, &error).await {
                            continue;
                        }
                        self.cancel(index);
                        return false;
                    }
                    self.fail(index, error);
                    return false;
                }
            }
        }
    }

    /// Records a forward step's failure.
    fn fail(&self, index: usize, error: ErrorInfo) {
        let step = self.step(index);
        {
            let mut progress = lock(&self.progress);
            progress.status.insert(index, StepStatus::Failed);
            progress.failure.get_or_insert(StepFailure { step: index, error: error.clone() });
        }
        self.emit(Event::new(EventKind::StepFailed).step(&step.id, &step.tool).error(error));
    }

    /// Records a forward step the saga's deadline stopped; it wrote nothing.
    fn cancel(&self, index: usize) {
        let mut progress = lock(&self.progress);
        progress.status.insert(index, StepStatus::Cancelled);
        progress.timed_out = true;
    }

    /// Waits before the next attempt (in deterministic runs, only records the delay).
    /// `false` when the saga's deadline cut the wait short.
    async fn backoff(&self, call: &Call<'_>, attempt: u32, error: &ErrorInfo) -> bool {
        let step = call.step;
        let (policy, kind) = match call.phase {
            Phase::Action => (&step.retry, EventKind::StepRetried),
            Phase::Compensation => (&self.saga.plan.compensation_retry, EventKind::CompensationRetried),
        };
        let delay = policy.delay(attempt, self.draw(&step.id, call.phase, attempt));
        self.emit(
            Event::new(kind)
                .step(&step.id, call.tool)
                .error(error.clone())
                .data(json!({ "attempt": attempt, "delay_ms": delay.as_millis() as u64 })),
        );
        if self.options.deterministic || self.options.virtual_backoff {
            return true;
        }
        match self.deadline.filter(|_| call.phase == Phase::Action) {
            Some(deadline) if Instant::now() + delay >= deadline => {
                tokio::time::sleep_until(deadline.into()).await;
                false
            }
            _ => {
                tokio::time::sleep(delay).await;
                true
            }
        }
    }

    /// The arguments of a forward step: its input bindings resolved and merged over its
    /// resolved action arguments.
    fn bind(&self, step: &PlannedStep) -> Result<Value, String> {
        let progress = lock(&self.progress);
        let scope = Scope { input: &self.options.input, steps: &progress.outputs };
        let arguments = binding::resolve(&step.arguments, &scope).map_err(|e| e.to_string())?;
        let input = step.input.as_ref().map(|i| binding::resolve(i, &scope)).transpose().map_err(|e| e.to_string())?;
        merge_args(arguments, input)
    }

    /// One delivery of a call: a synthesized failure if the fault says so, a replay if the
    /// result is cached, else a real sandboxed call, committed.
    async fn attempt(&self, call: &Call<'_>, attempt: u32, fault: Option<Fault>) -> Attempt {
        if let Some(failure) = synthesized_failure(call, attempt, fault) {
            return failure;
        }
        let fresh = match self.replay(call, attempt) {
            Replay::Delivered(output) => return Attempt::Delivered { output },
            Replay::Run(fresh) => fresh,
        };
        if call.phase == Phase::Action && self.past_deadline() {
            return Attempt::TimedOut;
        }
        let options = self.call_options(call, attempt, fault);
        self.invoke_and_commit(call, attempt, &options, fault == Some(Fault::LostResponse), fresh).await
    }

    /// The event that records a delivery of `call`.
    fn delivered_event(&self, call: &Call<'_>, attempt: u32) -> Event {
        let kind = match call.phase {
            Phase::Action => EventKind::StepCompleted,
            Phase::Compensation => EventKind::CompensationCompleted,
        };
        Event::new(kind).step(&call.step.id, call.tool).attempt(attempt, call.key)
    }

    /// The cached result of a call that already took effect, recorded as a replay; else the
    /// state to run it on, when the backend read it with the cache.
    fn replay(&self, call: &Call<'_>, attempt: u32) -> Replay {
        let Some(cache_key) = call.cache_key else { return Replay::Run(None) };
        match self.blocking(|| self.backend.cached_or_snapshot(cache_key)) {
            BeforeCall::Cached(output) => {
                self.record_replay(call, attempt, &output);
                Replay::Delivered(output)
            }
            BeforeCall::Fresh(state) => Replay::Run(Some(state)),
        }
    }

    fn record_replay(&self, call: &Call<'_>, attempt: u32, output: &Value) {
        let mut event = self.delivered_event(call, attempt);
        event.replayed = Some(true);
        event.duration_us = Some(0);
        self.emit(event.data(output.clone()));
    }

    fn call_options(&self, call: &Call<'_>, attempt: u32, fault: Option<Fault>) -> CallOptions {
        let mut limits = call.step.limits.clone();
        if let Some(timeout) = call.step.timeout {
            limits.deadline_ms = Some(timeout.as_millis().max(1) as u64);
        }
        let fault = match fault {
            Some(Fault::Trap) => Some(InjectedFault::Trap),
            Some(Fault::Fuel) => Some(InjectedFault::Fuel),
            Some(Fault::Timeout) => Some(InjectedFault::Deadline),
            _ => None,
        };
        let deterministic = self.options.deterministic;
        CallOptions {
            context: CallContext {
                saga_id: self.options.run_id.clone(),
                step_id: call.step.id.clone(),
                attempt,
                idempotency_key: call.key.to_string(),
            },
            limits,
            fault,
            seed: deterministic
                .then(|| self.options.seed ^ (self.draw(&call.step.id, call.phase, attempt) * 1e18) as u64),
            // Compensation runs after the deadline: it is what the time-out asks for.
            deadline: self.deadline.filter(|_| call.phase == Phase::Action),
            parallel: self.parallel,
        }
    }

    /// Runs the call and commits its writes with the event that records it (a lost reply
    /// commits its effect with a `lost_response` failure record and caches nothing).
    /// `fresh`: a snapshot just read, for the call's first run.
    async fn invoke_and_commit(
        &self,
        call: &Call<'_>,
        attempt: u32,
        options: &CallOptions,
        lost: bool,
        fresh: Option<State>,
    ) -> Attempt {
        let started = Instant::now();
        let fresh = Mutex::new(fresh);
        let record = |output: &Value| -> Event {
            if lost {
                // The key names the effect for the compensator of a resumed run.
                let kind = match call.phase {
                    Phase::Action => EventKind::StepFailed,
                    Phase::Compensation => EventKind::CompensationUncertain,
                };
                let event = Event::new(kind).step(&call.step.id, call.tool);
                return event.attempt(attempt, call.key).error(lost_response(call.tool));
            }
            let mut event = self.delivered_event(call, attempt);
            event.replayed = Some(false);
            event.duration_us = Some(started.elapsed().as_micros() as u64);
            event.data(output.clone())
        };
        let committed = self
            .runtime
            .call_and_commit(
                call.tool,
                call.args,
                options,
                || lock(&fresh).take().unwrap_or_else(|| self.blocking(|| self.backend.snapshot())),
                |invocation, output| {
                    let result = call.cache_key.filter(|_| !lost).map(|cache_key| (cache_key, output));
                    match self.commit(&invocation.txn, result, vec![record(output)]) {
                        Ok(()) => CommitAttempt::Committed(()),
                        Err(CommitError::Conflict(conflict)) => CommitAttempt::Conflict(conflict),
                        Err(e) => CommitAttempt::Failed(e),
                    }
                },
            )
            .await;
        match committed.result {
            Ok(_) if lost => Attempt::Lost,
            Ok((output, ())) => Attempt::Delivered { output },
            Err(CallFailure::Commit(CommitError::AlreadyCommitted(output))) => {
                // Another delivery of the same call got in first: its result stands.
                self.record_replay(call, attempt, &output);
                Attempt::Delivered { output }
            }
            // Not retried: the run is another process's now.
            Err(CallFailure::Commit(e @ CommitError::TakenOver { .. })) => Attempt::Failed(taken_over_error(&e)),
            Err(CallFailure::Commit(e)) => {
                Attempt::Failed(ErrorInfo::from(&CallError::Host { tool: call.tool.into(), reason: e.to_string() }))
            }
            Err(CallFailure::Call(CallError::DeadlineExceeded { .. }))
                if call.phase == Phase::Action && self.past_deadline() =>
            {
                Attempt::TimedOut
            }
            Err(CallFailure::Call(e)) => Attempt::Failed(ErrorInfo::from(&e)),
        }
    }

    /// The saga's output bindings, resolved over the completed steps.
    fn saga_output(&self) -> Result<Option<Value>, ErrorInfo> {
        let Some(template) = &self.saga.plan.output else { return Ok(None) };
        let progress = lock(&self.progress);
        binding::resolve(template, &Scope { input: &self.options.input, steps: &progress.outputs }).map(Some).map_err(
            |e| ErrorInfo { code: "binding".into(), kind: FailureKind::InvalidInput, message: format!("output: {e}") },
        )
    }

    /// Compensates every completed (or uncertain) step that has a compensator: in reverse
    /// completion order, each only after the compensations of the completed steps that
    /// depend on it. A step whose dependant's compensation failed is not compensated (as in
    /// steno): undoing it could break what that dependant left in place; it stays, and is
    /// reported in the residue.
    async fn compensate(
        &self,
        completed: &[(usize, Completed)],
        reason: &ErrorInfo,
    ) -> (Vec<String>, Vec<CompensationFailure>) {
        let steps = &self.steps;
        let (resumed, before) = {
            let progress = lock(&self.progress);
            (progress.compensating.is_some(), progress.compensated_before.clone())
        };
        if !resumed {
            let ids: Vec<&str> = completed
                .iter()
                .rev()
                .filter(|(i, _)| steps.get(*i).compensator.is_some())
                .map(|(i, _)| steps.get(*i).id.as_str())
                .collect();
            self.emit(Event::new(EventKind::CompensationTriggered).error(reason.clone()).data(json!({ "steps": ids })));
        }

        // Position of each step in completion order; only completed steps take part.
        let mut position: Vec<Option<usize>> = vec![None; steps.len()];
        for (p, (i, _)) in completed.iter().enumerate() {
            position[*i] = Some(p);
        }
        // How many completed dependants each step still waits for.
        let mut waiting: Vec<usize> =
            (0..steps.len()).map(|i| steps.dependants(i).iter().filter(|&&j| position[j].is_some()).count()).collect();
        // The latest completed first.
        let mut ready: BinaryHeap<usize> =
            completed.iter().enumerate().filter(|(_, (i, _))| waiting[*i] == 0).map(|(p, _)| p).collect();
        let finished_before: BTreeSet<usize> = before.iter().copied().collect();
        let mut compensated: Vec<String> = before.iter().map(|i| steps.get(*i).id.clone()).collect();
        let mut failures = Vec::new();
        let mut running = FuturesUnordered::new();
        let release = |i: usize, waiting: &mut Vec<usize>, ready: &mut BinaryHeap<usize>| {
            for &d in &steps.get(i).deps {
                if let Some(p) = position[d] {
                    waiting[d] -= 1;
                    if waiting[d] == 0 {
                        ready.push(p);
                    }
                }
            }
        };
        // A session's calls are undone one at a time, the latest first: the agent chose each
        // call knowing the ones before it, as if each depended on them.
        let concurrency = if matches!(steps, Steps::Arriving(_)) { 1 } else { self.concurrency() };
        loop {
            while running.len() < concurrency && self.taken_over.get().is_none() {
                let Some(p) = ready.pop() else { break };
                let (i, forward) = &completed[p];
                if steps.get(*i).compensator.is_none() || finished_before.contains(i) {
                    // Nothing to undo (now): its dependencies need not wait for it.
                    release(*i, &mut waiting, &mut ready);
                    continue;
                }
                running.push(Box::pin(async move { (*i, self.compensate_step(*i, forward).await) }));
            }
            let Some((i, result)) = running.next().await else { break };
            let step = steps.get(i);
            let status = match result {
                Ok(()) => {
                    compensated.push(step.id.clone());
                    release(i, &mut waiting, &mut ready);
                    StepStatus::Compensated
                }
                Err(error) => {
                    let tool = step.compensator.as_ref().map_or(String::new(), |c| c.tool.clone());
                    failures.push(CompensationFailure { step: step.id.clone(), tool, error });
                    StepStatus::CompensationFailed
                }
            };
            lock(&self.progress).status.insert(i, status);
        }
        (compensated, failures)
    }

    /// Runs one step's compensator, with retries.
    async fn compensate_step(&self, index: usize, forward: &Completed) -> Result<(), ErrorInfo> {
        let step = self.step(index);
        let Some(compensator) = &step.compensator else { return Ok(()) };
        let span = tracing::info_span!("compensate", step = %step.id, tool = %compensator.tool);
        let args = Arc::new(self.compensator_args(step, forward));
        let canonical = crate::json::canonical(&args);
        let step_id = format!("{}/compensate", step.id);
        let key = idempotency_key_of_text(&self.options.run_id, &step_id, &compensator.tool, &canonical);
        // A compensator always has effects to undo, so its result is always cached.
        let cache_key = cache_key(&self.options.run_id, &key, false);
        let call = Call {
            step,
            phase: Phase::Compensation,
            tool: &compensator.tool,
            args: CallArgs::with_canonical(&args, &canonical),
            key: &key,
            cache_key: Some(&cache_key),
        };
        let fault = self.options.faults.get(&step.id, Phase::Compensation);
        async {
            let mut attempt = 0;
            loop {
                attempt += 1;
                lock(&self.progress).attempts.insert((index, Phase::Compensation), attempt);
                let started =
                    Event::new(EventKind::CompensationStarted).step(&step.id, &compensator.tool).attempt(attempt, &key);
                self.emit(started.data(args.clone()));
                // Compensations carry no deadline, so they never come back `TimedOut`.
                match self.attempt(&call, attempt, fault).await {
                    Attempt::Delivered { .. } | Attempt::Lost | Attempt::TimedOut => {
                        if fault == Some(Fault::Repeat) {
                            self.attempt(&call, attempt, None).await;
                        }
                        return Ok(());
                    }
                    Attempt::Failed(error) => {
                        let retry = error.kind == FailureKind::Transient;
                        if retry && attempt < self.saga.plan.compensation_retry.max_attempts {
                            self.backoff(&call, attempt, &error).await;
                            continue;
                        }
                        let failed = Event::new(EventKind::CompensationFailed).step(&step.id, &compensator.tool);
                        self.emit(failed.attempt(attempt, &key).error(error.clone()));
                        return Err(error);
                    }
                }
            }
        }
        .instrument(span)
        .await
    }

    /// A compensator's arguments: its own (resolved, `$.steps.<id>` being the forward
    /// output) with the `forward` envelope: the forward arguments, output (null when the
    /// reply was lost) and idempotency key.
    fn compensator_args(&self, step: &PlannedStep, forward: &Completed) -> Value {
        let progress = lock(&self.progress);
        let output = if forward.lost { None } else { progress.output_copy(&step.id) };
        let template = step.compensator.as_ref().map_or(&Value::Null, |c| &c.arguments);
        let resolved = binding::resolve(template, &Scope { input: &self.options.input, steps: &progress.outputs });
        let mut args = match resolved {
            Ok(Value::Object(map)) => map,
            Ok(_) => Default::default(),
            Err(e) => {
                // Only an uncertain step lacks an output to bind; the envelope still names
                // the effect by its idempotency key.
                tracing::warn!(step = %step.id, "compensator arguments: {e}; passing the forward envelope only");
                Default::default()
            }
        };
        // Built from clones: `json!` would copy the arguments and output through `to_value`,
        // a serializer that rebuilds every map entry by entry.
        let mut envelope = serde_json::Map::new();
        envelope.insert("arguments".into(), Value::clone(&forward.args));
        envelope.insert("output".into(), output.unwrap_or(Value::Null));
        envelope.insert("idempotency_key".into(), Value::String(forward.key.clone()));
        args.insert("forward".into(), Value::Object(envelope));
        Value::Object(args)
    }

    fn step_reports(&self) -> Vec<StepReport> {
        let progress = lock(&self.progress);
        (0..self.steps.len())
            .map(|i| (i, self.step(i)))
            .map(|(i, s)| StepReport {
                id: s.id.clone(),
                tool: s.tool.clone(),
                status: progress.status.get(&i).copied().unwrap_or(StepStatus::NotRun),
                attempts: progress.attempts.get(&(i, Phase::Action)).copied().unwrap_or(0),
                compensator: s.compensator.as_ref().map(|c| c.tool.clone()),
                compensation_attempts: progress.attempts.get(&(i, Phase::Compensation)).copied().unwrap_or(0),
            })
            .collect()
    }

    /// This run's net changes (its own, told apart from other runs' writes to the same
    /// documents), and for `compensation_failed` the residue (ledgers excluded).
    fn net_changes(&self, status: Status) -> (Vec<NetChange>, Vec<NetChange>) {
        let now = self.blocking(|| self.backend.snapshot());
        let events = lock(&self.events);
        let by_doc = super::journal::writes_by_document(&events);
        let changes: Vec<NetChange> = by_doc
            .into_iter()
            .filter_map(|((ns, key), writes)| {
                let after = now.get(ns, key).map(|d| d.text.clone());
                let before = without_writes(after.as_deref(), &writes);
                if before.as_deref() == after.as_deref() {
                    return None;
                }
                let change = match (&before, &after) {
                    (None, _) => "added",
                    (_, None) => "removed",
                    _ => "changed",
                };
                Some(NetChange {
                    namespace: ns.to_string(),
                    key: key.to_string(),
                    change: change.into(),
                    before: before.map(DocText::new),
                    after: after.map(DocText::new),
                })
            })
            .collect();
        let residue = if status == Status::CompensationFailed {
            changes.iter().filter(|c| !self.saga.plan.ledgers.contains(&c.namespace)).cloned().collect()
        } else {
            Vec::new()
        };
        (changes, residue)
    }
}

/// The faults an interrupted run was started with, from its `saga_started` record.
fn recorded_faults(journal: &[Event]) -> Option<FaultPlan> {
    let started = journal.iter().find(|e| e.event == EventKind::SagaStarted)?;
    serde_json::from_value(started.data.as_ref()?.get("faults")?.clone()).ok()
}

const SAGA_TIMEOUT: &str = "saga_timeout";
const LOST_RESPONSE: &str = "lost_response";

/// Why a run stopped: another process took it over ([`CommitError::TakenOver`]).
fn taken_over_error(e: &CommitError) -> ErrorInfo {
    ErrorInfo { code: "taken_over".into(), kind: FailureKind::Contained, message: e.to_string() }
}

fn lost_response(tool: &str) -> ErrorInfo {
    ErrorInfo {
        code: LOST_RESPONSE.into(),
        kind: FailureKind::Transient,
        message: format!("{tool}: the reply was lost; the effect may have been applied"),
    }
}

/// The failure an injected fault stands for without running the call, if it does.
fn synthesized_failure(call: &Call<'_>, attempt: u32, fault: Option<Fault>) -> Option<Attempt> {
    let (code, kind, message) = match fault? {
        Fault::Rejected => ("rejected", FailureKind::Rejected, "rejected: injected fault".to_string()),
        Fault::Transient { failures } if attempt <= failures => (
            "transient",
            FailureKind::Transient,
            format!("transient failure: injected fault ({attempt} of {failures})"),
        ),
        Fault::Permanent => ("transient", FailureKind::Transient, "failure: injected permanent fault".to_string()),
        _ => return None,
    };
    Some(Attempt::Failed(ErrorInfo { code: code.into(), kind, message: format!("{}: {message}", call.tool) }))
}
