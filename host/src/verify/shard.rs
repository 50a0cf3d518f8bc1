//! Sharded campaigns: `verify --shard I/N --shard-report FILE` runs the I-th of N parts of
//! every saga's cases (each saga's case K goes to shard K mod N + 1), on any machine;
//! `verify --merge FILE…`, given the same sagas and options, puts the parts together into
//! the report one process would have written, byte for byte.
//!
//! A case's outcome depends only on the seed, the plugins, the saga and its fixture, never
//! on which process ran it: so shards need no coordination, and the merge checks that the
//! parts were run with the same options and cover every case exactly once.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{CampaignOptions, CampaignReport, CaseOutcome, FaultKind, Percentiles, Prepared, Timing};
use crate::runtime::Runtime;

/// One part of N of a campaign.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// From 1.
    pub index: usize,
    pub count: usize,
}

impl Shard {
    /// Whether the case at `position` among its saga's cases is this shard's.
    pub fn takes(&self, position: usize) -> bool {
        position % self.count == self.index - 1
    }
}

impl std::str::FromStr for Shard {
    type Err = String;

    fn from_str(text: &str) -> Result<Shard, String> {
        let parsed = text.split_once('/').and_then(|(i, n)| Some((i.parse().ok()?, n.parse().ok()?)));
        match parsed {
            Some((index, count)) if (1..=count).contains(&index) => Ok(Shard { index, count }),
            _ => Err(format!("'{text}': expected I/N with 1 <= I <= N, e.g. 2/4")),
        }
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// What a shard writes: its cases' outcomes, and what the merge checks them against.
#[derive(Debug, Serialize, Deserialize)]
pub struct ShardReport {
    pub sagabox: String,
    pub shard: String,
    pub seed: u64,
    pub runs: usize,
    pub faults: Vec<FaultKind>,
    pub sagas: Vec<ShardSaga>,
    pub timing: Timing,
}

/// One saga's part of a shard.
#[derive(Debug, Serialize, Deserialize)]
pub struct ShardSaga {
    pub saga: String,
    pub file: PathBuf,
    pub fixture_digest: String,
    /// Each case's outcome, by its position among the saga's cases.
    pub cases: Vec<(usize, CaseOutcome)>,
}

/// Why shards cannot be merged.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    #[error("{file}: {problem}")]
    Shard { file: String, problem: String },
    #[error("the shards do not cover the campaign: {0}")]
    Coverage(String),
}

/// Runs this shard's cases (`options.shard` chose them when the campaign was prepared).
pub async fn run(
    runtime: &Arc<Runtime>,
    prepared: &Prepared,
    options: &CampaignOptions,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> ShardReport {
    let (outcomes, timing) = super::run_cases(runtime, prepared, options, progress).await;
    let sagas = prepared
        .sagas
        .iter()
        .zip(outcomes)
        .map(|(saga, cases)| ShardSaga {
            saga: saga.subject.saga.name.clone(),
            file: saga.subject.saga.path.clone(),
            fixture_digest: saga.subject.initial.digest(),
            cases,
        })
        .collect();
    ShardReport {
        sagabox: env!("CARGO_PKG_VERSION").to_string(),
        shard: options.shard.map_or_else(|| "1/1".to_string(), |s| s.to_string()),
        seed: options.seed,
        runs: options.runs,
        faults: options.kinds.clone(),
        sagas,
        timing,
    }
}

/// The campaign's report from its shards. `prepared` is the whole campaign (no shard).
pub fn merge(
    runtime: &Runtime,
    prepared: Prepared,
    options: &CampaignOptions,
    shards: Vec<(PathBuf, ShardReport)>,
) -> Result<(CampaignReport, Timing), MergeError> {
    let count = check_shards(&shards, options)?;
    let mut outcomes: Vec<Vec<(usize, CaseOutcome)>> = prepared.sagas.iter().map(|_| Vec::new()).collect();
    let timings: Vec<Timing> = shards.iter().map(|(_, s)| s.timing.clone()).collect();
    for (file, shard) in shards {
        let fail = |problem: String| MergeError::Shard { file: file.display().to_string(), problem };
        if shard.sagas.len() != prepared.sagas.len() {
            return Err(fail(format!("{} sagas, the campaign has {}", shard.sagas.len(), prepared.sagas.len())));
        }
        for ((part, saga), outcomes) in shard.sagas.into_iter().zip(&prepared.sagas).zip(&mut outcomes) {
            let subject = &saga.subject;
            if part.saga != subject.saga.name || part.fixture_digest != subject.initial.digest() {
                return Err(fail(format!(
                    "saga '{}' with fixture {} where the campaign has '{}' with {}",
                    part.saga,
                    part.fixture_digest,
                    subject.saga.name,
                    subject.initial.digest()
                )));
            }
            outcomes.extend(part.cases);
        }
    }
    for (outcomes, saga) in outcomes.iter_mut().zip(&prepared.sagas) {
        outcomes.sort_by_key(|(position, _)| *position);
        let positions: Vec<usize> = outcomes.iter().map(|(p, _)| *p).collect();
        if positions != (0..saga.cases.len()).collect::<Vec<_>>() {
            return Err(MergeError::Coverage(format!(
                "saga '{}' has {} cases; the {count} shards hold positions {:?}",
                saga.subject.saga.name,
                saga.cases.len(),
                positions
            )));
        }
    }
    let report = super::assemble(runtime, prepared, outcomes, options);
    Ok((report, merged_timing(&timings)))
}

/// Checks that the shards are the N parts of one campaign run as `options` says; returns N.
fn check_shards(shards: &[(PathBuf, ShardReport)], options: &CampaignOptions) -> Result<usize, MergeError> {
    let fail = |file: &Path, problem: String| MergeError::Shard { file: file.display().to_string(), problem };
    let mut seen = Vec::new();
    for (file, shard) in shards {
        let parsed: Shard = shard.shard.parse().map_err(|e| fail(file, format!("shard {e}")))?;
        if shard.seed != options.seed || shard.runs != options.runs || shard.faults != options.kinds {
            return Err(fail(
                file,
                format!(
                    "ran with --seed {} --runs {} --faults {:?}; the merge has --seed {} --runs {} --faults {:?}",
                    shard.seed, shard.runs, shard.faults, options.seed, options.runs, options.kinds
                ),
            ));
        }
        seen.push(parsed);
    }
    let count = seen.first().map_or(0, |s| s.count);
    let mut indices: Vec<usize> = seen.iter().map(|s| s.index).collect();
    indices.sort_unstable();
    if count == 0 || seen.iter().any(|s| s.count != count) || indices != (1..=count).collect::<Vec<_>>() {
        let names: Vec<String> = seen.iter().map(Shard::to_string).collect();
        return Err(MergeError::Coverage(format!("got shards {}; each of 1/N … N/N is needed once", names.join(", "))));
    }
    Ok(count)
}

/// The shards ran side by side: the campaign took as long as the slowest. Percentiles of
/// rollback latency cannot be merged exactly; the largest of each is kept.
fn merged_timing(timings: &[Timing]) -> Timing {
    let cases = timings.iter().map(|t| t.cases).sum();
    let seconds = timings.iter().map(|t| t.seconds).fold(0.0, f64::max);
    let max = |f: fn(&Percentiles) -> u64| timings.iter().map(|t| f(&t.rollback_latency_us)).max().unwrap_or(0);
    Timing {
        cases,
        seconds,
        cases_per_second: cases as f64 / seconds.max(1e-9),
        rollback_latency_us: Percentiles {
            p50: max(|p| p.p50),
            p90: max(|p| p.p90),
            p99: max(|p| p.p99),
            max: max(|p| p.max),
        },
    }
}
