//! Saga files: the JSON form of the saga IR (the AgentGateway format, accepted as-is) plus
//! sagabox's optional extensions.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::runtime::LimitOverrides;

/// A saga file: `{"saga": {...}}`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SagaFile {
    pub saga: SagaDef,
}

/// A saga definition.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SagaDef {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    pub steps: Vec<StepDef>,
    /// Time for the whole saga's forward steps; when it passes, completed steps are compensated.
    #[serde(default)]
    pub timeout: Option<DurationSpec>,
    /// Bindings of the saga's result (see [`super::binding`]).
    #[serde(default)]
    pub output: Option<Value>,
    /// Namespaces that hold append-only audit records: excluded from rollback equality.
    #[serde(default)]
    pub ledgers: Vec<String>,
    /// Retry policy of compensators (default: [`RetryPolicy::compensation`]).
    #[serde(default)]
    pub compensation_retry: Option<RetryPolicy>,
}

/// One step: a tool call and how to undo it.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepDef {
    pub id: String,
    #[serde(default)]
    pub name: Option<String>,
    pub action: ToolCallDef,
    /// The compensator; when absent, the one the tool's manifest names.
    #[serde(default)]
    pub compensate: Option<ToolCallDef>,
    /// The step's input: a binding, an object of bindings, or a literal; merged over
    /// `action.arguments`.
    #[serde(default)]
    pub input: Option<Value>,
    /// Steps this one needs. When any step of a saga has `depends_on`, the saga is a DAG and
    /// a step without it is a root; otherwise steps run in file order.
    #[serde(default, alias = "dependsOn")]
    pub depends_on: Option<Vec<String>>,
    #[serde(default)]
    pub retry: Option<RetryPolicy>,
    /// Deadline of each attempt of the step.
    #[serde(default)]
    pub timeout: Option<DurationSpec>,
    /// Limits laid over the tool's policy for this step's calls.
    #[serde(default)]
    pub limits: Option<LimitOverrides>,
    /// States that this side-effecting step needs no compensation.
    #[serde(default)]
    pub no_compensation: bool,
}

/// A tool and its static arguments (which may hold bindings).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCallDef {
    pub name: String,
    #[serde(default = "empty_object")]
    pub arguments: Value,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

/// When and how often a transient failure is retried. Delays grow from `backoff` by
/// `multiplier` up to `max_backoff`; each is shortened by up to `jitter` of itself, drawn
/// from the run's seed.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    #[serde(default = "RetryPolicy::default_attempts")]
    pub max_attempts: u32,
    #[serde(default = "RetryPolicy::default_backoff")]
    pub backoff: DurationSpec,
    #[serde(default = "RetryPolicy::default_multiplier")]
    pub multiplier: f64,
    #[serde(default = "RetryPolicy::default_max_backoff")]
    pub max_backoff: DurationSpec,
    #[serde(default = "RetryPolicy::default_jitter")]
    pub jitter: f64,
}

impl RetryPolicy {
    fn default_attempts() -> u32 {
        3
    }
    fn default_backoff() -> DurationSpec {
        DurationSpec(Duration::from_millis(50))
    }
    fn default_multiplier() -> f64 {
        2.0
    }
    fn default_max_backoff() -> DurationSpec {
        DurationSpec(Duration::from_secs(2))
    }
    fn default_jitter() -> f64 {
        0.5
    }

    /// The default for compensators: more patient, since giving up leaves residue.
    pub fn compensation() -> RetryPolicy {
        RetryPolicy { max_attempts: 5, ..RetryPolicy::default() }
    }

    /// The delay before attempt `attempt + 1`, given a jitter draw in [0, 1).
    pub fn delay(&self, attempt: u32, draw: f64) -> Duration {
        let base = self.backoff.0.as_secs_f64() * self.multiplier.powi(attempt.saturating_sub(1) as i32);
        let capped = base.min(self.max_backoff.0.as_secs_f64());
        Duration::from_secs_f64((capped * (1.0 - self.jitter * draw)).max(0.0))
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: Self::default_attempts(),
            backoff: Self::default_backoff(),
            multiplier: Self::default_multiplier(),
            max_backoff: Self::default_max_backoff(),
            jitter: Self::default_jitter(),
        }
    }
}

/// A duration written `"30s"`, `"250ms"`, `"2m"`, `"1h"`, or as a number of milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DurationSpec(pub Duration);

impl DurationSpec {
    pub fn parse(text: &str) -> Result<DurationSpec, String> {
        let text = text.trim();
        let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
        let (number, unit) = text.split_at(split);
        let value: f64 = number.parse().map_err(|_| format!("'{text}' is not a duration like \"30s\" or \"250ms\""))?;
        let seconds = match unit.trim() {
            "ms" => value / 1000.0,
            "s" | "" => value,
            "m" | "min" => value * 60.0,
            "h" => value * 3600.0,
            other => return Err(format!("unknown unit '{other}' in '{text}' (use ms, s, m or h)")),
        };
        if !(0.0..=1e9).contains(&seconds) {
            return Err(format!("'{text}' is out of range"));
        }
        Ok(DurationSpec(Duration::from_secs_f64(seconds)))
    }
}

impl fmt::Display for DurationSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0.as_millis())
    }
}

impl<'de> Deserialize<'de> for DurationSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::String(s) => DurationSpec::parse(&s).map_err(serde::de::Error::custom),
            Value::Number(n) => n
                .as_u64()
                .map(|ms| DurationSpec(Duration::from_millis(ms)))
                .ok_or_else(|| serde::de::Error::custom("a duration in milliseconds must be a whole number")),
            other => Err(serde::de::Error::custom(format!("expected a duration like \"30s\", got {other}"))),
        }
    }
}

impl Serialize for DurationSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Why a saga file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DefinitionError {
    #[error("cannot read saga {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("saga {path}: {error}")]
    Parse { path: PathBuf, error: serde_json::Error },
}

/// Reads and parses a saga file.
pub fn read(path: &Path) -> Result<SagaDef, DefinitionError> {
    let text = std::fs::read_to_string(path).map_err(|error| DefinitionError::Io { path: path.into(), error })?;
    parse(&text, path)
}

/// Parses saga text; `path` names it in errors.
pub fn parse(text: &str, path: &Path) -> Result<SagaDef, DefinitionError> {
    let file: SagaFile =
        serde_json::from_str(text).map_err(|error| DefinitionError::Parse { path: path.into(), error })?;
    Ok(file.saga)
}

/// The files that go with a saga by naming convention: for `x.json`, its input
/// `x.input.json`, its fixture `x.fixture.json` (or a directory `x.fixture/`), and the
/// state a completed run must reach, `x.expected.json`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Companions {
    pub input: Option<PathBuf>,
    pub fixture: Option<PathBuf>,
    pub expected: Option<PathBuf>,
}

impl Companions {
    pub fn of(saga: &Path) -> Companions {
        let stem = saga.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
        let sibling = |suffix: &str| {
            let path = saga.with_file_name(format!("{stem}.{suffix}"));
            path.exists().then_some(path)
        };
        Companions {
            input: sibling("input.json"),
            fixture: sibling("fixture.json").or_else(|| sibling("fixture")),
            expected: sibling("expected.json"),
        }
    }
}

/// Whether `path` is a companion file rather than a saga.
pub fn is_companion(path: &Path) -> bool {
    let name = path.file_name().and_then(|s| s.to_str()).unwrap_or_default();
    [".input.json", ".fixture.json", ".expected.json"].iter().any(|suffix| name.ends_with(suffix))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(DurationSpec::parse("30s").unwrap().0, Duration::from_secs(30));
        assert_eq!(DurationSpec::parse("250ms").unwrap().0, Duration::from_millis(250));
        assert_eq!(DurationSpec::parse("1.5m").unwrap().0, Duration::from_secs(90));
        assert!(DurationSpec::parse("soon").is_err());
        assert!(DurationSpec::parse("5 parsecs").unwrap_err().contains("unknown unit"));
        let from_number: DurationSpec = serde_json::from_str("1500").unwrap();
        assert_eq!(from_number.0, Duration::from_millis(1500));
    }

    #[test]
    fn backoff_grows_caps_and_jitters() {
        let policy = RetryPolicy::default();
        assert_eq!(policy.delay(1, 0.0), Duration::from_millis(50));
        assert_eq!(policy.delay(2, 0.0), Duration::from_millis(100));
        assert_eq!(policy.delay(20, 0.0), Duration::from_secs(2));
        assert_eq!(policy.delay(1, 1.0), Duration::from_millis(25));
    }

    #[test]
    fn the_agentgateway_example_parses_and_typos_are_named() {
        let text = r#"{"saga": {"steps": [{"id": "a", "name": "A",
            "action": {"name": "p.t", "arguments": {}}, "compensate": {"name": "p.u", "arguments": {}},
            "input": {"path": "$.input.x"}}], "timeout": "30s", "output": {"x": {"path": "$.steps.a.x"}}}}"#;
        let saga: SagaFile = serde_json::from_str(text).unwrap();
        assert_eq!(saga.saga.timeout.unwrap().0, Duration::from_secs(30));
        let typo = r#"{"saga": {"steps": [], "timout": "30s"}}"#;
        let e = serde_json::from_str::<SagaFile>(typo).unwrap_err().to_string();
        assert!(e.contains("unknown field `timout`"), "{e}");
    }
}
