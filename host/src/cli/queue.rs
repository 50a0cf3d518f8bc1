//! `sagabox submit` and `sagabox worker`: a run queue in a database that many workers share.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use sagabox::backend::{Backend, Durability, RegisterError, RunRecord};
use sagabox::durable::DEFAULT_LEASE;
use sagabox::durable::worker::{self, Finished, WorkerOptions};
use sagabox::saga::Saga;
use tokio_util::sync::CancellationToken;

use super::durable::DbArgs;
use super::run::{load_input, load_state, print_summary};
use super::serve::parse_duration;
use super::{Outcome, PluginArgs};

#[derive(clap::Args)]
pub struct SubmitArgs {
    /// The saga file.
    saga: PathBuf,
    /// The saga's input: JSON, or a file [default: <saga>.input.json beside the saga, if any].
    #[arg(long)]
    input: Option<String>,
    /// Seeds a new database: a fixture file or directory [default: the saga's fixture].
    #[arg(long, value_name = "FIXTURE")]
    state: Option<PathBuf>,
    /// The run's id [default: random]; with --count, ids are ID-1 … ID-N.
    #[arg(long)]
    run_id: Option<String>,
    /// Queue this many runs of the saga.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    count: u64,
    /// Seed of retry jitter [default: random].
    #[arg(long)]
    seed: Option<u64>,
    /// The database (created and seeded if new): a SQLite file or a postgres:// URL.
    #[arg(long, value_name = "FILE|URL")]
    db: String,
}

#[derive(clap::Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Runs in flight at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    concurrency: u64,
    /// How long a run stays this worker's without a renewal (renewed every third of it); a
    /// dead worker's runs are taken over once it runs out.
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    lease: Duration,
    /// Stop once the database holds no queued or unfinished run.
    #[arg(long)]
    until_done: bool,
    /// Print each finished run's report as a JSON line.
    #[arg(long)]
    json: bool,
}

pub async fn submit(plugin_args: &PluginArgs, args: SubmitArgs) -> anyhow::Result<Outcome> {
    // The saga is checked against the plugins here, not only when a worker takes it.
    let runtime = plugin_args.load().await?;
    let saga = Saga::load(&args.saga, &runtime)?;
    let input = load_input(args.input.as_deref(), &saga)?;
    let state = load_state(args.state.as_deref(), &saga)?;
    let db = super::durable::open_seeded(&args.db, Durability::Normal, &state, args.state.is_some())?;
    let definition = std::fs::read_to_string(&saga.path)?;
    let saga_path = saga.path.display().to_string();
    let base = args.run_id.clone().unwrap_or_else(sagabox::ids::new_run_id);
    for n in 1..=args.count {
        let run_id = if args.count == 1 { base.clone() } else { format!("{base}-{n}") };
        let seed = args.seed.unwrap_or_else(rand::random);
        let record = RunRecord::starting(&run_id, &saga.name, &saga_path, definition.clone(), &input, seed).queued();
        match db.register_run(&record) {
            Ok(()) => println!("{run_id}"),
            Err(RegisterError::Exists { run_id, db }) => {
                bail!("run '{run_id}' already exists in {db}; choose another --run-id")
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Outcome::Success)
}

pub async fn worker(plugin_args: &PluginArgs, args: WorkerArgs) -> anyhow::Result<Outcome> {
    let runtime = Arc::new(plugin_args.load().await?);
    let db: Arc<dyn Backend> = args.db.open()?;
    let options = WorkerOptions {
        concurrency: args.concurrency as usize,
        lease: args.lease,
        until_done: args.until_done,
        ..WorkerOptions::default()
    };
    if options.lease < Duration::from_millis(300) {
        bail!(
            "--lease {:?} is too short to be renewed in time (at least 300ms; default {DEFAULT_LEASE:?})",
            options.lease
        );
    }
    let stop = CancellationToken::new();
    let on_signal = stop.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("stopping: finishing the runs in flight (Ctrl-C again to quit at once; they resume elsewhere)");
            on_signal.cancel();
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(130);
            }
        }
    });
    eprintln!(
        "worker {} on {}: taking runs, {} at once",
        sagabox::backend::this_process(),
        db.name(),
        options.concurrency
    );
    let tally = worker::work(runtime, db, &options, stop, |run, finished| match finished {
        Finished::Ran { report, .. } if args.json => match serde_json::to_string(report) {
            Ok(line) => println!("{line}"),
            Err(e) => eprintln!("error: run {}: {e}", run.run_id),
        },
        Finished::Ran { report, .. } => print_summary(report),
        Finished::Failed(e) => eprintln!("error: {e}"),
    })
    .await?;
    let finished: Vec<String> = tally.by_status.iter().map(|(status, n)| format!("{n} {status}")).collect();
    eprintln!("worker done: {}; {} could not run; {} claims", finished.join(", "), tally.errors, tally.claims);
    // Like `run`: success when every run it took succeeded.
    Ok(if tally.unsuccessful == 0 && tally.errors == 0 { Outcome::Success } else { Outcome::Failure })
}
