//! Sagas: multi-step workflows of tool calls that roll back what they did when a step fails.
//!
//! - [`definition`]: the saga file format;
//! - [`binding`]: `$.input…` / `$.steps.<id>…` bindings;
//! - [`plan`]: validation against the loaded plugins;
//! - [`engine`]: execution, retries, time-outs, idempotency and compensation;
//! - [`journal`], [`report`]: what a run records and returns;
//! - [`fault`]: faults a run can be told to suffer;
//! - [`session`]: sagas whose steps arrive one call at a time (an agent's session).

pub mod binding;
pub mod definition;
pub mod engine;
pub mod fault;
pub mod journal;
pub mod plan;
pub mod report;
pub mod session;

use std::path::{Path, PathBuf};

pub use definition::{Companions, SagaDef};
pub use engine::{RunOptions, run};
pub use fault::{Fault, FaultPlan, Phase};
pub use plan::{Plan, Problems};
pub use report::{RunReport, Status, StepStatus};

use crate::runtime::Runtime;

/// A saga read from a file and validated against the loaded plugins.
#[derive(Clone, Debug)]
pub struct Saga {
    /// The definition's `name`, or the file's stem.
    pub name: String,
    pub path: PathBuf,
    pub definition: SagaDef,
    pub plan: Plan,
    /// Its input, fixture and expected state, found by naming convention.
    pub companions: Companions,
}

/// Why a saga cannot run.
#[derive(Debug, thiserror::Error)]
pub enum SagaError {
    #[error(transparent)]
    Definition(#[from] definition::DefinitionError),
    #[error(transparent)]
    Invalid(#[from] Problems),
}

impl Saga {
    /// Reads and validates the saga at `path`.
    pub fn load(path: &Path, runtime: &Runtime) -> Result<Saga, SagaError> {
        Saga::build(definition::read(path)?, path, runtime)
    }

    /// Validates a saga from its text (as a durable run recorded it); `path` names it.
    pub fn from_text(text: &str, path: &Path, runtime: &Runtime) -> Result<Saga, SagaError> {
        Saga::build(definition::parse(text, path)?, path, runtime)
    }

    fn build(definition: SagaDef, path: &Path, runtime: &Runtime) -> Result<Saga, SagaError> {
        let plan = plan::plan(&definition, path, runtime)?;
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("saga").to_string();
        Ok(Saga {
            name: definition.name.clone().unwrap_or(stem),
            path: path.to_path_buf(),
            definition,
            plan,
            companions: Companions::of(path),
        })
    }
}

/// The saga files named by `paths`: files as given, directories expanded to their `*.json`
/// files that are not companions (`*.input.json`, `*.fixture.json`, `*.expected.json`).
pub fn saga_files(paths: &[PathBuf]) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for path in paths {
        if path.is_dir() {
            let mut found: Vec<PathBuf> = std::fs::read_dir(path)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "json") && !definition::is_companion(p))
                .collect();
            found.sort();
            out.extend(found);
        } else {
            out.push(path.clone());
        }
    }
    Ok(out)
}
