//! `sagabox run` and `sagabox validate`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context as _, bail};
use sagabox::backend::{Backend, Durability, MemoryBackend, RegisterError, RunRecord};
use sagabox::durable::{DEFAULT_LEASE, Heartbeat};
use sagabox::saga::journal::JsonLinesFile;
use sagabox::saga::{self, Fault, FaultPlan, Phase, RunOptions, RunReport, Saga, Status};
use sagabox::store::{State, fixture};
use serde_json::{Value, json};

use super::{Outcome, PluginArgs, json_arg};

#[derive(clap::Args)]
pub struct RunArgs {
    /// The saga file.
    saga: PathBuf,

    /// The saga's input: JSON, or a file [default: <saga>.input.json beside the saga, if any].
    #[arg(long)]
    input: Option<String>,

    /// The starting state: a fixture file or directory [default: <saga>.fixture.json beside the
    /// saga, if any; else an empty store].
    #[arg(long, value_name = "FIXTURE")]
    state: Option<PathBuf>,

    /// Write the run's events to FILE as JSON Lines, as they happen.
    #[arg(long, value_name = "FILE")]
    journal: Option<PathBuf>,

    /// Seed of retry jitter [default: random].
    #[arg(long)]
    seed: Option<u64>,

    /// The run's id, from which idempotency keys and so record ids derive [default: random].
    /// `verify` runs a saga `x` as `verify-x`.
    #[arg(long)]
    run_id: Option<String>,

    /// Inject a fault: STEP:KIND or STEP:compensation:KIND, KIND one of rejected, trap, fuel,
    /// timeout, lost_response, transient[=N], permanent, repeat. Repeatable.
    #[arg(long, value_name = "SPEC")]
    fault: Vec<String>,

    /// Write the final state to FILE (canonical JSON).
    #[arg(long, value_name = "FILE")]
    write_state: Option<PathBuf>,

    /// Print the report as JSON (status, failed_step, compensated, output, steps, events, ...).
    #[arg(long)]
    json: bool,

    /// Keep the state and the journal in this database (a SQLite file, or a postgres://
    /// URL), so that a crashed run can be resumed (`sagabox resume`). A new database is
    /// seeded from the saga's fixture (or --state).
    #[arg(long, value_name = "FILE|URL")]
    db: Option<String>,

    /// With --db: normal survives a killed process; full also survives power loss (or, on
    /// PostgreSQL, a crashed server).
    #[arg(long, value_enum, default_value = "normal", requires = "db")]
    durability: Durability,
}

#[derive(clap::Args)]
pub struct ValidateArgs {
    /// Saga files, or directories of them.
    #[arg(required = true)]
    sagas: Vec<PathBuf>,
}

/// Parses `STEP:KIND` / `STEP:compensation:KIND`.
pub fn parse_fault(spec: &str) -> anyhow::Result<(String, Phase, Fault)> {
    let parts: Vec<&str> = spec.split(':').collect();
    let (step, phase, kind) = match parts.as_slice() {
        [step, kind] => (step, Phase::Action, kind),
        [step, "action", kind] => (step, Phase::Action, kind),
        [step, "compensation", kind] => (step, Phase::Compensation, kind),
        _ => bail!("--fault {spec}: expected STEP:KIND or STEP:compensation:KIND"),
    };
    let (name, count) = kind.split_once('=').map_or((*kind, None), |(n, c)| (n, Some(c)));
    let fault = match name {
        "rejected" => Fault::Rejected,
        "trap" => Fault::Trap,
        "fuel" => Fault::Fuel,
        "timeout" => Fault::Timeout,
        "lost_response" => Fault::LostResponse,
        "transient" => Fault::Transient {
            failures: count
                .map(str::parse)
                .transpose()
                .with_context(|| format!("--fault {spec}: bad count"))?
                .unwrap_or(1),
        },
        "permanent" => Fault::Permanent,
        "repeat" => Fault::Repeat,
        other => bail!("--fault {spec}: unknown fault kind '{other}'"),
    };
    Ok((step.to_string(), phase, fault))
}

/// The input of a run: given, the saga's companion file, or `{}`.
pub fn load_input(given: Option<&str>, saga: &Saga) -> anyhow::Result<Value> {
    match (given, &saga.companions.input) {
        (Some(text), _) => json_arg(text, "--input"),
        (None, Some(path)) => json_arg(&format!("@{}", path.display()), "input"),
        (None, None) => Ok(json!({})),
    }
}

/// The starting state of a run: given, the saga's companion fixture, or empty.
pub fn load_state(given: Option<&Path>, saga: &Saga) -> anyhow::Result<State> {
    match given.or(saga.companions.fixture.as_deref()) {
        Some(path) => Ok(fixture::load(path)?),
        None => Ok(State::default()),
    }
}

pub async fn run(plugin_args: &PluginArgs, args: RunArgs) -> anyhow::Result<Outcome> {
    let runtime = plugin_args.load().await?;
    let saga = Saga::load(&args.saga, &runtime)?;
    let input = load_input(args.input.as_deref(), &saga)?;
    let state = load_state(args.state.as_deref(), &saga)?;
    let mut faults = FaultPlan::none();
    for spec in &args.fault {
        let (step, phase, fault) = parse_fault(spec)?;
        if saga.plan.step(&step).is_none() {
            bail!("--fault {spec}: the saga has no step '{step}'");
        }
        faults = faults.with(&step, phase, fault);
    }
    let mut options = RunOptions::new(args.run_id.clone().unwrap_or_else(sagabox::ids::new_run_id), input);
    options.seed = args.seed.unwrap_or_else(rand::random);
    options.faults = faults;
    if let Some(path) = &args.journal {
        let sink = JsonLinesFile::create(path).with_context(|| format!("cannot create journal {}", path.display()))?;
        options.journal = Some(Arc::new(sink));
    }
    let (report, final_state) = match &args.db {
        None => {
            let backend = MemoryBackend::new(state);
            let report = saga::run(&runtime, &saga, &backend, options).await;
            (report, backend.store.snapshot())
        }
        Some(url) => {
            let db = super::durable::open_seeded(url, args.durability, &state, args.state.is_some())?;
            let _heartbeat = Heartbeat::start(Arc::clone(&db), DEFAULT_LEASE);
            let unfinished = db.unfinished_runs()?.iter().filter(|r| r.status == "running").count();
            if unfinished > 0 {
                let name = db.name();
                eprintln!(
                    "note: {name} holds {unfinished} unfinished run(s); `sagabox resume --db {name}` finishes them"
                );
            }
            let definition =
                std::fs::read_to_string(&saga.path).with_context(|| format!("cannot read {}", saga.path.display()))?;
            let saga_path = saga.path.display().to_string();
            let record =
                RunRecord::starting(&options.run_id, &saga.name, &saga_path, definition, &options.input, options.seed);
            let registered = db.register_run(&record);
            if let Err(RegisterError::Exists { run_id, .. }) = &registered {
                bail!("{}", run_exists(&*db, run_id));
            }
            registered?;
            let report = saga::run(&runtime, &saga, &*db, options).await;
            let state = db.current_state()?;
            (report, state)
        }
    };
    if let Some(path) = &args.write_state {
        std::fs::write(path, final_state.to_canonical_json())
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_summary(&report);
    }
    Ok(if report.status == Status::Completed { Outcome::Success } else { Outcome::Failure })
}

/// Why a run id cannot be used again, and what to do instead.
fn run_exists(db: &dyn Backend, run_id: &str) -> String {
    let db_path = db.name();
    let status = db.runs().ok().and_then(|runs| runs.into_iter().find(|r| r.run_id == run_id)).map(|r| r.status);
    match status.as_deref() {
        Some("running") | None => format!(
            "run '{run_id}' already exists in {db_path}; choose another --run-id or `sagabox resume --db {db_path} {run_id}`"
        ),
        Some(status) => format!("run '{run_id}' already exists in {db_path} ({status}); choose another --run-id"),
    }
}

pub fn print_summary(report: &RunReport) {
    let status = report.status.as_str();
    match &report.failed_step {
        Some(step) => println!("saga {} (run {}): {status} at step '{step}'", report.saga, report.run_id),
        None => println!("saga {} (run {}): {status}", report.saga, report.run_id),
    }
    if let Some(error) = &report.error {
        println!("  error: {}", error.message);
    }
    println!("steps:");
    for step in &report.steps {
        let attempts = match step.attempts {
            0 | 1 => String::new(),
            n => format!(" after {n} attempts"),
        };
        let compensator = step.compensator.as_deref().map(|c| format!(" (undo: {c})")).unwrap_or_default();
        println!("  {:<12} {:<22} {}{attempts}{compensator}", step.id, step.tool, step.status.as_str());
    }
    if !report.compensated.is_empty() {
        println!("compensated, in order: {}", report.compensated.join(", "));
    }
    for failure in &report.compensation_failures {
        println!("compensation of '{}' failed: {}", failure.step, failure.error.message);
    }
    if let Some(output) = &report.output {
        println!("output: {output}");
    }
    let describe = |changes: &[sagabox::saga::report::NetChange]| {
        changes.iter().map(|c| format!("{} {}/{}", c.change, c.namespace, c.key)).collect::<Vec<_>>().join(", ")
    };
    if report.changes.is_empty() {
        println!("state changes: none");
    } else {
        println!("state changes: {}", describe(&report.changes));
    }
    if !report.residue.is_empty() {
        println!("left behind by the failed compensation: {}", describe(&report.residue));
    }
}

pub async fn validate(plugin_args: &PluginArgs, args: ValidateArgs) -> anyhow::Result<Outcome> {
    let runtime = plugin_args.load().await?;
    let mut ok = true;
    for path in saga::saga_files(&args.sagas).context("cannot list the sagas")? {
        match Saga::load(&path, &runtime) {
            Ok(saga) => {
                let shape =
                    if saga.definition.steps.iter().any(|s| s.depends_on.is_some()) { "DAG" } else { "sequence" };
                println!("ok: {} ({} steps, {shape})", path.display(), saga.plan.steps.len());
            }
            Err(e) => {
                ok = false;
                eprintln!("{e}");
            }
        }
    }
    Ok(if ok { Outcome::Success } else { Outcome::Failure })
}
