//! `sagabox verify`: rollback verification campaigns.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use indicatif::{ProgressBar, ProgressStyle};
use sagabox::saga::{self, Saga};
use sagabox::store::{State, fixture};
use sagabox::verify::{self, CampaignOptions, CampaignReport, FaultKind, Subject, Timing, Verdict};

use super::run::{load_input, load_state};
use super::{Outcome, PluginArgs};

#[derive(clap::Args)]
pub struct Args {
    /// Saga files, or directories of them (their *.json files, companions excluded).
    #[arg(required = true)]
    sagas: Vec<PathBuf>,

    /// Seed of the random schedules, retry jitter and the plugins' clocks and randomness.
    #[arg(long, default_value_t = 0)]
    seed: u64,

    /// Random fault schedules per saga.
    #[arg(long, default_value_t = 20)]
    runs: usize,

    /// Fault kinds to inject, comma-separated [default: all]: rejected, trap, fuel, timeout,
    /// lost_response, transient, compensator_transient, compensator_permanent, repeat, random.
    #[arg(long, value_delimiter = ',')]
    faults: Vec<FaultKind>,

    /// Run only the case with this id (as printed in a report's `replay` command).
    #[arg(long)]
    case: Option<String>,

    /// Start every saga from FIXTURE instead of its own <saga>.fixture.json: a JSON file
    /// {namespace: {key: document}} or a directory of <namespace>.json files (tau-bench's
    /// layout). Each saga's <saga>.expected.json still applies.
    #[arg(long, value_name = "FIXTURE")]
    state: Option<PathBuf>,

    /// Write the reproducible report (no wall-clock times) to FILE as JSON.
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,

    /// Write the wall-clock measurements (cases per second, rollback latency) to FILE as JSON.
    #[arg(long, value_name = "FILE")]
    timing: Option<PathBuf>,

    /// Cases run at once.
    #[arg(long, default_value_t = 2)]
    concurrency: usize,

    /// Write the campaign as one self-contained HTML page to FILE: summary metrics, a
    /// timeline per case, and the diff and replay command of every failing case.
    #[arg(long, value_name = "FILE")]
    html: Option<PathBuf>,

    /// Print the report and the timing as JSON instead of a summary.
    #[arg(long)]
    json: bool,

    /// Run only part I of N of every saga's cases (on another machine, say), writing their
    /// outcomes to --shard-report; `--merge` then puts the parts together.
    #[arg(long, value_name = "I/N", requires = "shard_report", conflicts_with_all = ["case", "merge"])]
    shard: Option<verify::shard::Shard>,

    /// With --shard: where the part's outcomes go (JSON).
    #[arg(long, value_name = "FILE", requires = "shard")]
    shard_report: Option<PathBuf>,

    /// Merge the --shard-report files of all N parts (given the same sagas and options as
    /// the shards) into the campaign's report, the same byte for byte as one process's.
    #[arg(long, value_name = "FILE", num_args = 1.., conflicts_with = "case")]
    merge: Vec<PathBuf>,
}

/// `saga`'s fixture, loaded once however many sagas name the same file (tau-bench's tasks
/// imported by `to_sagas.py` all link to one 3 MB `db.json`): the sagas share one immutable
/// state, and its digest index, instead of parsing it again each.
fn shared_fixture(saga: &Saga, loaded: &mut HashMap<PathBuf, State>) -> anyhow::Result<State> {
    let Some(path) = saga.companions.fixture.as_deref() else { return load_state(None, saga) };
    let file = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    if let Some(state) = loaded.get(&file) {
        return Ok(state.clone());
    }
    let state = load_state(None, saga)?;
    loaded.insert(file, state.clone());
    Ok(state)
}

pub async fn run(plugin_args: &PluginArgs, args: Args) -> anyhow::Result<Outcome> {
    let runtime = Arc::new(plugin_args.load().await?);
    // Loaded once for every saga (a snapshot of it is an O(1) copy).
    let given = match &args.state {
        Some(path) => Some(fixture::load(path)?),
        None => None,
    };
    let mut subjects = Vec::new();
    let mut fixtures = HashMap::new();
    for path in saga::saga_files(&args.sagas).context("cannot list the sagas")? {
        let saga = Saga::load(&path, &runtime)?;
        let expected = match &saga.companions.expected {
            Some(path) => Some(super::json_arg(&format!("@{}", path.display()), "expected state")?),
            None => None,
        };
        subjects.push(Subject {
            initial: match &given {
                Some(state) => state.clone(),
                None => shared_fixture(&saga, &mut fixtures)?,
            },
            input: load_input(None, &saga)?,
            expected,
            saga: Arc::new(saga),
        });
    }
    let options = CampaignOptions {
        seed: args.seed,
        runs: args.runs,
        kinds: if args.faults.is_empty() { FaultKind::ALL.to_vec() } else { args.faults.clone() },
        only_case: args.case.clone(),
        concurrency: args.concurrency,
        on_case: None,
        shard: args.shard,
        timelines: args.html.is_some(),
        state: args.state.clone(),
        replay_plugin_args: replay_plugin_args(plugin_args),
    };
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{spinner} verifying [{bar:40}] {pos}/{len} cases ({per_sec}, eta {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let progress = |done: usize, total: usize| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    };
    // An unknown --case is a bad argument: an error, not a campaign of zero cases.
    let prepared = verify::prepare(&runtime, &subjects, &options).await?;
    let (report, timing) = if let Some(shard) = options.shard {
        let part = verify::shard::run(&runtime, &prepared, &options, &progress).await;
        bar.finish_and_clear();
        return write_shard(&part, shard, args.shard_report.as_deref().context("--shard needs --shard-report")?);
    } else if !args.merge.is_empty() {
        let mut shards = Vec::new();
        for path in &args.merge {
            let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
            let part = serde_json::from_str(&text)
                .with_context(|| format!("{}: not a shard report of `verify --shard`", path.display()))?;
            shards.push((path.clone(), part));
        }
        verify::shard::merge(&runtime, prepared, &options, shards)?
    } else {
        verify::execute(runtime, prepared, &options, &progress).await
    };
    bar.finish_and_clear();

    if let Some(path) = &args.report {
        let text = serde_json::to_string_pretty(&report)? + "\n";
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.timing {
        let text = serde_json::to_string_pretty(&timing)? + "\n";
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.html {
        std::fs::write(path, verify::html::render(&report, &timing))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "report": report, "timing": timing }))?);
    } else {
        print_summary(&report, &timing);
    }
    Ok(if report.passed() { Outcome::Success } else { Outcome::Failure })
}

/// Writes a shard's outcomes; fails (exit 1) when one of its cases failed.
fn write_shard(
    part: &verify::shard::ShardReport,
    shard: verify::shard::Shard,
    path: &std::path::Path,
) -> anyhow::Result<Outcome> {
    std::fs::write(path, serde_json::to_string(part)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    let failed = part
        .sagas
        .iter()
        .flat_map(|s| &s.cases)
        .filter(|(_, outcome)| match outcome {
            verify::CaseOutcome::Judged { report, .. } => report.verdict == Verdict::Fail,
            verify::CaseOutcome::Panicked { .. } => true,
        })
        .count();
    let t = &part.timing;
    println!(
        "shard {shard}: {} cases in {:.2} s ({:.0} cases/s), {failed} failed; wrote {} (merge with --merge)",
        t.cases,
        t.seconds,
        t.cases_per_second,
        path.display()
    );
    Ok(if failed == 0 { Outcome::Success } else { Outcome::Failure })
}

/// The global options a replay command must repeat: those that choose the plugins and what
/// they are granted (`--operator` also when it came from SAGABOX_OPERATOR). The compile
/// cache and the log level change no outcome, so they are left out.
fn replay_plugin_args(plugins: &PluginArgs) -> Vec<String> {
    let mut words = Vec::new();
    if plugins.no_bundled {
        words.push("--no-bundled".to_string());
    }
    for dir in &plugins.dirs {
        words.extend(["--plugins".to_string(), dir.display().to_string()]);
    }
    if let Some(operator) = &plugins.operator {
        words.extend(["--operator".to_string(), operator.display().to_string()]);
    }
    words
}

fn print_summary(report: &CampaignReport, timing: &Timing) {
    let mut table = Table::new();
    table.load_preset(UTF8_BORDERS_ONLY).set_header([
        "saga",
        "cases",
        "passed",
        "failed",
        "rollback success",
        "compensation coverage",
        "compensation efficiency",
    ]);
    let row = |name: &str, m: &verify::Metrics| {
        let percent = |x: f64| format!("{:.1}%", x * 100.0);
        [
            name.to_string(),
            m.cases.to_string(),
            m.passed.to_string(),
            m.failed.to_string(),
            percent(m.rollback_success_rate),
            percent(m.compensation_coverage),
            percent(m.compensation_efficiency),
        ]
    };
    for saga in &report.sagas {
        table.add_row(row(&saga.saga, &saga.metrics));
    }
    table.add_row(row("all", &report.totals));
    println!("{table}");
    let l = &timing.rollback_latency_us;
    println!(
        "seed {}: {} cases in {:.2} s ({:.0} cases/s); rollback latency p50 {} µs, p90 {} µs, p99 {} µs",
        report.seed, timing.cases, timing.seconds, timing.cases_per_second, l.p50, l.p90, l.p99
    );
    for problem in &report.problems {
        println!("\nFAIL {problem}");
    }
    for saga in &report.sagas {
        for problem in &saga.problems {
            println!("\nFAIL {}: {problem}", saga.saga);
        }
        for case in saga.cases.iter().filter(|c| c.verdict == Verdict::Fail) {
            println!("\nFAIL {} / {}: {}", saga.saga, case.id, case.reason);
            println!("  expected {}; observed {}", case.expected, case.observed.as_str());
            for d in &case.diff {
                println!("  {} {}/{}", d.change, d.namespace, d.key);
                for [field, before, after] in verify::field_changes(d) {
                    match field.is_empty() {
                        true => println!("    {before} -> {after}"),
                        false => println!("    {field}: {before} -> {after}"),
                    }
                }
            }
            println!("  replay: {}", case.replay);
        }
    }
    if report.passed() {
        println!("every case passed");
    } else if report.totals.failed > 0 {
        println!("\n{} of {} cases failed", report.totals.failed, report.totals.cases);
    } else {
        println!("\nthe campaign failed (see above), although no case did");
    }
}
