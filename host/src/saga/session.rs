//! Sessions: sagas whose steps arrive one call at a time (an agent choosing its next tool
//! call), run by the same engine as saga files: each call is a step with its idempotency
//! key, journal records and compensator, and ending a session with an error compensates
//! every completed call in reverse completion order.
//!
//! A session's journal holds everything needed to rebuild it: a session a crash interrupted
//! is [`Session::recover`]ed from its journal and aborted, and [`as_saga`] turns a journal
//! into a saga file whose steps are the calls it made.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use super::definition::SagaDef;
use super::engine::{Run, RunOptions, Steps};
use super::journal::{ErrorInfo, Event, EventKind};
use super::plan::{CompensatorPlan, PlannedStep, StepKey};
use super::report::RunReport;
use super::{Companions, Plan, Saga};
use crate::backend::Backend;
use crate::ids::{cache_key, idempotency_key};
use crate::runtime::{CallError, FailureKind, Runtime};
use crate::store::State;
use crate::store::undo::without_writes;

/// What a durable run registry records as the "saga file" of a session's run.
pub const SESSION_SOURCE: &str = "(mcp session)";

/// A session: an open saga.
pub struct Session<'a> {
    run: Run<'a>,
    runtime: &'a Runtime,
    /// Calls numbered so far (`call-1`, `call-2`, …).
    calls: AtomicUsize,
}

/// What one call of a session came to.
#[derive(Clone, Debug)]
pub enum CallOutcome {
    /// `step` is this session's step that recorded it, or for `replayed` calls the earlier
    /// delivery's.
    Completed { step: String, output: Value, replayed: bool },
    /// The call failed and wrote nothing.
    Failed { step: Option<String>, error: ErrorInfo },
    /// The session's deadline passed before or while it ran; it wrote nothing.
    TimedOut,
}

/// A completed call, as `status` reports it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SessionStep {
    pub step: String,
    pub tool: String,
    pub arguments: Value,
    pub output: Option<Value>,
    pub idempotency_key: String,
    pub compensator: Option<String>,
}

/// The step id of a session's `n`-th call.
fn call_id(n: usize) -> String {
    format!("call-{n}")
}

/// The idempotency key of a call whose client named its key: the same for every retry
/// of that key with that tool, whichever session it arrives in.
pub fn client_key(key: &str, tool: &str) -> String {
    idempotency_key("client", key, tool, &Value::Null)
}

impl<'a> Session<'a> {
    /// Opens a session. `shell` names it and carries its time-out (see
    /// [`Plan::for_session`](super::Plan::for_session)); it has no steps.
    pub fn open(runtime: &'a Runtime, shell: &'a Saga, backend: &'a dyn Backend, options: RunOptions) -> Session<'a> {
        let session = Session::new(runtime, shell, backend, options);
        session.run.begin();
        session
    }

    fn new(runtime: &'a Runtime, shell: &'a Saga, backend: &'a dyn Backend, options: RunOptions) -> Session<'a> {
        let run = Run::new(runtime, shell, Steps::Arriving(Box::default()), backend, options, true);
        Session { run, runtime, calls: AtomicUsize::new(0) }
    }

    /// Rebuilds a session a crash interrupted from its journal (`options.resume`), ready to
    /// be aborted: its completed calls are known again, and compensations already done are
    /// not run twice.
    pub fn recover(
        runtime: &'a Runtime,
        shell: &'a Saga,
        backend: &'a dyn Backend,
        options: RunOptions,
    ) -> Session<'a> {
        let steps = recorded_calls(&options.resume);
        let session = Session::new(runtime, shell, backend, options);
        session.calls.store(steps.len(), Ordering::Relaxed);
        for step in steps {
            session.run.add_step(step);
        }
        session.run.begin();
        session
    }

    pub fn run_id(&self) -> &str {
        self.run.run_id()
    }

    /// Calls `tool` with `args` as the session's next step. `client_key`: the key the client
    /// named for this effect; a retry with it answers from the earlier delivery.
    pub async fn call(&self, tool: &str, args: Value, client_key: Option<&str>) -> CallOutcome {
        // A call that cannot run (an unknown tool, arguments off its schema) is refused
        // before it becomes a step: it had no effect, and fails nothing else.
        let resolved = self.runtime.resolve(tool).and_then(|(plugin, found)| {
            found.check_args(tool, &args)?;
            let compensator = found.info.compensator.as_ref().map(|c| format!("{}.{c}", plugin.name));
            Ok((found.info.side_effects, compensator))
        });
        let (side_effects, compensator) = match resolved {
            Ok(found) => found,
            Err(e) => return CallOutcome::Failed { step: None, error: ErrorInfo::from(&e) },
        };
        let id = call_id(self.calls.fetch_add(1, Ordering::Relaxed) + 1);
        let key = match client_key {
            Some(k) => self::client_key(k, tool),
            None => idempotency_key(self.run.run_id(), &id, tool, &args),
        };
        if let Some((step, output)) = self.run.completed_with_key(&key) {
            return CallOutcome::Completed { step, output, replayed: true };
        }
        if side_effects && let Some(output) = self.run.cached(&cache_key(self.run.run_id(), &key, client_key.is_some()))
        {
            // Delivered earlier, in another session: its effect is that session's to undo.
            self.run.record_cached_reply(&id, tool, &key, &output);
            return CallOutcome::Completed { step: id, output, replayed: true };
        }
        let step = PlannedStep {
            id: id.clone(),
            name: None,
            tool: tool.to_string(),
            arguments: json!({ "$literal": args }),
            input: None,
            side_effects,
            compensator: compensator.map(|tool| CompensatorPlan { tool, arguments: json!({}) }),
            deps: Vec::new(),
            retry: Default::default(),
            timeout: None,
            limits: Default::default(),
            key: match client_key {
                Some(_) => StepKey::ClientNamed(key),
                None => StepKey::OfRun(key),
            },
        };
        let Some(index) = self.run.add_step(step) else {
            let error = CallError::Host { tool: tool.into(), reason: "not a session".into() };
            return CallOutcome::Failed { step: None, error: ErrorInfo::from(&error) };
        };
        if self.run.forward_step(index).await {
            let output = self.run.output_of(&id).unwrap_or(Value::Null);
            return CallOutcome::Completed { step: id, output, replayed: false };
        }
        match self.run.take_failure() {
            Some(error) => CallOutcome::Failed { step: Some(id), error },
            None if self.run.timed_out() => CallOutcome::TimedOut,
            None => CallOutcome::Failed {
                step: Some(id),
                error: ErrorInfo { code: "unknown".into(), kind: FailureKind::Contained, message: "failed".into() },
            },
        }
    }

    /// The completed calls, in completion order.
    pub fn steps(&self) -> Vec<SessionStep> {
        self.run
            .completed_steps()
            .into_iter()
            .map(|(step, arguments, output, key)| SessionStep {
                step: step.id.clone(),
                tool: step.tool.clone(),
                arguments,
                output,
                idempotency_key: key,
                compensator: step.compensator.as_ref().map(|c| c.tool.clone()),
            })
            .collect()
    }

    /// Ends the session keeping its effects.
    pub async fn commit(&self) -> RunReport {
        self.run.finish(None).await
    }

    /// Ends the session undoing its effects: every completed call's compensator, in reverse
    /// completion order.
    pub async fn abort(&self, reason: ErrorInfo) -> RunReport {
        self.run.finish(Some(reason)).await
    }

    /// The error a session's time-out stands for.
    pub fn timeout_error(&self) -> ErrorInfo {
        self.run.timeout_error()
    }
}

/// The saga a session runs as: a name, a time-out, no steps yet (named `session:<name>`).
pub fn shell(name: &str, timeout: Option<Duration>) -> Saga {
    Saga {
        name: format!("session:{name}"),
        path: SESSION_SOURCE.into(),
        definition: SagaDef {
            name: Some(name.to_string()),
            description: None,
            steps: Vec::new(),
            timeout: None,
            output: None,
            ledgers: Vec::new(),
            compensation_retry: None,
        },
        plan: Plan::for_session(timeout),
        companions: Companions { input: None, fixture: None, expected: None },
    }
}

/// Compensates a session a crash interrupted (a client cannot come back to a dead session):
/// every effect its journal records is undone once; compensations done before the crash
/// are not run again.
pub async fn abort_interrupted(runtime: &Runtime, backend: &dyn Backend, name: &str, options: RunOptions) -> RunReport {
    let shell = shell(name.strip_prefix("session:").unwrap_or(name), None);
    let session = Session::recover(runtime, &shell, backend, options);
    let reason = ErrorInfo {
        code: "session_lost".into(),
        kind: FailureKind::Contained,
        message: "the server stopped with this session's transaction open".into(),
    };
    session.abort(reason).await
}

/// The calls a session's journal records, as steps (in the order they started).
fn recorded_calls(journal: &[Event]) -> Vec<PlannedStep> {
    let mut steps: Vec<PlannedStep> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for event in journal.iter().filter(|e| e.event == EventKind::StepStarted) {
        let (Some(id), Some(tool)) = (&event.step, &event.tool) else { continue };
        if !seen.insert(id.as_str()) {
            continue;
        }
        steps.push(PlannedStep {
            id: id.clone(),
            name: None,
            tool: tool.clone(),
            arguments: json!({ "$literal": event.data.as_deref().cloned().unwrap_or(Value::Null) }),
            input: None,
            side_effects: event.compensator.is_some(),
            compensator: event
                .compensator
                .as_ref()
                .map(|tool| CompensatorPlan { tool: tool.clone(), arguments: json!({}) }),
            deps: Vec::new(),
            retry: Default::default(),
            timeout: None,
            limits: Default::default(),
            // A recorded call is undone, never run again: its result is not looked up.
            key: event.idempotency_key.clone().map_or(StepKey::Derived, StepKey::OfRun),
        });
    }
    steps
}

/// A session's journal as a saga file: its completed calls as steps, in completion order,
/// with their literal arguments and the compensators the session would have used. The
/// failed call that ended it, if any, comes last (a verify campaign then replays the failure
/// too).
pub fn as_saga(name: &str, journal: &[Event]) -> Value {
    let calls = recorded_calls(journal);
    let completed = journal.iter().filter(|e| e.event == EventKind::StepCompleted && e.replayed != Some(true));
    let failed = journal.iter().filter(|e| e.event == EventKind::StepFailed);
    let mut order: Vec<&str> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for id in completed.chain(failed).filter_map(|e| e.step.as_deref()) {
        if seen.insert(id) {
            order.push(id);
        }
    }
    let by_id: std::collections::HashMap<&str, &PlannedStep> = calls.iter().map(|s| (s.id.as_str(), s)).collect();
    let steps: Vec<Value> = order
        .iter()
        .filter_map(|id| by_id.get(id).copied())
        .map(|step| {
            // A session step's arguments are `{"$literal": args}`; written out, only what would
            // read as a binding is escaped.
            let args = step.arguments.get("$literal").unwrap_or(&step.arguments);
            let arguments = super::binding::literal(args);
            let mut def = json!({ "id": step.id, "action": { "name": step.tool, "arguments": arguments } });
            match &step.compensator {
                Some(c) => def["compensate"] = json!({ "name": c.tool }),
                None => def["no_compensation"] = json!(true),
            }
            def
        })
        .collect();
    json!({ "saga": { "name": name, "description": "A recorded session (sagabox journal --as-saga).", "steps": steps } })
}

/// The store as it was before the run of `journal` wrote to it: `now` with each document
/// the run wrote put back. Documents other runs wrote meanwhile keep those runs' changes
/// (see [`crate::store::undo`]).
pub fn state_before(journal: &[Event], now: &State) -> Result<State, String> {
    let mut json = now.to_json();
    for ((ns, key), writes) in super::journal::writes_by_document(journal) {
        let current = now.get(ns, key).map(|d| d.text.clone());
        let before = without_writes(current.as_deref(), &writes);
        let namespace =
            json.as_object_mut().ok_or("the state is not an object")?.entry(ns).or_insert_with(|| json!({}));
        let Some(namespace) = namespace.as_object_mut() else { continue };
        match before {
            Some(text) => {
                let doc = serde_json::from_str(&text).map_err(|e| format!("{ns}/{key}: {e}"))?;
                namespace.insert(key.to_string(), doc);
            }
            None => {
                namespace.remove(key);
            }
        }
    }
    if let Some(namespaces) = json.as_object_mut() {
        namespaces.retain(|_, docs| docs.as_object().is_none_or(|d| !d.is_empty()));
    }
    State::from_json(&json)
}
