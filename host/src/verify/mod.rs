//! Rollback verification campaigns: run a saga from one fixture snapshot under every fault
//! the campaign knows, and check after each run that the state is what it must be — the
//! initial state after a rollback, the clean run's state after a completion, the exact
//! reported residue after a compensation that gave up.
//!
//! Runs are deterministic (see [`RunOptions::deterministic`]) and every case of a saga uses
//! the same run id, so the same seed, plugins, saga and fixture give a byte-identical
//! report; wall-clock numbers live apart from it, in [`Timing`]. Sagas with independent
//! steps also run every case concurrently ([`Mode::Concurrent`]); those cases report only
//! what scheduling cannot change: verdict, final status and state digests.

pub mod cases;
pub mod html;
pub mod shard;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use cases::{Case, Expect, FaultKind, Mode};

use crate::backend::MemoryBackend;
use crate::runtime::Runtime;
use crate::saga::{self, FaultPlan, Phase, RunOptions, RunReport, Saga, Status, StepStatus};
use crate::store::{DiffEntry, State, changed_keys, diff};

/// What a campaign runs.
#[derive(Clone, Debug)]
pub struct CampaignOptions {
    pub seed: u64,
    /// Random fault schedules per saga.
    pub runs: usize,
    pub kinds: Vec<FaultKind>,
    /// Run only the case with this id.
    pub only_case: Option<String>,
    /// Cases in flight at once (each case is deterministic on its own).
    pub concurrency: usize,
    /// Called in each case's task before the case runs.
    pub on_case: Option<CaseHook>,
    /// Run only this shard's part of every saga's cases ([`shard`]).
    pub shard: Option<shard::Shard>,
    /// Draw each deterministic case's timeline (for `--html`); off, a case costs less.
    pub timelines: bool,
    /// The fixture every subject's `initial` was loaded from instead of its saga's own
    /// `<saga>.fixture.json` (`verify --state`), if one was given; replay commands name it.
    pub state: Option<PathBuf>,
    /// The global options that chose the plugins (`--no-bundled`, `--plugins DIR`…,
    /// `--operator FILE`), repeated in every replay command.
    pub replay_plugin_args: Vec<String>,
}

/// A function every case's task calls before the case runs: a way to observe cases, and for
/// tests to provoke a failure inside one.
#[derive(Clone)]
pub struct CaseHook(pub Arc<dyn Fn(&Case) + Send + Sync>);

impl std::fmt::Debug for CaseHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CaseHook")
    }
}

impl Default for CampaignOptions {
    fn default() -> Self {
        CampaignOptions {
            seed: 0,
            runs: 20,
            kinds: FaultKind::ALL.to_vec(),
            only_case: None,
            concurrency: 2,
            on_case: None,
            shard: None,
            timelines: false,
            state: None,
            replay_plugin_args: Vec::new(),
        }
    }
}

/// A saga ready for a campaign: its starting state, input and expected final state.
#[derive(Clone, Debug)]
pub struct Subject {
    pub saga: Arc<Saga>,
    pub initial: State,
    pub input: Value,
    /// `{namespace: {key: document or null}}` that a completed run must match.
    pub expected: Option<Value>,
}

/// How a case ended against what it had to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Pass,
    Fail,
}

/// One case in the report.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CaseReport {
    pub id: String,
    pub mode: Mode,
    pub faults: FaultPlan,
    pub expected: Expect,
    pub observed: Status,
    /// Left out of concurrent cases: which of two faulted branches fails first is a race.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed_step: Option<String>,
    /// Step ids in the order their compensations completed (left out of concurrent cases).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub compensated: Vec<String>,
    /// Sorted in concurrent cases.
    pub compensation_failed: Vec<String>,
    pub digest_before: String,
    pub digest_after: String,
    /// What differs from the state the case had to end in (ledgers excluded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub diff: Vec<DiffEntry>,
    /// Records the run added to or changed in ledger namespaces (not part of the equality).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ledger_changes: Vec<String>,
    pub verdict: Verdict,
    pub reason: String,
    /// The command that runs this case again.
    pub replay: String,
    /// The run drawn on logical time, for `--html` (deterministic cases only).
    #[serde(skip)]
    pub timeline: Option<html::Timeline>,
}

/// Campaign metrics of one saga (or all).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Metrics {
    pub cases: usize,
    pub passed: usize,
    pub failed: usize,
    /// Rolled-back runs whose state was restored, over all rolled-back runs.
    pub rollback_success_rate: f64,
    /// Executed side-effecting steps that had a compensator, over all executed side-effecting steps.
    pub compensation_coverage: f64,
    /// Compensations that succeeded, over compensator attempts (1.0: every undo worked at once).
    pub compensation_efficiency: f64,
    #[serde(skip)]
    counts: Counts,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct Counts {
    rolled_back: usize,
    restored: usize,
    side_effects: usize,
    covered: usize,
    compensations: usize,
    compensation_attempts: usize,
}

impl Metrics {
    fn add(&mut self, case: &CaseReport, run: &RunReport, saga: &Saga) {
        self.cases += 1;
        match case.verdict {
            Verdict::Pass => self.passed += 1,
            Verdict::Fail => self.failed += 1,
        }
        let c = &mut self.counts;
        if cases::rolled_back(run.status) {
            c.rolled_back += 1;
            c.restored += usize::from(case.digest_after == case.digest_before);
        }
        // Which steps a concurrent run started before a failure stopped it is a race; the
        // ratios below count deterministic runs only, so the report stays reproducible.
        if case.mode == Mode::Deterministic {
            self.add_steps(run, saga);
        }
        self.finish();
    }

    /// The metrics of one judged case, from its verdict and what it counted.
    fn of_case(verdict: Verdict, counts: Counts) -> Metrics {
        let mut metrics = Metrics { cases: 1, counts, ..Metrics::default() };
        match verdict {
            Verdict::Pass => metrics.passed = 1,
            Verdict::Fail => metrics.failed = 1,
        }
        metrics.finish();
        metrics
    }

    /// A case whose task panicked: a failed case with no run to count.
    fn add_panicked(&mut self) {
        self.cases += 1;
        self.failed += 1;
        self.finish();
    }

    fn add_steps(&mut self, run: &RunReport, saga: &Saga) {
        let c = &mut self.counts;
        for step in &run.steps {
            let executed = matches!(
                step.status,
                StepStatus::Completed
                    | StepStatus::Compensated
                    | StepStatus::CompensationFailed
                    | StepStatus::Uncertain
            );
            if executed && saga.plan.step(&step.id).is_some_and(|(_, s)| s.side_effects) {
                c.side_effects += 1;
                c.covered += usize::from(step.compensator.is_some());
            }
            c.compensation_attempts += step.compensation_attempts as usize;
        }
        c.compensations += run.compensated.len();
    }

    fn merge(&mut self, other: &Metrics) {
        self.cases += other.cases;
        self.passed += other.passed;
        self.failed += other.failed;
        let (c, o) = (&mut self.counts, &other.counts);
        c.rolled_back += o.rolled_back;
        c.restored += o.restored;
        c.side_effects += o.side_effects;
        c.covered += o.covered;
        c.compensations += o.compensations;
        c.compensation_attempts += o.compensation_attempts;
        self.finish();
    }

    fn finish(&mut self) {
        let ratio = |a: usize, b: usize| if b == 0 { 1.0 } else { ((a as f64 / b as f64) * 1e6).round() / 1e6 };
        let c = self.counts;
        self.rollback_success_rate = ratio(c.restored, c.rolled_back);
        self.compensation_coverage = ratio(c.covered, c.side_effects);
        self.compensation_efficiency = ratio(c.compensations, c.compensation_attempts);
    }
}

/// The campaign of one saga.
#[derive(Clone, Debug, Serialize)]
pub struct SagaReport {
    pub saga: String,
    pub file: PathBuf,
    /// SHA-256 of every plugin the saga calls.
    pub plugins: BTreeMap<String, String>,
    pub fixture_digest: String,
    pub ledgers: Vec<String>,
    /// The saga's steps, the lanes of its cases' timelines.
    #[serde(skip)]
    pub steps: Vec<html::Lane>,
    pub metrics: Metrics,
    /// What failed the saga's campaign outside any case's verdict.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
    pub cases: Vec<CaseReport>,
}

/// The reproducible report of a campaign: no wall-clock time in it.
#[derive(Clone, Debug, Serialize)]
pub struct CampaignReport {
    pub sagabox: &'static str,
    pub seed: u64,
    pub runs: usize,
    pub faults: Vec<FaultKind>,
    pub totals: Metrics,
    /// What failed the campaign as a whole.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
    pub sagas: Vec<SagaReport>,
}

impl CampaignReport {
    /// No case failed or panicked, every clean run could anchor its campaign, and the
    /// campaign ran as asked.
    pub fn passed(&self) -> bool {
        self.totals.failed == 0 && self.problems.is_empty() && self.sagas.iter().all(|s| s.problems.is_empty())
    }
}

/// Wall-clock measurements of a campaign, kept out of the reproducible report.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Timing {
    pub cases: usize,
    pub seconds: f64,
    pub cases_per_second: f64,
    /// From the compensation being triggered to the saga finishing, in microseconds.
    pub rollback_latency_us: Percentiles,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub max: u64,
}

impl Percentiles {
    fn of(mut samples: Vec<u64>) -> Percentiles {
        samples.sort_unstable();
        let at = |q: f64| samples.get(((samples.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0);
        Percentiles { p50: at(0.5), p90: at(0.9), p99: at(0.99), max: samples.last().copied().unwrap_or(0) }
    }
}

/// What the clean run of a saga came to.
struct CleanRun {
    status: Status,
    failed_step: Option<String>,
    state: State,
}

/// Why a campaign cannot run as asked.
#[derive(Debug, thiserror::Error)]
pub enum CampaignError {
    #[error("--case '{id}': no saga has a case with this id (known cases: {known})")]
    UnknownCase { id: String, known: String },
}

/// A campaign whose clean runs are done and whose cases are chosen, ready to [`execute`].
pub struct Prepared {
    sagas: Vec<PreparedSaga>,
}

struct PreparedSaga {
    subject: Subject,
    clean: Arc<CleanRun>,
    /// The cases to run, with their positions among all the saga's cases.
    cases: Vec<(usize, Case)>,
    /// Why the clean run cannot anchor the campaign, if it cannot.
    problems: Vec<String>,
}

/// The run id every case of a saga uses, so that the records its tools create get the same
/// ids in every case (and completed cases can be compared with the clean run).
fn run_id(saga: &Saga) -> String {
    format!("verify-{}", saga.name)
}

/// Steps (or compensations) a concurrent case lets run at once.
const CONCURRENT_STEPS: usize = 4;

/// Runs one case from the initial snapshot, one step at a time or concurrently as it says.
async fn run_case(runtime: &Runtime, subject: &Subject, case: &Case, seed: u64) -> (RunReport, State) {
    let backend = MemoryBackend::new(subject.initial.clone());
    let mut options = RunOptions::new(run_id(&subject.saga), subject.input.clone());
    options.seed = seed;
    options.faults = case.faults.clone();
    options.deterministic = case.mode == Mode::Deterministic;
    options.virtual_backoff = true;
    options.max_concurrency = CONCURRENT_STEPS;
    let report = saga::run(runtime, &subject.saga, &backend, options).await;
    (report, backend.store.snapshot())
}

/// Runs the campaign of every subject. `progress` hears of every finished case. A campaign
/// that cannot run as asked (an unknown `--case`) comes back failed, with the reason in
/// [`CampaignReport::problems`].
pub async fn run_campaign(
    runtime: Arc<Runtime>,
    subjects: &[Subject],
    options: &CampaignOptions,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> (CampaignReport, Timing) {
    match prepare(&runtime, subjects, options).await {
        Ok(prepared) => execute(runtime, prepared, options, progress).await,
        Err(e) => {
            let mut report = empty_report(options, Vec::new());
            report.problems.push(e.to_string());
            (report, Timing::default())
        }
    }
}

/// Runs every subject's clean run and chooses its cases.
pub async fn prepare(
    runtime: &Runtime,
    subjects: &[Subject],
    options: &CampaignOptions,
) -> Result<Prepared, CampaignError> {
    let (mut sagas, mut ids) = (Vec::new(), Vec::new());
    for subject in subjects {
        let (clean, clean_state) = run_case(runtime, subject, &Case::clean(), options.seed).await;
        let mut cases = cases::build(&subject.saga, &clean, &options.kinds, options.seed, options.runs);
        if let Some(only) = &options.only_case {
            ids.extend(cases.iter().map(|c| c.id.clone()).filter(|id| !id.starts_with("random-")));
            cases = cases::select(&subject.saga, cases, only, options.seed);
        }
        let problems = clean_run_problem(subject, &clean, options).into_iter().collect();
        let clean = CleanRun { status: clean.status, failed_step: clean.failed_step.clone(), state: clean_state };
        let cases = cases.into_iter().enumerate().filter(|(n, _)| options.shard.is_none_or(|s| s.takes(*n))).collect();
        sagas.push(PreparedSaga { subject: subject.clone(), clean: Arc::new(clean), cases, problems });
    }
    if let Some(only) = &options.only_case
        && sagas.iter().all(|s| s.cases.is_empty())
    {
        return Err(CampaignError::UnknownCase { id: only.clone(), known: known_cases(ids, options) });
    }
    Ok(Prepared { sagas })
}

/// Case ids for an error message: the first few, and how many more.
fn known_cases(mut ids: Vec<String>, options: &CampaignOptions) -> String {
    const SHOWN: usize = 12;
    let mut seen = BTreeSet::new();
    ids.retain(|id| seen.insert(id.clone()));
    let more = ids.len().saturating_sub(SHOWN);
    let mut text = ids.into_iter().take(SHOWN).collect::<Vec<_>>().join(", ");
    if more > 0 {
        text.push_str(&format!(", … and {more} more"));
    }
    if options.kinds.contains(&FaultKind::Random) {
        text.push_str("; random-N for any N");
    }
    text
}

/// Why a clean run cannot anchor a campaign, if it cannot. It must complete, or fail only
/// after steps completed and were undone — the rollback the saga was written to show; a
/// saga with no fixture or with an expected (completed) state must complete.
fn clean_run_problem(subject: &Subject, clean: &RunReport, options: &CampaignOptions) -> Option<String> {
    if clean.status == Status::Completed {
        return None;
    }
    let saga = &subject.saga;
    let undid_something = !clean.compensated.is_empty() || !clean.compensation_failures.is_empty();
    let why = if saga.companions.fixture.is_none() && options.state.is_none() {
        let stem = saga.path.file_stem().and_then(|s| s.to_str()).unwrap_or("saga");
        format!(
            "hint: the saga has no fixture, so it ran on an empty store; \
             give it its starting state in {stem}.fixture.json (or a directory {stem}.fixture/, \
             or --state FIXTURE)"
        )
    } else if subject.expected.is_some() {
        "the saga declares the expected state of a completed run".to_string()
    } else if !undid_something {
        "no step completed before it, so no case would exercise a rollback".to_string()
    } else {
        return None;
    };
    Some(format!("the clean run did not complete: {}; {why}", failure_text(clean)))
}

/// "rejected at step 'flight': airline.book: …"
fn failure_text(run: &RunReport) -> String {
    let code = run.error.as_ref().map_or(run.status.as_str(), |e| e.code.as_str());
    let at = run.failed_step.as_ref().map(|s| format!(" at step '{s}'")).unwrap_or_default();
    let message = run.error.as_ref().map(|e| format!(": {}", e.message)).unwrap_or_default();
    format!("{code}{at}{message}")
}

fn empty_report(options: &CampaignOptions, sagas: Vec<SagaReport>) -> CampaignReport {
    let mut totals = Metrics::default();
    sagas.iter().for_each(|s| totals.merge(&s.metrics));
    CampaignReport {
        sagabox: env!("CARGO_PKG_VERSION"),
        seed: options.seed,
        runs: options.runs,
        faults: options.kinds.clone(),
        totals,
        problems: Vec::new(),
        sagas,
    }
}

/// Runs the prepared cases, at most `options.concurrency` at once.
pub async fn execute(
    runtime: Arc<Runtime>,
    prepared: Prepared,
    options: &CampaignOptions,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> (CampaignReport, Timing) {
    let (outcomes, timing) = run_cases(&runtime, &prepared, options, progress).await;
    (assemble(&runtime, prepared, outcomes, options), timing)
}

/// Runs the prepared cases and returns, per saga, each case's outcome by its position.
pub(crate) async fn run_cases(
    runtime: &Arc<Runtime>,
    prepared: &Prepared,
    options: &CampaignOptions,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> (Vec<Vec<(usize, CaseOutcome)>>, Timing) {
    let started = std::time::Instant::now();
    let total: usize = prepared.sagas.iter().map(|s| s.cases.len()).sum();
    let permits = Arc::new(tokio::sync::Semaphore::new(options.concurrency.max(1)));
    let (mut done, mut latencies, mut all) = (0, Vec::new(), Vec::new());
    for saga in &prepared.sagas {
        // Digested once before the cases copy it, so that each case's state keeps its bucket
        // index and digests in O(what the case touched).
        saga.subject.initial.digest();
        let tasks: Vec<_> =
            saga.cases.iter().map(|(_, case)| spawn_case(runtime, saga, case, &permits, options)).collect();
        let mut outcomes = Vec::with_capacity(tasks.len());
        for ((index, case), task) in saga.cases.iter().zip(tasks) {
            let outcome = match join_case(task).await {
                Ok((report, run)) => {
                    latencies.extend(rollback_latency(&run));
                    let mut metrics = Metrics::default();
                    metrics.add(&report, &run, &saga.subject.saga);
                    CaseOutcome::Judged { report: Box::new(report), counts: metrics.counts }
                }
                Err(panic) => CaseOutcome::Panicked {
                    problem: format!(
                        "case '{}' panicked: {panic} (replay: {})",
                        case.id,
                        replay_command(&saga.subject.saga.path, options, &case.id)
                    ),
                },
            };
            outcomes.push((*index, outcome));
            done += 1;
            progress(done, total);
        }
        all.push(outcomes);
    }
    let seconds = started.elapsed().as_secs_f64();
    let timing = Timing {
        cases: done,
        seconds,
        cases_per_second: done as f64 / seconds.max(1e-9),
        rollback_latency_us: Percentiles::of(latencies),
    };
    (all, timing)
}

/// How one case ended: judged, or its task panicked (the case then fails by name).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CaseOutcome {
    Judged { report: Box<CaseReport>, counts: Counts },
    Panicked { problem: String },
}

/// The report of a campaign from its cases' outcomes (`outcomes[saga]`, in case order).
pub(crate) fn assemble(
    runtime: &Runtime,
    prepared: Prepared,
    outcomes: Vec<Vec<(usize, CaseOutcome)>>,
    options: &CampaignOptions,
) -> CampaignReport {
    let mut sagas = Vec::new();
    for (saga, outcomes) in prepared.sagas.into_iter().zip(outcomes) {
        let (mut metrics, mut reports, mut problems) = (Metrics::default(), Vec::new(), saga.problems);
        for (_, outcome) in outcomes {
            match outcome {
                CaseOutcome::Judged { report, counts } => {
                    metrics.merge(&Metrics::of_case(report.verdict, counts));
                    reports.push(*report);
                }
                CaseOutcome::Panicked { problem } => {
                    metrics.add_panicked();
                    problems.push(problem);
                }
            }
        }
        let subject = &saga.subject;
        sagas.push(SagaReport {
            saga: subject.saga.name.clone(),
            file: subject.saga.path.clone(),
            plugins: plugins_of(runtime, &subject.saga),
            fixture_digest: subject.initial.digest(),
            ledgers: subject.saga.plan.ledgers.clone(),
            steps: html::Lane::of(&subject.saga.plan),
            metrics,
            problems,
            cases: reports,
        });
    }
    empty_report(options, sagas)
}

fn spawn_case(
    runtime: &Arc<Runtime>,
    saga: &PreparedSaga,
    case: &Case,
    permits: &Arc<tokio::sync::Semaphore>,
    options: &CampaignOptions,
) -> tokio::task::JoinHandle<(CaseReport, RunReport)> {
    let (runtime, subject, clean, permits) =
        (runtime.clone(), saga.subject.clone(), saga.clean.clone(), permits.clone());
    let (case, seed, hook, timelines) = (case.clone(), options.seed, options.on_case.clone(), options.timelines);
    let replay = replay_command(&subject.saga.path, options, &case.id);
    tokio::spawn(async move {
        let _permit = permits.acquire_owned().await;
        if let Some(hook) = hook {
            (hook.0)(&case);
        }
        let (run, state) = run_case(&runtime, &subject, &case, seed).await;
        let mut report = judge(&subject, &case, &run, &state, &clean, replay);
        if timelines && case.mode == Mode::Deterministic {
            report.timeline = Some(html::Timeline::of(&run, &subject.saga.plan, &case.faults));
        }
        (report, run)
    })
}

/// A finished task's result; a panic comes back as its message, so the campaign can fail
/// the case by name instead of losing it.
async fn join_case(task: tokio::task::JoinHandle<(CaseReport, RunReport)>) -> Result<(CaseReport, RunReport), String> {
    task.await.map_err(|e| {
        if !e.is_panic() {
            return format!("its task ended early: {e}");
        }
        let payload = e.into_panic();
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(a panic without a message)".into())
    })
}

/// The command that runs one case of the saga at `saga` again, alone, as it ran: every
/// option that decides its outcome — the plugins, the fixture, the seed — each word quoted
/// for a POSIX shell. `--runs`, `--faults` and `--concurrency` are left out: a case id
/// names the same faults under any of them (`--case random-N` draws the schedule anew).
pub fn replay_command(saga: &Path, options: &CampaignOptions, case: &str) -> String {
    let mut words = vec!["sagabox".to_string()];
    words.extend(options.replay_plugin_args.iter().cloned());
    words.extend(["verify".to_string(), saga.display().to_string()]);
    if let Some(state) = &options.state {
        words.extend(["--state".to_string(), state.display().to_string()]);
    }
    words.extend(["--seed".to_string(), options.seed.to_string(), "--case".to_string(), case.to_string()]);
    words.iter().map(|w| shell_quote(w)).collect::<Vec<_>>().join(" ")
}

/// `word` as one word of a POSIX shell command: as it is when nothing in it is special,
/// else in single quotes.
fn shell_quote(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./:=@%+,".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

fn plugins_of(runtime: &Runtime, saga: &Saga) -> BTreeMap<String, String> {
    let tools =
        saga.plan.steps.iter().flat_map(|s| std::iter::once(&s.tool).chain(s.compensator.as_ref().map(|c| &c.tool)));
    tools
        .filter_map(|tool| runtime.resolve(tool).ok())
        .map(|(plugin, _)| (plugin.name.clone(), plugin.sha256.clone()))
        .collect()
}

fn rollback_latency(run: &RunReport) -> Option<u64> {
    use crate::saga::journal::EventKind;
    let triggered = run.events.iter().find(|e| e.event == EventKind::CompensationTriggered)?;
    let finished = run.events.iter().rev().find(|e| e.event == EventKind::SagaFinished)?;
    Some(finished.at_us.saturating_sub(triggered.at_us))
}

/// Documents of `expected` (`{ns: {key: doc | null}}`) that `state` does not match.
fn expected_mismatches(expected: &Value, state: &State) -> Vec<DiffEntry> {
    let mut out = Vec::new();
    for (ns, docs) in expected.as_object().into_iter().flatten() {
        for (key, want) in docs.as_object().into_iter().flatten() {
            let have = state.get(ns, key).map(|d| serde_json::from_str::<Value>(&d.text).unwrap_or(Value::Null));
            let want = (!want.is_null()).then(|| want.clone());
            let same = match (&have, &want) {
                (Some(h), Some(w)) => crate::json::canonical(h) == crate::json::canonical(w),
                (None, None) => true,
                _ => false,
            };
            if !same {
                out.push(DiffEntry {
                    namespace: ns.clone(),
                    key: key.clone(),
                    change: "unexpected".into(),
                    fields: Vec::new(),
                    before: want,
                    after: have,
                });
            }
        }
    }
    out
}

/// Compares a case's outcome with what it had to end in.
fn judge(
    subject: &Subject,
    case: &Case,
    run: &RunReport,
    state: &State,
    clean: &CleanRun,
    replay: String,
) -> CaseReport {
    let saga = &subject.saga;
    let ledgers = &saga.plan.ledgers;
    let initial = &subject.initial;
    let restored_diff = || diff(initial, state, ledgers);
    let mut diff_entries = Vec::new();
    let failure_of_compensation: BTreeSet<&str> = run.compensation_failures.iter().map(|f| f.step.as_str()).collect();

    let result: Result<String, String> = match run.status {
        Status::Completed => match &case.expect {
            Expect::RolledBack { .. } | Expect::CompensationFailed { .. } => {
                Err("the saga completed, but this fault had to make it fail".into())
            }
            Expect::SameAsClean if clean.status != Status::Completed => {
                Err(format!("the saga completed, but the clean run ended {}", clean.status.as_str()))
            }
            _ => {
                diff_entries = diff(&clean.state, state, &[]);
                if !diff_entries.is_empty() {
                    Err("the saga completed at a different state than the clean run".into())
                } else if let Some(mismatch) = subject.expected.as_ref().map(|e| expected_mismatches(e, state))
                    && !mismatch.is_empty()
                {
                    diff_entries = mismatch;
                    Err("the completed state does not match the saga's expected state".into())
                } else {
                    Ok("completed at the expected state".into())
                }
            }
        },
        Status::Failed | Status::TimedOut => {
            diff_entries = restored_diff();
            let wrong_step = match &case.expect {
                Expect::RolledBack { failed_step } if run.failed_step.as_deref() != Some(failed_step) => {
                    Some(format!("failed at {:?}, expected at '{failed_step}'", run.failed_step))
                }
                Expect::CompensationFailed { step } => {
                    Some(format!("every compensation succeeded, but the compensator of '{step}' had to give up"))
                }
                Expect::SameAsClean if clean.status == Status::Completed => {
                    Some("the saga failed, but the clean run completed and this fault had to be absorbed".into())
                }
                Expect::SameAsClean if run.failed_step != clean.failed_step => {
                    Some(format!("failed at {:?}, the clean run at {:?}", run.failed_step, clean.failed_step))
                }
                _ => None,
            };
            if let Some(reason) = wrong_step {
                Err(reason)
            } else if !diff_entries.is_empty() {
                Err("the rollback did not restore the initial state".into())
            } else {
                Ok("rolled back to the initial state".into())
            }
        }
        // Campaigns run in memory, in one process: nothing can take a run over.
        Status::TakenOver => Err("another process took the run over".into()),
        Status::CompensationFailed => {
            let actual = restored_diff();
            let reported: BTreeSet<(String, String, String)> =
                run.residue.iter().map(|c| (c.namespace.clone(), c.key.clone(), c.change.clone())).collect();
            let observed: BTreeSet<(String, String, String)> =
                actual.iter().map(|d| (d.namespace.clone(), d.key.clone(), d.change.to_string())).collect();
            let allowed: BTreeSet<&str> = case
                .faults
                .iter()
                .filter(|(_, phase, fault)| {
                    *phase == Phase::Compensation
                        && match fault {
                            saga::Fault::Permanent => true,
                            saga::Fault::Transient { failures } => {
                                *failures >= saga.plan.compensation_retry.max_attempts
                            }
                            _ => false,
                        }
                })
                .map(|(step, _, _)| step)
                .collect();
            diff_entries = actual;
            if let Some(unexpected) = failure_of_compensation.iter().find(|s| !allowed.contains(*s)) {
                Err(format!("the compensator of '{unexpected}' failed without an injected fault to explain it"))
            } else if reported != observed {
                Err("the residue the run reported differs from the state it left".into())
            } else {
                Ok(format!("compensation of {failure_of_compensation:?} gave up; residue reported exactly"))
            }
        }
    };
    let ledger_changes = changed_keys(initial, state, ledgers)
        .into_iter()
        .map(|(namespace, key, change)| format!("{change} {namespace}/{key}"))
        .collect();
    let (verdict, reason) = match result {
        Ok(reason) => (Verdict::Pass, reason),
        Err(reason) => (Verdict::Fail, reason),
    };
    if verdict == Verdict::Pass && run.status != Status::CompensationFailed {
        diff_entries.clear();
    }
    let serial = case.mode == Mode::Deterministic;
    let mut compensation_failed: Vec<String> = run.compensation_failures.iter().map(|f| f.step.clone()).collect();
    if !serial {
        compensation_failed.sort();
    }
    CaseReport {
        id: case.id.clone(),
        mode: case.mode,
        faults: case.faults.clone(),
        expected: case.expect.clone(),
        observed: run.status,
        failed_step: run.failed_step.clone().filter(|_| serial),
        compensated: if serial { run.compensated.clone() } else { Vec::new() },
        compensation_failed,
        digest_before: initial.digest_excluding(ledgers),
        digest_after: state.digest_excluding(ledgers),
        diff: diff_entries,
        ledger_changes,
        verdict,
        reason,
        replay,
        timeline: None,
    }
}

/// Each field in which `entry` differs, as text: `[JSON pointer ("" for the whole
/// document), the value the case had to end with, the one it ended with]`, a missing value
/// being `(absent)`.
pub fn field_changes(entry: &DiffEntry) -> Vec<[String; 3]> {
    let at = |doc: &Option<Value>, field: &str| {
        doc.as_ref().and_then(|v| v.pointer(field)).map_or("(absent)".to_string(), |v| v.to_string())
    };
    let fields = if entry.fields.is_empty() { vec![String::new()] } else { entry.fields.clone() };
    fields
        .into_iter()
        .map(|field| {
            let (before, after) = (at(&entry.before, &field), at(&entry.after, &field));
            [field, before, after]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_commands_repeat_every_option_that_decides_the_case_quoted_for_a_shell() {
        let options = CampaignOptions {
            seed: 7,
            runs: 3,
            kinds: vec![FaultKind::Trap],
            state: Some(PathBuf::from("it's here/db")),
            replay_plugin_args: ["--no-bundled", "--plugins", "my plugins", "--operator", "op.toml"]
                .map(String::from)
                .to_vec(),
            ..CampaignOptions::default()
        };
        assert_eq!(
            replay_command(Path::new("sagas/a b.json"), &options, "hotel:trap@concurrent"),
            "sagabox --no-bundled --plugins 'my plugins' --operator op.toml verify 'sagas/a b.json' \
             --state 'it'\\''s here/db' --seed 7 --case hotel:trap@concurrent"
        );
        let plain = CampaignOptions::default();
        assert_eq!(
            replay_command(Path::new("sagas/travel.json"), &plain, "clean"),
            "sagabox verify sagas/travel.json --seed 0 --case clean"
        );
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("$HOME"), "'$HOME'");
    }
}
