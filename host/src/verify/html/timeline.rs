//! A case's run as the report page draws it: one lane per step, a bar per attempt of its
//! action or compensator, placed on logical time (the order of the run's journal events),
//! never on the wall clock, so the same seed draws the same picture.

use serde::Serialize;

use crate::saga::journal::EventKind;
use crate::saga::{FaultPlan, Phase, Plan, RunReport};

/// The error code of a call whose effect committed but whose reply was lost.
const LOST_RESPONSE: &str = "lost_response";

/// A step of the saga, as a lane of its timelines.
#[derive(Clone, Debug, Serialize)]
pub struct Lane {
    pub id: String,
    /// The step's display name, if it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub tool: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compensator: Option<String>,
}

impl Lane {
    /// The lanes of `plan`, in plan order (the lane numbers of [`Bar`] and [`FaultMark`]).
    pub fn of(plan: &Plan) -> Vec<Lane> {
        let lane = |s: &crate::saga::plan::PlannedStep| Lane {
            id: s.id.clone(),
            name: s.name.clone(),
            tool: s.tool.clone(),
            compensator: s.compensator.as_ref().map(|c| c.tool.clone()),
        };
        plan.steps.iter().map(lane).collect()
    }
}

/// How one attempt (one bar) ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Completed,
    Failed,
    /// Failed as transient, and was tried again.
    Retried,
    /// Its effect committed, its reply was lost.
    Lost,
    /// A second delivery of a call that had already succeeded.
    Repeat,
    /// Started and never ended (the saga's deadline stopped it).
    Open,
}

/// One attempt: `[lane, phase (0 action, 1 compensation), first tick, last tick, outcome,
/// attempt]`, an array to keep pages of thousands of cases small.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Bar(pub usize, pub u8, pub u32, pub u32, pub Outcome, pub u32);

/// An injected fault: `[lane, phase, fault, tick of the first attempt it hit]`; no tick
/// when the run never reached the faulted call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FaultMark(pub usize, pub u8, pub String, pub Option<u32>);

/// A deterministic case's run on logical time: every step or compensation event of its
/// journal is one tick.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Timeline {
    pub ticks: u32,
    pub bars: Vec<Bar>,
    pub faults: Vec<FaultMark>,
    /// The tick at which compensation was triggered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rollback_at: Option<u32>,
    /// The failure that ended the forward run: `code: message`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

fn phase_number(phase: Phase) -> u8 {
    match phase {
        Phase::Action => 0,
        Phase::Compensation => 1,
    }
}

impl Timeline {
    /// The timeline of `run`, a run of `plan` under `faults`.
    pub fn of(run: &RunReport, plan: &Plan, faults: &FaultPlan) -> Timeline {
        let lane_of = |id: &str| plan.steps.iter().position(|s| s.id == id);
        let mut timeline = Timeline::default();
        // The attempt in flight per (lane, phase): its first tick and number.
        let mut open: std::collections::BTreeMap<(usize, u8), (u32, u32)> = Default::default();
        for event in &run.events {
            use EventKind::*;
            let tick = timeline.ticks;
            let phase = match event.event {
                StepStarted | StepCompleted | StepFailed | StepRetried => 0,
                CompensationStarted
                | CompensationCompleted
                | CompensationUncertain
                | CompensationFailed
                | CompensationRetried => 1,
                CompensationTriggered => {
                    timeline.rollback_at.get_or_insert(tick);
                    timeline.ticks += 1;
                    continue;
                }
                SagaStarted | SagaResumed | SagaFinished => continue,
            };
            let Some(lane) = event.step.as_deref().and_then(lane_of) else { continue };
            timeline.ticks += 1;
            let attempt = event.attempt.unwrap_or(1);
            let outcome = match event.event {
                StepStarted | CompensationStarted => {
                    open.insert((lane, phase), (tick, attempt));
                    continue;
                }
                StepCompleted | CompensationCompleted if open.contains_key(&(lane, phase)) => Outcome::Completed,
                StepCompleted | CompensationCompleted => Outcome::Repeat,
                StepFailed if event.error.as_ref().is_some_and(|e| e.code == LOST_RESPONSE) => Outcome::Lost,
                CompensationUncertain => Outcome::Lost,
                StepRetried | CompensationRetried => Outcome::Retried,
                _ => Outcome::Failed,
            };
            let (start, attempt) = open.remove(&(lane, phase)).unwrap_or((tick, attempt));
            timeline.bars.push(Bar(lane, phase, start, tick, outcome, attempt));
        }
        let last = timeline.ticks.saturating_sub(1);
        timeline.bars.extend(
            open.into_iter().map(|((lane, phase), (start, n))| Bar(lane, phase, start, last, Outcome::Open, n)),
        );
        timeline.bars.sort_by_key(|b| (b.2, b.3));
        timeline.faults = faults
            .iter()
            .filter_map(|(step, phase, fault)| {
                let (lane, phase) = (lane_of(step)?, phase_number(phase));
                let hit = timeline.bars.iter().find(|b| b.0 == lane && b.1 == phase).map(|b| b.2);
                Some(FaultMark(lane, phase, fault.to_string(), hit))
            })
            .collect();
        timeline.error = run.error.as_ref().map(|e| format!("{}: {}", e.code, e.message));
        timeline
    }
}
