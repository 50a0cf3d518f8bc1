//! Saga tools: `saga_<name>` runs a whole saga of `--sagas DIR` with the call's arguments as
//! its input, compensating on failure, and answers with its report. Each completed step
//! and compensation is a progress notification when the client asked for progress.

use std::sync::Arc;

use rmcp::model::{CallToolResult, ProgressNotificationParam, ProgressToken};
use rmcp::service::{Peer, RequestContext, RoleServer};
use serde_json::{Value, json};

use super::Server;
use super::handler::{error_result, ok_result};
use crate::backend::RunRecord;
use crate::saga::journal::{Event, EventKind, JournalSink};
use crate::saga::{self, RunOptions, Saga, Status};

/// Queues a progress notification for every step or compensation that completes (the
/// journal is written synchronously; [`forward_progress`] sends them, in order, before the
/// call's answer).
struct Progress {
    token: ProgressToken,
    total: f64,
    done: std::sync::atomic::AtomicU64,
    queue: tokio::sync::mpsc::UnboundedSender<ProgressNotificationParam>,
}

impl JournalSink for Progress {
    fn append(&self, events: &[Event]) {
        for event in events {
            let what = match event.event {
                EventKind::StepCompleted => "completed",
                EventKind::CompensationCompleted => "compensated",
                _ => continue,
            };
            let done = self.done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            let mut param = ProgressNotificationParam::new(self.token.clone(), done as f64);
            param.total = Some(self.total);
            param.message = Some(format!("{what} {}", event.step.as_deref().unwrap_or("?")));
            let _ = self.queue.send(param);
        }
    }
}

/// Sends queued progress notifications until the queue closes. A client that stops reading
/// delays them, never the saga: each gets a second.
async fn forward_progress(
    peer: Peer<RoleServer>,
    mut queue: tokio::sync::mpsc::UnboundedReceiver<ProgressNotificationParam>,
) {
    while let Some(param) = queue.recv().await {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), peer.notify_progress(param)).await;
    }
}

pub async fn run(
    server: &Server,
    saga: &Arc<Saga>,
    input: Value,
    context: &RequestContext<RoleServer>,
) -> CallToolResult {
    let context_ref = &server.transactions.context();
    let mut options = RunOptions::new(crate::ids::new_run_id(), input);
    options.seed = rand::random();
    let mut progress = None;
    if let Some(token) = context.meta.get_progress_token() {
        let (queue, queued) = tokio::sync::mpsc::unbounded_channel();
        progress = Some(tokio::spawn(forward_progress(context.peer.clone(), queued)));
        options.journal =
            Some(Arc::new(Progress { token, total: saga.plan.steps.len() as f64, done: Default::default(), queue }));
    }
    if context_ref.register_runs {
        // A resume re-reads the definition from the registry: it must be there.
        let registered = std::fs::read_to_string(&saga.path)
            .map_err(|e| format!("cannot read {}: {e}", saga.path.display()))
            .and_then(|definition| {
                let path = saga.path.display().to_string();
                let record =
                    RunRecord::starting(&options.run_id, &saga.name, &path, definition, &options.input, options.seed);
                let backend = &*context_ref.backend;
                crate::backend::blocking(backend, || backend.register_run(&record)).map_err(|e| e.to_string())
            });
        if let Err(e) = registered {
            return error_result(&e, json!({ "error": { "code": "host", "message": e } }));
        }
    }
    let report = saga::run(&context_ref.runtime, saga, &*context_ref.backend, options).await;
    if let Some(progress) = progress {
        // The run (and with it the queue's sender) is done: every notification goes out
        // before the answer.
        let _ = progress.await;
    }
    let summary = json!({
        "run_id": report.run_id,
        "saga": report.saga,
        "status": report.status,
        "output": report.output,
        "failed_step": report.failed_step,
        "error": report.error,
        "compensated": report.compensated,
        "compensation_failures": report.compensation_failures,
        "steps": report.steps,
        "changes": report.changes,
    });
    if report.status == Status::Completed {
        ok_result(summary, Default::default())
    } else {
        let message = match (&report.failed_step, &report.error) {
            (Some(step), Some(e)) => format!(
                "saga {} {} at step '{step}': {}; compensated: {}",
                report.saga,
                report.status.as_str(),
                e.message,
                report.compensated.join(", ")
            ),
            _ => format!("saga {} {}", report.saga, report.status.as_str()),
        };
        error_result(&message, summary)
    }
}
