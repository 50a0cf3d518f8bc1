//! What a saga run reports: its final status and everything a user needs to act on it.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::journal::{ErrorInfo, Event};
use crate::json::DocText;

/// How a run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Every step completed; `output` holds the saga's result.
    Completed,
    /// A step failed and every completed step was compensated.
    Failed,
    /// A step failed (or the saga timed out) and at least one compensation failed:
    /// `compensation_failures` and `residue` say what is left.
    CompensationFailed,
    /// The saga's time ran out and every completed step was compensated.
    TimedOut,
    /// Another process took the run over (this one's lease on it ran out while it stalled):
    /// this process stopped it there, and the new holder finishes it. Its final status is in
    /// the database's registry.
    TakenOver,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::CompensationFailed => "compensation_failed",
            Status::TimedOut => "timed_out",
            Status::TakenOver => "taken_over",
        }
    }
}

/// What became of one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepStatus {
    Completed,
    Failed,
    /// Its effect may have been applied (the reply was lost).
    Uncertain,
    Compensated,
    CompensationFailed,
    /// Never started (an earlier step failed, or the saga timed out first).
    NotRun,
    /// Stopped by the saga's time-out while running; it wrote nothing.
    Cancelled,
}

impl StepStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            StepStatus::Completed => "completed",
            StepStatus::Failed => "failed",
            StepStatus::Uncertain => "uncertain",
            StepStatus::Compensated => "compensated",
            StepStatus::CompensationFailed => "compensation_failed",
            StepStatus::NotRun => "not_run",
            StepStatus::Cancelled => "cancelled",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    pub id: String,
    pub tool: String,
    pub status: StepStatus,
    /// Attempts of the action.
    pub attempts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensator: Option<String>,
    /// Attempts of the compensator.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub compensation_attempts: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A compensation that gave up.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompensationFailure {
    pub step: String,
    pub tool: String,
    pub error: ErrorInfo,
}

/// A document this run changed, compared with before the run first touched it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NetChange {
    pub namespace: String,
    pub key: String,
    /// `added`, `removed` or `changed`.
    pub change: String,
    pub before: Option<DocText>,
    pub after: Option<DocText>,
}

/// The full account of a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    pub run_id: String,
    pub saga: String,
    pub status: Status,
    /// The saga's `output` bindings, resolved (completed runs).
    pub output: Option<Value>,
    /// The step whose failure started the rollback.
    pub failed_step: Option<String>,
    /// Why the saga failed (or timed out).
    pub error: Option<ErrorInfo>,
    /// Step ids in the order their compensations completed.
    pub compensated: Vec<String>,
    pub compensation_failures: Vec<CompensationFailure>,
    pub steps: Vec<StepReport>,
    /// Net changes of this run to the state, ledgers included.
    pub changes: Vec<NetChange>,
    /// For `compensation_failed`: the changes compensation did not undo (ledgers excluded).
    pub residue: Vec<NetChange>,
    pub events: Vec<Event>,
    pub duration_us: u64,
}

impl RunReport {
    pub fn step(&self, id: &str) -> Option<&StepReport> {
        self.steps.iter().find(|s| s.id == id)
    }

    /// Events of `kind` for `step`.
    pub fn events_of(&self, kind: super::journal::EventKind, step: &str) -> usize {
        self.events.iter().filter(|e| e.event == kind && e.step.as_deref() == Some(step)).count()
    }
}
