//! Transactions: an agent's open saga, one task each.
//!
//! A transaction's task owns its [`Session`] and takes commands (call, commit, abort,
//! status) from a channel, so calls of one transaction may be in flight together while its
//! state has a single owner. It ends on commit, abort, a failed call (with
//! [`OnFailure::Compensate`]), its own time-out or idleness; calls still in flight finish
//! first, so compensation sees every effect.

use crate::sync::lock;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::{Backend, RunRecord};
use crate::runtime::{FailureKind, LogSink, Runtime, forwarding_logs};
use crate::saga::RunOptions;
use crate::saga::journal::ErrorInfo;
use crate::saga::report::{CompensationFailure, RunReport};
use crate::saga::session::{self, CallOutcome, SESSION_SOURCE, Session, SessionStep};

/// What the server does with a transaction's earlier effects when one of its calls fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnFailure {
    /// Compensate them and close the transaction.
    Compensate,
    /// Keep the transaction open; the agent decides.
    Keep,
}

/// What the server does with an open transaction whose client went away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnDisconnect {
    Compensate,
    /// Commit it: its effects stay.
    Keep,
}

/// Everything a transaction needs, shared by all of them.
pub struct Context {
    pub runtime: Arc<Runtime>,
    pub backend: Arc<dyn Backend>,
    /// Whether transactions and sagas are registered as runs in the backend (a durable
    /// server: a resume finds them there).
    pub register_runs: bool,
    pub on_failure: OnFailure,
    /// A transaction with no command for this long is aborted.
    pub idle_timeout: Duration,
}

/// A compensated call, as replies list it.
#[derive(Clone, Debug, Serialize)]
pub struct Undone {
    pub step: String,
    pub tool: String,
    pub compensator: Option<String>,
}

/// How a transaction ended.
#[derive(Clone, Debug, Serialize)]
pub struct Ending {
    pub transaction: String,
    /// `committed`, `aborted`, `rolled_back` (a call failed), `timed_out`, `compensation_failed`.
    pub status: &'static str,
    pub reason: Option<ErrorInfo>,
    /// Compensated calls, in the order their compensations completed.
    pub compensated: Vec<Undone>,
    pub compensation_failures: Vec<CompensationFailure>,
    /// The calls whose effects stay (a commit), by step id.
    pub steps: Vec<String>,
}

/// The answer to a call.
#[derive(Clone, Debug)]
pub enum CallReply {
    Completed { transaction: String, step: String, output: Value, replayed: bool },
    Failed { transaction: String, step: Option<String>, error: ErrorInfo, ending: Option<Ending> },
}

/// What a transaction reports of itself.
#[derive(Clone, Debug, Serialize)]
pub struct Status {
    pub transaction: String,
    pub name: String,
    pub state: &'static str,
    pub steps: Vec<SessionStep>,
    pub in_flight: usize,
    pub timeout_ms: Option<u64>,
}

enum Command {
    Call(CallRequest, oneshot::Sender<CallReply>),
    End { commit: bool, reason: Option<ErrorInfo>, reply: oneshot::Sender<Ending> },
    Status { reply: oneshot::Sender<Status> },
}

/// One call, as a transaction takes it.
pub struct CallRequest {
    /// `<plugin>.<tool>`.
    pub tool: String,
    pub args: Value,
    /// The idempotency key the client named, if it did.
    pub client_key: Option<String>,
    /// Cancelled when the client cancels the request: the call stops and writes nothing.
    pub cancel: CancellationToken,
    /// Where the plugin's log messages also go.
    pub log: Option<Arc<dyn LogSink>>,
}

/// A handle on a running transaction; cheap to clone.
#[derive(Clone, Debug)]
pub struct Transaction {
    pub id: String,
    pub name: String,
    commands: mpsc::UnboundedSender<Command>,
}

/// Why a command could not reach its transaction.
#[derive(Clone, Debug, thiserror::Error)]
#[error("transaction '{0}' is closed (committed, aborted or rolled back); begin another with saga_begin")]
pub struct Closed(pub String);

impl Transaction {
    pub fn is_open(&self) -> bool {
        !self.commands.is_closed()
    }

    pub async fn call(&self, request: CallRequest) -> Result<CallReply, Closed> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Call(request, reply))?;
        answer.await.map_err(|_| self.closed())
    }

    /// Commits (`commit`) or aborts the transaction.
    pub async fn end(&self, commit: bool, reason: Option<ErrorInfo>) -> Result<Ending, Closed> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::End { commit, reason, reply })?;
        answer.await.map_err(|_| self.closed())
    }

    pub async fn status(&self) -> Result<Status, Closed> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Status { reply })?;
        answer.await.map_err(|_| self.closed())
    }

    fn send(&self, command: Command) -> Result<(), Closed> {
        self.commands.send(command).map_err(|_| self.closed())
    }

    fn closed(&self) -> Closed {
        Closed(self.id.clone())
    }
}

/// The open transactions, by id.
pub struct Transactions {
    context: Arc<Context>,
    open: Mutex<HashMap<String, Transaction>>,
}

/// Why a transaction could not begin.
#[derive(Debug, thiserror::Error)]
pub enum BeginError {
    #[error("cannot register transaction '{id}': {reason}")]
    Register { id: String, reason: String },
}

impl Transactions {
    pub fn new(context: Arc<Context>) -> Arc<Transactions> {
        Arc::new(Transactions { context, open: Mutex::new(HashMap::new()) })
    }

    pub fn context(&self) -> &Context {
        &self.context
    }

    pub fn get(&self, id: &str) -> Option<Transaction> {
        lock(&self.open).get(id).cloned()
    }

    pub fn open_count(&self) -> usize {
        lock(&self.open).len()
    }

    /// Begins a transaction (registered as a run when the server is durable).
    pub fn begin(self: &Arc<Self>, name: Option<&str>, timeout: Option<Duration>) -> Result<Transaction, BeginError> {
        let id = format!("tx-{}", crate::ids::new_run_id());
        let name = name.unwrap_or("session").to_string();
        if self.context.register_runs {
            let record =
                RunRecord::starting(&id, &format!("session:{name}"), SESSION_SOURCE, String::new(), &json!({}), 0);
            let backend = &*self.context.backend;
            crate::backend::blocking(backend, || backend.register_run(&record))
                .map_err(|e| BeginError::Register { id: id.clone(), reason: e.to_string() })?;
        }
        let (commands, inbox) = mpsc::unbounded_channel();
        let transaction = Transaction { id: id.clone(), name: name.clone(), commands };
        lock(&self.open).insert(id.clone(), transaction.clone());
        let owner = Arc::clone(self);
        tokio::spawn(async move { drive(&owner, &id, &name, timeout, inbox).await });
        Ok(transaction)
    }

    /// Ends every open transaction (the server is stopping): committed with `commit`, else
    /// aborted for `reason`.
    pub async fn end_all(&self, commit: bool, reason: ErrorInfo) {
        let open: Vec<Transaction> = lock(&self.open).values().cloned().collect();
        futures::future::join_all(open.iter().map(|t| t.end(commit, Some(reason.clone())))).await;
    }
}

/// The error that ends a transaction for a reason of the server's.
pub fn ending_reason(code: &str, message: impl Into<String>) -> ErrorInfo {
    ErrorInfo { code: code.into(), kind: FailureKind::Contained, message: message.into() }
}

/// A transaction's life: takes commands until it ends, then commits or compensates.
async fn drive(
    owner: &Transactions,
    id: &str,
    name: &str,
    timeout: Option<Duration>,
    mut inbox: mpsc::UnboundedReceiver<Command>,
) {
    let context = &*owner.context;
    let shell = session::shell(name, timeout);
    let options = RunOptions::new(id, json!({}));
    let session = Session::open(&context.runtime, &shell, &*context.backend, options);
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut idle_until = Instant::now() + context.idle_timeout;
    let mut running = FuturesUnordered::new();
    // Why the transaction ends, and who waits for the answer.
    let (commit, reason, waiter) = loop {
        tokio::select! {
            command = inbox.recv() => {
                idle_until = Instant::now() + context.idle_timeout;
                match command {
                    None => break (false, Some(ending_reason("closed", "the transaction's handle was dropped")), Waiter::None),
                    Some(Command::Call(request, reply)) => {
                        let session = &session;
                        running.push(async move { (run_call(session, request).await, reply) });
                    }
                    Some(Command::End { commit, reason, reply }) => break (commit, reason, Waiter::End(reply)),
                    Some(Command::Status { reply }) => {
                        let _ = reply.send(status(&session, name, "open", running.len(), timeout));
                    }
                }
            }
            Some((outcome, reply)) = running.next() => {
                idle_until = Instant::now() + context.idle_timeout;
                match outcome {
                    CallOutcome::TimedOut => break (false, Some(session.timeout_error()), Waiter::Call(reply, None, None)),
                    CallOutcome::Failed { step, error } if context.on_failure == OnFailure::Compensate && error.code != "cancelled" && step.is_some() => {
                        break (false, Some(error.clone()), Waiter::Call(reply, step, Some(error)));
                    }
                    outcome => { let _ = reply.send(call_reply(id, outcome)); }
                }
            }
            () = sleep_until(deadline) => break (false, Some(session.timeout_error()), Waiter::None),
            () = tokio::time::sleep_until(idle_until) => {
                break (false, Some(ending_reason("idle", format!("no request for {} s", context.idle_timeout.as_secs()))), Waiter::None)
            }
        }
    };
    // Calls in flight finish first: compensation must see every effect.
    let mut late = Vec::new();
    while let Some((outcome, reply)) = running.next().await {
        late.push((outcome, reply));
    }
    let report = if commit {
        session.commit().await
    } else {
        session.abort(reason.clone().unwrap_or_else(|| ending_reason("aborted", "aborted"))).await
    };
    let ending = ending(id, &report, commit, &waiter, reason);
    // Closed before anyone hears of it: a handle looked up after the answer is not open.
    inbox.close();
    lock(&owner.open).remove(id);
    for (outcome, reply) in late {
        let reply_value = match outcome {
            CallOutcome::Completed { step, .. } if !commit => CallReply::Failed {
                transaction: id.to_string(),
                step: Some(step),
                error: ending_reason("rolled_back", "the call completed, then the transaction was rolled back"),
                ending: Some(ending.clone()),
            },
            outcome => call_reply(id, outcome),
        };
        let _ = reply.send(reply_value);
    }
    match waiter {
        Waiter::End(reply) => {
            let _ = reply.send(ending);
        }
        Waiter::Call(reply, step, error) => {
            let error = error
                .unwrap_or_else(|| ending.reason.clone().unwrap_or_else(|| ending_reason("timed_out", "timed out")));
            let _ = reply.send(CallReply::Failed { transaction: id.to_string(), step, error, ending: Some(ending) });
        }
        Waiter::None => {
            tracing::info!(transaction = %id, status = ending.status, "transaction ended");
        }
    }
}

/// Who waits for a transaction's ending.
enum Waiter {
    None,
    End(oneshot::Sender<Ending>),
    /// The failed call that ended it.
    Call(oneshot::Sender<CallReply>, Option<String>, Option<ErrorInfo>),
}

/// One call of the session, stopped if its request is cancelled.
async fn run_call(session: &Session<'_>, request: CallRequest) -> CallOutcome {
    let CallRequest { tool, args, client_key, cancel, log } = request;
    let call = session.call(&tool, args, client_key.as_deref());
    let call = async {
        match log {
            Some(sink) => forwarding_logs(sink, call).await,
            None => call.await,
        }
    };
    tokio::select! {
        outcome = call => outcome,
        () = cancel.cancelled() => CallOutcome::Failed {
            step: None,
            error: ending_reason("cancelled", format!("{tool}: the request was cancelled; it wrote nothing")),
        },
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

fn call_reply(transaction: &str, outcome: CallOutcome) -> CallReply {
    let transaction = transaction.to_string();
    match outcome {
        CallOutcome::Completed { step, output, replayed } => {
            CallReply::Completed { transaction, step, output, replayed }
        }
        CallOutcome::Failed { step, error } => CallReply::Failed { transaction, step, error, ending: None },
        CallOutcome::TimedOut => CallReply::Failed {
            transaction,
            step: None,
            error: ending_reason("timed_out", "the transaction's time-out passed"),
            ending: None,
        },
    }
}

fn status(
    session: &Session<'_>,
    name: &str,
    state: &'static str,
    in_flight: usize,
    timeout: Option<Duration>,
) -> Status {
    Status {
        transaction: session.run_id().to_string(),
        name: name.to_string(),
        state,
        steps: session.steps(),
        in_flight,
        timeout_ms: timeout.map(|t| t.as_millis() as u64),
    }
}

fn ending(id: &str, report: &RunReport, commit: bool, waiter: &Waiter, reason: Option<ErrorInfo>) -> Ending {
    let tool_of = |step: &str| report.step(step).map(|s| (s.tool.clone(), s.compensator.clone()));
    let compensated = report
        .compensated
        .iter()
        .map(|step| {
            let (tool, compensator) = tool_of(step).unwrap_or_default();
            Undone { step: step.clone(), tool, compensator }
        })
        .collect();
    let status = match report.status {
        crate::saga::Status::Completed => "committed",
        crate::saga::Status::CompensationFailed => "compensation_failed",
        crate::saga::Status::TimedOut => "timed_out",
        crate::saga::Status::TakenOver => "taken_over",
        _ if matches!(waiter, Waiter::Call(..)) => "rolled_back",
        _ => "aborted",
    };
    let steps = if commit {
        report.steps.iter().filter(|s| s.status == crate::saga::StepStatus::Completed).map(|s| s.id.clone()).collect()
    } else {
        Vec::new()
    };
    Ending {
        transaction: id.to_string(),
        status,
        reason,
        compensated,
        compensation_failures: report.compensation_failures.clone(),
        steps,
    }
}
