//! The cases of a verification campaign: the clean run, every fault kind at every step,
//! transient and permanent failures of every compensator, every action and compensator
//! delivered twice, and random fault schedules drawn from the seed — and, for sagas with
//! steps that can run at once, every one of those again with the steps run concurrently.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::saga::{Fault, FaultPlan, Phase, Plan, RunReport, Saga, Status, StepStatus};

/// A kind of fault a campaign can inject (`--faults` takes a comma-separated list).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    Rejected,
    Trap,
    Fuel,
    Timeout,
    LostResponse,
    Transient,
    CompensatorTransient,
    CompensatorPermanent,
    Repeat,
    Random,
}

impl FaultKind {
    pub const ALL: [FaultKind; 10] = [
        FaultKind::Rejected,
        FaultKind::Trap,
        FaultKind::Fuel,
        FaultKind::Timeout,
        FaultKind::LostResponse,
        FaultKind::Transient,
        FaultKind::CompensatorTransient,
        FaultKind::CompensatorPermanent,
        FaultKind::Repeat,
        FaultKind::Random,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Rejected => "rejected",
            FaultKind::Trap => "trap",
            FaultKind::Fuel => "fuel",
            FaultKind::Timeout => "timeout",
            FaultKind::LostResponse => "lost_response",
            FaultKind::Transient => "transient",
            FaultKind::CompensatorTransient => "compensator_transient",
            FaultKind::CompensatorPermanent => "compensator_permanent",
            FaultKind::Repeat => "repeat",
            FaultKind::Random => "random",
        }
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for FaultKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        FaultKind::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            let names: Vec<&str> = FaultKind::ALL.iter().map(|k| k.name()).collect();
            format!("unknown fault kind '{s}' (one of: {})", names.join(", "))
        })
    }
}

/// Failures a transient fault injects before the call may succeed.
pub const TRANSIENT_FAILURES: u32 = 2;

/// What a case must end in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Expect {
    /// The clean run: completed runs must reach the expected state, failed ones restore.
    Baseline,
    /// The same as the clean run: same status, same final state.
    SameAsClean,
    /// Failed at this step, with the state restored.
    RolledBack { failed_step: String },
    /// Compensation of this step gave up; the residue must be reported exactly.
    CompensationFailed { step: String },
    /// Random schedules: whatever happens must keep the invariants.
    Invariants,
}

impl fmt::Display for Expect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expect::Baseline => f.write_str("the clean run: a completion at the expected state, or a full rollback"),
            Expect::SameAsClean => f.write_str("the clean run's outcome and state"),
            Expect::RolledBack { failed_step } => write!(f, "a failure at '{failed_step}' and a full rollback"),
            Expect::CompensationFailed { step } => {
                write!(f, "compensation_failed at '{step}' with its residue reported exactly")
            }
            Expect::Invariants => f.write_str("any outcome that keeps the rollback invariants"),
        }
    }
}

/// How a case's run schedules its steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// One step at a time in plan order, clocks and randomness drawn from the seed.
    Deterministic,
    /// Independent steps, and independent compensations, in flight together.
    Concurrent,
}

/// The end of a concurrent case's id: `<id of its deterministic twin>@concurrent`.
pub const CONCURRENT_SUFFIX: &str = "@concurrent";

/// One case of a campaign.
#[derive(Clone, Debug)]
pub struct Case {
    /// Stable id, used by `--case` to replay it.
    pub id: String,
    pub faults: FaultPlan,
    pub expect: Expect,
    pub mode: Mode,
}

impl Case {
    fn new(id: String, faults: FaultPlan, expect: Expect) -> Case {
        Case { id, faults, expect, mode: Mode::Deterministic }
    }

    /// The run without faults that every other case is judged against.
    pub fn clean() -> Case {
        Case::new("clean".into(), FaultPlan::none(), Expect::Baseline)
    }

    /// The same faults and expectation, with the steps run concurrently.
    pub fn concurrent(&self) -> Case {
        Case { id: format!("{}{CONCURRENT_SUFFIX}", self.id), mode: Mode::Concurrent, ..self.clone() }
    }
}

/// Builds the cases for `saga`, given its clean run.
pub fn build(saga: &Saga, clean: &RunReport, kinds: &[FaultKind], seed: u64, runs: usize) -> Vec<Case> {
    let plan = &saga.plan;
    let wanted = |k: FaultKind| kinds.contains(&k);
    let mut cases = vec![Case::clean()];
    let reached = |id: &str| clean.step(id).is_some_and(|s| s.attempts > 0);
    let succeeded =
        |id: &str| clean.step(id).is_some_and(|s| matches!(s.status, StepStatus::Completed | StepStatus::Compensated));

    for step in plan.steps.iter().filter(|s| reached(&s.id)) {
        let id = step.id.as_str();
        let action = |fault: Fault| FaultPlan::single(id, Phase::Action, fault);
        for (kind, fault) in [
            (FaultKind::Rejected, Fault::Rejected),
            (FaultKind::Trap, Fault::Trap),
            (FaultKind::Fuel, Fault::Fuel),
            (FaultKind::Timeout, Fault::Timeout),
        ] {
            if wanted(kind) {
                let expect = Expect::RolledBack { failed_step: id.into() };
                cases.push(Case::new(format!("{id}:{kind}"), action(fault), expect));
            }
        }
        // A lost response and a repeat need a call that succeeds.
        if wanted(FaultKind::LostResponse) && succeeded(id) {
            let expect = Expect::RolledBack { failed_step: id.into() };
            cases.push(Case::new(format!("{id}:lost_response"), action(Fault::LostResponse), expect));
        }
        if wanted(FaultKind::Transient) {
            // Absorbed by retries when the step has attempts to spare; else it fails there.
            let exhausted = succeeded(id) && TRANSIENT_FAILURES >= step.retry.max_attempts;
            let expect = if exhausted { Expect::RolledBack { failed_step: id.into() } } else { Expect::SameAsClean };
            cases.push(Case::new(
                format!("{id}:transient"),
                action(Fault::Transient { failures: TRANSIENT_FAILURES }),
                expect,
            ));
        }
        if wanted(FaultKind::Repeat) && succeeded(id) {
            cases.push(Case::new(format!("{id}:repeat"), action(Fault::Repeat), Expect::SameAsClean));
        }
    }

    // Compensator faults: each compensable step, with a failure after it to make it undo.
    for (index, step) in plan.steps.iter().enumerate() {
        if step.compensator.is_none() || !succeeded(&step.id) {
            continue;
        }
        let id = step.id.as_str();
        let (trigger, failed_step) = match &clean.failed_step {
            Some(natural) if clean.compensated.iter().any(|c| c == id) => (FaultPlan::none(), natural.clone()),
            _ => match plan.steps.iter().skip(index + 1).rfind(|s| reached(&s.id)) {
                Some(later) => (FaultPlan::single(&later.id, Phase::Action, Fault::Rejected), later.id.clone()),
                // Nothing runs after it: its compensator never runs.
                None => continue,
            },
        };
        let comp = |fault: Fault| trigger.clone().with(id, Phase::Compensation, fault);
        let rolled_back = Expect::RolledBack { failed_step: failed_step.clone() };
        if wanted(FaultKind::CompensatorTransient) {
            let gives_up = TRANSIENT_FAILURES >= plan.compensation_retry.max_attempts;
            let expect = if gives_up { Expect::CompensationFailed { step: id.into() } } else { rolled_back.clone() };
            cases.push(Case::new(
                format!("{id}:compensation:transient"),
                comp(Fault::Transient { failures: TRANSIENT_FAILURES }),
                expect,
            ));
        }
        if wanted(FaultKind::CompensatorPermanent) {
            cases.push(Case::new(
                format!("{id}:compensation:permanent"),
                comp(Fault::Permanent),
                Expect::CompensationFailed { step: id.into() },
            ));
        }
        if wanted(FaultKind::Repeat) {
            cases.push(Case::new(format!("{id}:compensation:repeat"), comp(Fault::Repeat), rolled_back));
        }
    }

    if wanted(FaultKind::Random) {
        cases.extend((0..runs).map(|r| random_case(saga, seed, r)));
    }
    if has_independent_steps(plan) {
        let twins: Vec<Case> = cases.iter().map(Case::concurrent).collect();
        cases.extend(twins);
    }
    cases
}

/// The case of `built` with this id; a random schedule beyond `--runs` is drawn on demand.
/// Empty when the saga has no such case.
pub fn select(saga: &Saga, built: Vec<Case>, id: &str, seed: u64) -> Vec<Case> {
    if let Some(case) = built.into_iter().find(|c| c.id == id) {
        return vec![case];
    }
    let (base, concurrent) = match id.strip_suffix(CONCURRENT_SUFFIX) {
        Some(base) => (base, true),
        None => (id, false),
    };
    let Some(r) = base.strip_prefix("random-").and_then(|r| r.parse().ok()) else { return Vec::new() };
    let case = random_case(saga, seed, r);
    match concurrent {
        false => vec![case],
        true if has_independent_steps(&saga.plan) => vec![case.concurrent()],
        true => Vec::new(),
    }
}

/// Whether two steps may be in flight together: neither needs the other, even indirectly.
pub fn has_independent_steps(plan: &Plan) -> bool {
    let ancestors = ancestors(plan);
    let related = |i: usize, j: usize| ancestors[i].contains(&j) || ancestors[j].contains(&i);
    (0..ancestors.len()).any(|i| (i + 1..ancestors.len()).any(|j| !related(i, j)))
}

/// Every step each step needs, directly or not.
fn ancestors(plan: &Plan) -> Vec<BTreeSet<usize>> {
    let deps = |i: usize| plan.steps.get(i).map(|s| s.deps.as_slice()).unwrap_or_default();
    (0..plan.steps.len())
        .map(|i| {
            let (mut seen, mut stack) = (BTreeSet::new(), deps(i).to_vec());
            while let Some(d) = stack.pop() {
                if seen.insert(d) {
                    stack.extend_from_slice(deps(d));
                }
            }
            seen
        })
        .collect()
}

/// The `r`-th random schedule of `saga` under `seed`: one to three faults on random steps.
pub fn random_case(saga: &Saga, seed: u64, r: usize) -> Case {
    let mut hasher = Sha256::new();
    hasher.update(seed.to_le_bytes());
    hasher.update(saga.name.as_bytes());
    hasher.update((r as u64).to_le_bytes());
    let mut rng = ChaCha8Rng::from_seed(hasher.finalize().into());
    let steps = &saga.plan.steps;
    let mut faults = FaultPlan::none();
    for _ in 0..rng.random_range(1..=3) {
        let step = &steps[rng.random_range(0..steps.len())];
        if step.compensator.is_some() && rng.random_bool(0.3) {
            let fault = match rng.random_range(0..3) {
                0 => Fault::Transient { failures: rng.random_range(1..=3) },
                1 => Fault::Permanent,
                _ => Fault::Repeat,
            };
            faults = faults.with(&step.id, Phase::Compensation, fault);
        } else {
            let fault = match rng.random_range(0..7) {
                0 => Fault::Rejected,
                1 => Fault::Trap,
                2 => Fault::Fuel,
                3 => Fault::Timeout,
                4 => Fault::LostResponse,
                5 => Fault::Transient { failures: rng.random_range(1..=3) },
                _ => Fault::Repeat,
            };
            faults = faults.with(&step.id, Phase::Action, fault);
        }
    }
    Case::new(format!("random-{r}"), faults, Expect::Invariants)
}

/// Whether a run's status is a rollback (the state must be back where it started).
pub fn rolled_back(status: Status) -> bool {
    matches!(status, Status::Failed | Status::TimedOut)
}
