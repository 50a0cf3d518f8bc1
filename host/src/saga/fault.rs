//! Faults a run can be told to suffer, for tests and verification campaigns. Each fault
//! goes through the real path where there is one: traps, fuel exhaustion and deadlines are
//! injected into the running guest; a lost response commits the real effect and then drops
//! the reply.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Whether a fault hits a step's action or its compensator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Action,
    Compensation,
}

/// A fault and its parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// The tool refuses, as a business rule would; nothing runs.
    Rejected,
    /// The guest traps at its first store write.
    Trap,
    /// The guest runs out of fuel at its first store write.
    Fuel,
    /// The guest passes its deadline at its first store write.
    Timeout,
    /// The call runs and commits, then its reply is lost: the outcome is uncertain.
    LostResponse,
    /// The first `failures` attempts fail as transient; later ones run.
    Transient { failures: u32 },
    /// Every attempt fails as transient.
    Permanent,
    /// The call is delivered a second time after it succeeds, with the same idempotency key.
    Repeat,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::Rejected => f.write_str("rejected"),
            Fault::Trap => f.write_str("trap"),
            Fault::Fuel => f.write_str("fuel"),
            Fault::Timeout => f.write_str("timeout"),
            Fault::LostResponse => f.write_str("lost_response"),
            Fault::Transient { failures } => write!(f, "transient({failures})"),
            Fault::Permanent => f.write_str("permanent"),
            Fault::Repeat => f.write_str("repeat"),
        }
    }
}

/// Faults by step and phase.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct FaultPlan {
    faults: BTreeMap<String, BTreeMap<Phase, Fault>>,
}

impl FaultPlan {
    pub fn none() -> FaultPlan {
        FaultPlan::default()
    }

    /// A plan with one fault.
    pub fn single(step: &str, phase: Phase, fault: Fault) -> FaultPlan {
        FaultPlan::default().with(step, phase, fault)
    }

    pub fn with(mut self, step: &str, phase: Phase, fault: Fault) -> FaultPlan {
        self.faults.entry(step.to_string()).or_default().insert(phase, fault);
        self
    }

    pub fn get(&self, step: &str, phase: Phase) -> Option<Fault> {
        self.faults.get(step)?.get(&phase).copied()
    }

    pub fn is_empty(&self) -> bool {
        self.faults.is_empty()
    }

    /// `(step, phase, fault)` in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Phase, Fault)> {
        self.faults.iter().flat_map(|(step, by_phase)| by_phase.iter().map(move |(p, f)| (step.as_str(), *p, *f)))
    }
}
