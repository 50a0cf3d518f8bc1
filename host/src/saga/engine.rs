//! Runs a saga: forward steps in order or as a DAG, retries, time-outs, idempotency, and on
//! failure the compensation of every completed step in reverse completion order, a step
//! only after every step that depends on it.
//!
//! A step's store writes, its cached result and the journal event recording its completion
//! commit together (see [`Backend::commit`]), synchronously, right after the call returns:
//! a run cancelled by the saga's time-out either committed a step or left no trace of it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::stream::{FuturesUnordered, StreamExt};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tracing::Instrument;

use super::Saga;
use super::backend::{Backend, CommitError};
use super::binding::{self, Scope};
use super::fault::{Fault, FaultPlan, Phase};
use super::journal::{ErrorInfo, Event, EventKind, JournalSink};
use super::plan::{PlannedStep, merge_args};
use super::report::{CompensationFailure, NetChange, RunReport, Status, StepReport, StepStatus};
use crate::ids::idempotency_key;
use crate::runtime::{CallContext, CallError, CallOptions, FailureKind, InjectedFault, MAX_COMMIT_RUNS, Runtime};
use crate::store::{Change, Txn};

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

/// A forward step that committed (or may have: `output` is `None` when its reply was lost).
#[derive(Clone, Debug)]
struct Completed {
    args: Value,
    output: Option<Value>,
    key: String,
}

/// What the forward phase learned; kept outside the forward future so that a time-out,
/// which drops that future, loses nothing.
#[derive(Default)]
struct Progress {
    /// Completed (or uncertain) steps in completion order.
    completed: Vec<(usize, Completed)>,
    status: BTreeMap<usize, StepStatus>,
    attempts: BTreeMap<(usize, Phase), u32>,
    failure: Option<StepFailure>,
    /// A resumed run whose compensation had begun: why it began.
    compensating: Option<ErrorInfo>,
    /// Steps compensated in an earlier life of a resumed run, in order.
    compensated_before: Vec<usize>,
}

/// `(namespace, key)`.
type DocKey = (String, String);

/// One run in progress.
struct Run<'a> {
    runtime: &'a Runtime,
    saga: &'a Saga,
    backend: &'a dyn Backend,
    options: RunOptions,
    started: Instant,
    events: Mutex<Vec<Event>>,
    progress: Mutex<Progress>,
    /// The value each key had before this run first changed it.
    touched: Mutex<BTreeMap<DocKey, Option<Arc<str>>>>,
}

/// What one attempt of a call came to.
enum Attempt {
    Delivered {
        output: Value,
    },
    /// The call committed but its reply was lost (an injected fault).
    Lost,
    Failed(ErrorInfo),
}

/// Runs `saga` on `backend`. Never panics on plugin or input behaviour: every failure ends
/// in a report.
pub async fn run(runtime: &Runtime, saga: &Saga, backend: &dyn Backend, options: RunOptions) -> RunReport {
    let span = tracing::info_span!("saga", saga = %saga.name, run_id = %options.run_id);
    let prior = options.resume.clone();
    let run = Run {
        runtime,
        saga,
        backend,
        options,
        started: Instant::now(),
        events: Mutex::new(prior),
        progress: Mutex::default(),
        touched: Mutex::default(),
    };
    run.execute().instrument(span).await
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Run<'_> {
    fn step(&self, index: usize) -> &PlannedStep {
        &self.saga.plan.steps[index]
    }

    fn concurrency(&self) -> usize {
        if self.options.deterministic { 1 } else { self.options.max_concurrency.max(1) }
    }

    /// Stamps and records events that come with no state change.
    fn emit(&self, event: Event) {
        if let Err(e) = self.append(vec![event], |events| self.backend.record(events).map(|_| Vec::new())) {
            tracing::error!("cannot record a journal event: {e}");
        }
    }

    /// Stamps `events`, hands them to `commit` (which stores them with whatever else it
    /// commits), and on success adds them to the run's journal.
    fn append(
        &self,
        mut events: Vec<Event>,
        commit: impl FnOnce(&[Event]) -> Result<Vec<Change>, CommitError>,
    ) -> Result<Vec<Change>, CommitError> {
        let mut log = lock(&self.events);
        let at_us = self.started.elapsed().as_micros() as u64;
        for (i, event) in events.iter_mut().enumerate() {
            event.seq = (log.len() + i) as u64;
            event.run_id = self.options.run_id.clone();
            event.at_us = at_us;
        }
        let changes = commit(&events)?;
        if let Some(sink) = &self.options.journal {
            sink.append(&events);
        }
        log.extend(events);
        Ok(changes)
    }

    /// Commits a call's writes with its events and cached result, remembering what it changed.
    fn commit(&self, txn: &Txn, result: Option<(&str, &Value)>, events: Vec<Event>) -> Result<(), CommitError> {
        let changes = self.append(events, |events| self.backend.commit(txn, result, events))?;
        let mut touched = lock(&self.touched);
        for change in changes {
            touched.entry((change.namespace, change.key)).or_insert(change.before);
        }
        Ok(())
    }

    /// A number in [0, 1) fixed by the seed, the step, the phase and the attempt.
    fn draw(&self, step: &str, phase: Phase, attempt: u32) -> f64 {
        let mut hasher = Sha256::new();
        hasher.update(self.options.seed.to_le_bytes());
        hasher.update(step.as_bytes());
        hasher.update([phase as u8]);
        hasher.update(attempt.to_le_bytes());
        let bytes: [u8; 8] = hasher.finalize()[..8].try_into().unwrap_or_default();
        (u64::from_le_bytes(bytes) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Rebuilds the progress of an interrupted run from its journal.
    fn restore(&self) {
        for event in &self.options.resume {
            let Some((index, step)) = event.step.as_deref().and_then(|id| self.saga.plan.step(id)) else {
                if event.event == EventKind::CompensationTriggered {
                    lock(&self.progress).compensating = event.error.clone();
                }
                continue;
            };
            match event.event {
                EventKind::StepCompleted if !lock(&self.progress).completed.iter().any(|(i, _)| *i == index) => {
                    // Arguments are bound again: binding is deterministic given the input and
                    // the outputs of the steps completed before.
                    let args = self.bind(step).unwrap_or(Value::Null);
                    let key = event.idempotency_key.clone().unwrap_or_default();
                    let mut progress = lock(&self.progress);
                    progress.status.insert(index, StepStatus::Completed);
                    progress.attempts.insert((index, Phase::Action), event.attempt.unwrap_or(1));
                    progress.completed.push((index, Completed { args, output: event.data.clone(), key }));
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

    async fn execute(&self) -> RunReport {
        if self.options.resume.is_empty() {
            self.emit(Event::new(EventKind::SagaStarted).data(json!({
                "saga": self.saga.name,
                "seed": self.options.seed,
                "input": self.options.input,
                "faults": self.options.faults,
            })));
        } else {
            self.restore();
            let progress = lock(&self.progress);
            let done: Vec<&str> = progress.completed.iter().map(|(i, _)| self.step(*i).id.as_str()).collect();
            let event = Event::new(EventKind::SagaResumed).data(json!({ "completed": done }));
            drop(progress);
            self.emit(event);
        }
        // A resumed run that had already failed goes straight to compensation.
        let decided = {
            let progress = lock(&self.progress);
            progress.compensating.is_some() || progress.failure.is_some()
        };
        let forward = self.forward();
        let timed_out = match self.saga.plan.timeout {
            _ if decided => false,
            Some(limit) => tokio::time::timeout(limit, forward).await.is_err(),
            None => {
                forward.await;
                false
            }
        };
        let (failure, completed) = {
            let mut progress = lock(&self.progress);
            if timed_out {
                // Steps the time-out interrupted wrote nothing: their writes were never committed.
                for i in 0..self.saga.plan.steps.len() {
                    if progress.attempts.contains_key(&(i, Phase::Action)) && !progress.status.contains_key(&i) {
                        progress.status.insert(i, StepStatus::Cancelled);
                    }
                }
            }
            (progress.failure.clone(), progress.completed.clone())
        };

        let mut error = lock(&self.progress).compensating.clone().or_else(|| failure.as_ref().map(|f| f.error.clone()));
        if timed_out {
            let limit = self.saga.plan.timeout.unwrap_or_default();
            error = Some(ErrorInfo {
                code: "saga_timeout".into(),
                kind: FailureKind::Contained,
                message: format!("the saga did not finish within {} ms", limit.as_millis()),
            });
        }
        let mut output = None;
        if error.is_none() {
            match self.saga_output(&completed) {
                Ok(value) => output = value,
                Err(e) => error = Some(e),
            }
        }

        let mut compensated = Vec::new();
        let mut compensation_failures = Vec::new();
        if let Some(error) = &error {
            (compensated, compensation_failures) = self.compensate(&completed, error).await;
        }
        let status = match (&error, timed_out, compensation_failures.is_empty()) {
            (None, _, _) => Status::Completed,
            (Some(_), _, false) => Status::CompensationFailed,
            (Some(_), true, true) => Status::TimedOut,
            (Some(_), false, true) => Status::Failed,
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

    /// Runs forward steps as their dependencies complete, until all completed or one failed
    /// (in-flight steps then finish, and are compensated if they completed).
    async fn forward(&self) {
        let n = self.saga.plan.steps.len();
        let restored: BTreeSet<usize> = lock(&self.progress).completed.iter().map(|(i, _)| *i).collect();
        let mut launched: Vec<bool> = (0..n).map(|i| restored.contains(&i)).collect();
        let mut running = FuturesUnordered::new();
        loop {
            let failed = lock(&self.progress).failure.is_some();
            if !failed {
                let done: BTreeSet<usize> = lock(&self.progress).completed.iter().map(|(i, _)| *i).collect();
                for (i, started) in launched.iter_mut().enumerate() {
                    if running.len() >= self.concurrency() {
                        break;
                    }
                    if !*started && self.step(i).deps.iter().all(|d| done.contains(d)) {
                        *started = true;
                        running.push(self.forward_step(i));
                    }
                }
            }
            if running.next().await.is_none() {
                break;
            }
        }
    }

    /// Binds, calls (with retries) and records one forward step.
    async fn forward_step(&self, index: usize) {
        let step = self.step(index);
        let span = tracing::info_span!("step", step = %step.id, tool = %step.tool);
        async {
            let outcome = self.forward_attempts(index).await;
            let mut progress = lock(&self.progress);
            match outcome {
                Ok(()) => {}
                Err(failure) => {
                    progress.failure.get_or_insert(failure);
                }
            }
        }
        .instrument(span)
        .await
    }

    async fn forward_attempts(&self, index: usize) -> Result<(), StepFailure> {
        let step = self.step(index);
        let fail = |error: ErrorInfo| {
            lock(&self.progress).status.insert(index, StepStatus::Failed);
            self.emit(Event::new(EventKind::StepFailed).step(&step.id, &step.tool).error(error.clone()));
            Err(StepFailure { step: index, error })
        };
        let args = match self.bind(step) {
            Ok(args) => args,
            Err(message) => {
                lock(&self.progress).attempts.insert((index, Phase::Action), 0);
                return fail(ErrorInfo { code: "binding".into(), kind: FailureKind::InvalidInput, message });
            }
        };
        let key = idempotency_key(&self.options.run_id, &step.id, &step.tool, &args);
        let fault = self.options.faults.get(&step.id, Phase::Action);
        let mut attempt = 0;
        loop {
            attempt += 1;
            lock(&self.progress).attempts.insert((index, Phase::Action), attempt);
            self.emit(
                Event::new(EventKind::StepStarted).step(&step.id, &step.tool).attempt(attempt, &key).data(args.clone()),
            );
            let completed_event =
                Event::new(EventKind::StepCompleted).step(&step.id, &step.tool).attempt(attempt, &key);
            match self.attempt(step, Phase::Action, attempt, &args, &key, fault, completed_event.clone()).await {
                Attempt::Delivered { output } => {
                    // Recorded before anything else is awaited: a saga time-out that drops
                    // this future must still find the committed step to compensate.
                    let completed = Completed { args: args.clone(), output: Some(output), key: key.clone() };
                    {
                        let mut progress = lock(&self.progress);
                        progress.status.insert(index, StepStatus::Completed);
                        progress.completed.push((index, completed));
                    }
                    if fault == Some(Fault::Repeat) {
                        // A second delivery of the same call must not apply it again.
                        self.attempt(step, Phase::Action, attempt, &args, &key, None, completed_event).await;
                    }
                    return Ok(());
                }
                Attempt::Lost => {
                    let error = ErrorInfo {
                        code: "lost_response".into(),
                        kind: FailureKind::Transient,
                        message: format!("{}: the reply was lost; the effect may have been applied", step.tool),
                    };
                    let mut progress = lock(&self.progress);
                    progress.status.insert(index, StepStatus::Uncertain);
                    progress.completed.push((index, Completed { args, output: None, key }));
                    drop(progress);
                    self.emit(Event::new(EventKind::StepFailed).step(&step.id, &step.tool).error(error.clone()));
                    return Err(StepFailure { step: index, error });
                }
                Attempt::Failed(error) => {
                    if error.kind == FailureKind::Transient && attempt < step.retry.max_attempts {
                        self.backoff(step, Phase::Action, attempt, &error).await;
                        continue;
                    }
                    return fail(error);
                }
            }
        }
    }

    /// Waits before the next attempt (or, in deterministic runs, only records the delay).
    async fn backoff(&self, step: &PlannedStep, phase: Phase, attempt: u32, error: &ErrorInfo) {
        let policy = match phase {
            Phase::Action => &step.retry,
            Phase::Compensation => &self.saga.plan.compensation_retry,
        };
        let delay = policy.delay(attempt, self.draw(&step.id, phase, attempt));
        let kind = match phase {
            Phase::Action => EventKind::StepRetried,
            Phase::Compensation => EventKind::CompensationRetried,
        };
        let tool = match phase {
            Phase::Action => step.tool.as_str(),
            Phase::Compensation => step.compensator.as_ref().map_or("", |c| c.tool.as_str()),
        };
        self.emit(
            Event::new(kind)
                .step(&step.id, tool)
                .error(error.clone())
                .data(json!({ "attempt": attempt, "delay_ms": delay.as_millis() as u64 })),
        );
        if !self.options.deterministic {
            tokio::time::sleep(delay).await;
        }
    }

    /// The outputs of completed steps, by id.
    fn outputs(&self) -> BTreeMap<String, Value> {
        lock(&self.progress)
            .completed
            .iter()
            .filter_map(|(i, c)| c.output.clone().map(|o| (self.step(*i).id.clone(), o)))
            .collect()
    }

    /// The arguments of a forward step: its input bindings resolved and merged over its
    /// resolved action arguments.
    fn bind(&self, step: &PlannedStep) -> Result<Value, String> {
        let steps = self.outputs();
        let scope = Scope { input: &self.options.input, steps: &steps };
        let arguments = binding::resolve(&step.arguments, &scope).map_err(|e| e.to_string())?;
        let input = step.input.as_ref().map(|i| binding::resolve(i, &scope)).transpose().map_err(|e| e.to_string())?;
        merge_args(arguments, input)
    }

    /// One delivery of a call: a synthesized failure if the fault says so, a replay if the
    /// result is cached, else a real sandboxed call committed with `completed_event`.
    #[allow(clippy::too_many_arguments)]
    async fn attempt(
        &self,
        step: &PlannedStep,
        phase: Phase,
        attempt: u32,
        args: &Value,
        key: &str,
        fault: Option<Fault>,
        completed_event: Event,
    ) -> Attempt {
        let (tool, side_effects) = match phase {
            Phase::Action => (step.tool.as_str(), step.side_effects),
            Phase::Compensation => (step.compensator.as_ref().map_or("", |c| c.tool.as_str()), true),
        };
        let synthesized = |code: &str, kind: FailureKind, message: String| {
            Attempt::Failed(ErrorInfo { code: code.into(), kind, message: format!("{tool}: {message}") })
        };
        match fault {
            Some(Fault::Rejected) => {
                return synthesized("rejected", FailureKind::Rejected, "rejected: injected fault".into());
            }
            Some(Fault::Transient { failures }) if attempt <= failures => {
                let message = format!("transient failure: injected fault ({attempt} of {failures})");
                return synthesized("transient", FailureKind::Transient, message);
            }
            Some(Fault::Permanent) => {
                return synthesized("transient", FailureKind::Transient, "failure: injected permanent fault".into());
            }
            _ => {}
        }
        let started = Instant::now();
        if side_effects && let Some(output) = self.backend.cached(key) {
            let mut event = completed_event;
            event.replayed = Some(true);
            event.duration_us = Some(started.elapsed().as_micros() as u64);
            self.emit(event.data(output.clone()));
            return Attempt::Delivered { output };
        }
        let injected = match fault {
            Some(Fault::Trap) => Some(InjectedFault::Trap),
            Some(Fault::Fuel) => Some(InjectedFault::Fuel),
            Some(Fault::Timeout) => Some(InjectedFault::Deadline),
            _ => None,
        };
        let mut limits = step.limits.clone();
        if let Some(timeout) = step.timeout {
            limits.deadline_ms = Some(timeout.as_millis().max(1) as u64);
        }
        let options = CallOptions {
            context: CallContext {
                saga_id: self.options.run_id.clone(),
                step_id: step.id.clone(),
                attempt,
                idempotency_key: key.to_string(),
            },
            limits,
            fault: injected,
            seed: self
                .options
                .deterministic
                .then(|| self.options.seed ^ (self.draw(&step.id, phase, attempt) * 1e18) as u64),
        };
        let lost = fault == Some(Fault::LostResponse);
        for _ in 0..MAX_COMMIT_RUNS {
            let invocation = self.runtime.invoke(tool, args, &options, self.backend.snapshot()).await;
            let output = match invocation.result {
                Ok(output) => output,
                Err(error) => return Attempt::Failed(ErrorInfo::from(&error)),
            };
            // A lost reply: the effect commits, but nothing records or caches it.
            let (events, result) = if lost {
                (Vec::new(), None)
            } else {
                let mut event = completed_event.clone();
                event.replayed = Some(false);
                event.duration_us = Some(started.elapsed().as_micros() as u64);
                (vec![event.data(output.clone())], side_effects.then_some((key, &output)))
            };
            match self.commit(&invocation.txn, result, events) {
                Ok(()) if lost => return Attempt::Lost,
                Ok(()) => return Attempt::Delivered { output },
                Err(CommitError::Conflict(c)) => tracing::debug!(%c, "commit conflict; running the call again"),
                Err(e @ CommitError::Backend(_)) => {
                    return Attempt::Failed(ErrorInfo::from(&CallError::Host {
                        tool: tool.into(),
                        reason: e.to_string(),
                    }));
                }
            }
        }
        let message = format!("its reads kept changing under it ({MAX_COMMIT_RUNS} runs)");
        synthesized("transient", FailureKind::Transient, message)
    }

    /// The saga's output bindings, resolved over the completed steps.
    fn saga_output(&self, completed: &[(usize, Completed)]) -> Result<Option<Value>, ErrorInfo> {
        let Some(template) = &self.saga.plan.output else { return Ok(None) };
        let steps: BTreeMap<String, Value> =
            completed.iter().filter_map(|(i, c)| c.output.clone().map(|o| (self.step(*i).id.clone(), o))).collect();
        binding::resolve(template, &Scope { input: &self.options.input, steps: &steps }).map(Some).map_err(|e| {
            ErrorInfo { code: "binding".into(), kind: FailureKind::InvalidInput, message: format!("output: {e}") }
        })
    }

    /// Compensates every completed (or uncertain) step that has a compensator: in reverse
    /// completion order, each only after the compensations of the steps that depend on it.
    async fn compensate(
        &self,
        completed: &[(usize, Completed)],
        reason: &ErrorInfo,
    ) -> (Vec<String>, Vec<CompensationFailure>) {
        let plan = &self.saga.plan;
        let order: Vec<usize> =
            completed.iter().rev().map(|(i, _)| *i).filter(|i| plan.steps[*i].compensator.is_some()).collect();
        let forward: BTreeMap<usize, &Completed> = completed.iter().map(|(i, c)| (*i, c)).collect();
        let ids: Vec<&str> = order.iter().map(|i| plan.steps[*i].id.as_str()).collect();
        let (resumed, before) = {
            let progress = lock(&self.progress);
            (progress.compensating.is_some(), progress.compensated_before.clone())
        };
        if !resumed {
            self.emit(Event::new(EventKind::CompensationTriggered).error(reason.clone()).data(json!({ "steps": ids })));
        }

        let pending: BTreeSet<usize> = order.iter().copied().collect();
        // Compensations an earlier life of the run finished are not run again.
        let mut finished: BTreeSet<usize> = before.iter().copied().collect();
        let mut launched = finished.clone();
        let mut running = FuturesUnordered::new();
        let mut compensated: Vec<String> = before.iter().map(|i| plan.steps[*i].id.clone()).collect();
        let mut failures = Vec::new();
        loop {
            for &i in &order {
                if running.len() >= self.concurrency() {
                    break;
                }
                // Every compensated dependant, direct or not, goes first.
                let blocked = plan
                    .steps
                    .iter()
                    .enumerate()
                    .any(|(j, s)| s.ancestors.contains(&i) && pending.contains(&j) && !finished.contains(&j));
                if !launched.contains(&i) && !blocked {
                    launched.insert(i);
                    let forward = forward[&i];
                    running.push(async move { (i, self.compensate_step(i, forward).await) });
                }
            }
            let Some((i, result)) = running.next().await else { break };
            finished.insert(i);
            let step = &plan.steps[i];
            let status = match result {
                Ok(()) => {
                    compensated.push(step.id.clone());
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
        let args = self.compensator_args(step, forward);
        let key = idempotency_key(&self.options.run_id, &format!("{}/compensate", step.id), &compensator.tool, &args);
        let fault = self.options.faults.get(&step.id, Phase::Compensation);
        async {
            let mut attempt = 0;
            loop {
                attempt += 1;
                lock(&self.progress).attempts.insert((index, Phase::Compensation), attempt);
                let started =
                    Event::new(EventKind::CompensationStarted).step(&step.id, &compensator.tool).attempt(attempt, &key);
                self.emit(started.data(args.clone()));
                let done = Event::new(EventKind::CompensationCompleted)
                    .step(&step.id, &compensator.tool)
                    .attempt(attempt, &key);
                match self.attempt(step, Phase::Compensation, attempt, &args, &key, fault, done.clone()).await {
                    Attempt::Delivered { .. } | Attempt::Lost => {
                        if fault == Some(Fault::Repeat) {
                            self.attempt(step, Phase::Compensation, attempt, &args, &key, None, done).await;
                        }
                        return Ok(());
                    }
                    Attempt::Failed(error) => {
                        let retry = error.kind == FailureKind::Transient;
                        if retry && attempt < self.saga.plan.compensation_retry.max_attempts {
                            self.backoff(step, Phase::Compensation, attempt, &error).await;
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
        let mut steps = self.outputs();
        if let Some(output) = &forward.output {
            steps.insert(step.id.clone(), output.clone());
        }
        let template = step.compensator.as_ref().map_or(Value::Null, |c| c.arguments.clone());
        let resolved = binding::resolve(&template, &Scope { input: &self.options.input, steps: &steps });
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
        args.insert(
            "forward".into(),
            json!({
                "arguments": forward.args,
                "output": forward.output,
                "idempotency_key": forward.key,
            }),
        );
        Value::Object(args)
    }

    fn step_reports(&self) -> Vec<StepReport> {
        let progress = lock(&self.progress);
        self.saga
            .plan
            .steps
            .iter()
            .enumerate()
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

    /// This run's net changes, and for `compensation_failed` the residue (ledgers excluded).
    fn net_changes(&self, status: Status) -> (Vec<NetChange>, Vec<NetChange>) {
        let now = self.backend.snapshot();
        let parse = |text: &Option<Arc<str>>| text.as_ref().map(|t| serde_json::from_str(t).unwrap_or(Value::Null));
        let changes: Vec<NetChange> = lock(&self.touched)
            .iter()
            .filter_map(|((ns, key), before)| {
                let after = now.get(ns, key).map(|d| d.text.clone());
                if after == *before {
                    return None;
                }
                let change = match (before, &after) {
                    (None, _) => "added",
                    (_, None) => "removed",
                    _ => "changed",
                };
                Some(NetChange {
                    namespace: ns.clone(),
                    key: key.clone(),
                    change: change.into(),
                    before: parse(before),
                    after: parse(&after),
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
