//! `sagabox resume`, `runs`, `journal` and `state`: working with a durable database.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use std::sync::Arc;

use sagabox::backend::{self, Backend, Durability, RunRecord};
use sagabox::durable::{DEFAULT_LEASE, Heartbeat, Work, holder_alive, now_ms};
use sagabox::saga::{self, session};
use sagabox::store::{State, fixture};

use super::run::print_summary;
use super::{Outcome, PluginArgs};

/// Where a durable run keeps everything.
#[derive(clap::Args, Clone)]
pub struct DbArgs {
    /// The database: a SQLite file (it must exist: `sagabox run --db` creates it) or a
    /// postgres://user@host/db URL.
    #[arg(long, value_name = "FILE|URL")]
    pub db: String,
    /// normal: survives a killed process (SQLite: WAL, synchronous=NORMAL; PostgreSQL:
    /// synchronous_commit=off); full: also power loss or a crashed server (a flush per commit).
    #[arg(long, value_enum, default_value = "normal")]
    pub durability: Durability,
}

impl DbArgs {
    pub fn open(&self) -> anyhow::Result<Arc<dyn Backend>> {
        Ok(backend::open(&self.db, self.durability, false)?)
    }
}

/// Opens (or creates) the database `db` for a command that starts runs, and seeds it with
/// `state` if it is new. `state_given`: the user gave `--state`, which only seeds a new one.
pub fn open_seeded(
    db: &str,
    durability: Durability,
    state: &State,
    state_given: bool,
) -> anyhow::Result<Arc<dyn Backend>> {
    let backend = backend::open(db, durability, true)?;
    if !backend.seed_if_new(state)? && state_given {
        anyhow::bail!("{} already holds a state; --state only seeds a new database", backend.name());
    }
    Ok(backend)
}

#[derive(clap::Args)]
pub struct ResumeArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Resume only this run [default: every unfinished run].
    run_id: Option<String>,
    /// Also resume runs whose process still seems alive.
    #[arg(long)]
    force: bool,
    /// Print each report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct RunsArgs {
    #[command(flatten)]
    db: DbArgs,
    #[arg(long, conflicts_with = "watch")]
    json: bool,
    /// Show the queue and the unfinished runs, refreshed every second, until Ctrl-C.
    #[arg(long)]
    watch: bool,
}

#[derive(clap::Args)]
pub struct JournalArgs {
    #[command(flatten)]
    db: DbArgs,
    run_id: String,
    /// Write the run (an agent's session, committed or aborted) as a saga file instead: its
    /// calls as steps with their literal arguments and compensators, and beside it
    /// `<stem>.fixture.json`, the store as it was before the run wrote to it. `sagabox
    /// verify FILE` then puts the recorded trajectory through every fault.
    #[arg(long, value_name = "FILE")]
    as_saga: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct StateArgs {
    /// Read a database (a SQLite file or a postgres:// URL)...
    #[arg(long, value_name = "FILE|URL", conflicts_with = "state", required_unless_present = "state")]
    db: Option<String>,
    /// ...or a fixture file or directory.
    #[arg(long, value_name = "FIXTURE")]
    state: Option<PathBuf>,
    /// Print the SHA-256 digest (the one `verify` uses) instead of the canonical JSON.
    #[arg(long)]
    digest: bool,
}

pub async fn resume(plugin_args: &PluginArgs, args: ResumeArgs) -> anyhow::Result<Outcome> {
    let runtime = plugin_args.load().await?;
    let db = args.db.open()?;
    let _heartbeat = Heartbeat::start(Arc::clone(&db), DEFAULT_LEASE);
    let runs: Vec<_> = db
        .unfinished_runs()?
        .into_iter()
        .filter(|r| r.status == "running" && args.run_id.as_ref().is_none_or(|id| id == &r.run_id))
        .collect();
    if let Some(id) = &args.run_id
        && runs.is_empty()
    {
        anyhow::bail!("{}: no unfinished run '{id}' (see `sagabox runs --db {}`)", db.name(), db.name());
    }
    let mut all_succeeded = true;
    let mut cannot = Vec::new();
    for record in runs {
        if holder_alive(&record, now_ms()) && !args.force {
            eprintln!("skipping run {}: its holder {} is still alive (use --force)", record.run_id, holder(&record));
            continue;
        }
        // A run that cannot be rebuilt (its saga no longer validates against the loaded
        // plugins) is reported; the others are still resumed.
        let work = match Work::of(&runtime, &record) {
            Ok(work) => work,
            Err(e) => {
                eprintln!("error: {e}");
                cannot.push(record.run_id);
                continue;
            }
        };
        // Another resume (or a worker) may have taken it since we listed the runs: only one
        // runs it.
        if !db.adopt_run(&record.run_id, &record, now_ms() + DEFAULT_LEASE.as_millis() as u64)? {
            eprintln!("skipping run {}: another process took it over", record.run_id);
            continue;
        }
        let report = work.finish(&runtime, &*db, &record).await?;
        all_succeeded &= work.succeeded(&report);
        report_run(&report, args.json)?;
    }
    if !cannot.is_empty() {
        anyhow::bail!("{} run(s) left unfinished: {}", cannot.len(), cannot.join(", "));
    }
    Ok(if all_succeeded { Outcome::Success } else { Outcome::Failure })
}

/// Who holds a run, for messages.
fn holder(run: &RunRecord) -> String {
    if run.owner.is_empty() { format!("process {}", run.pid) } else { run.owner.clone() }
}

fn report_run(report: &saga::RunReport, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        print_summary(report);
    }
    Ok(())
}

pub async fn runs(args: RunsArgs) -> anyhow::Result<Outcome> {
    let db = args.db.open()?;
    if args.watch {
        return watch(&*db).await;
    }
    let runs = db.runs()?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&runs)?);
        return Ok(Outcome::Success);
    }
    let mut table = Table::new();
    table.load_preset(UTF8_BORDERS_ONLY).set_header([
        "run",
        "saga",
        "status",
        "held by",
        "started (unix ms)",
        "journal bytes",
    ]);
    for run in &runs {
        let bytes = db.journal_bytes(&run.run_id)?;
        table.add_row([
            run.run_id.clone(),
            run.saga.clone(),
            run.status.clone(),
            if run.status == "running" { holder(run) } else { String::new() },
            run.started_ms.to_string(),
            bytes.to_string(),
        ]);
    }
    println!("{table}");
    Ok(Outcome::Success)
}

/// `runs --watch`: how many runs are in each state, and who holds the unfinished ones.
async fn watch(db: &dyn Backend) -> anyhow::Result<Outcome> {
    loop {
        let runs = db.runs()?;
        let now = now_ms();
        let mut counts = std::collections::BTreeMap::<&str, usize>::new();
        for run in &runs {
            *counts.entry(run.status.as_str()).or_default() += 1;
        }
        let mut table = Table::new();
        table.load_preset(UTF8_BORDERS_ONLY).set_header(["run", "saga", "status", "held by", "lease left"]);
        for run in runs.iter().filter(|r| r.status == "queued" || r.status == "running").take(40) {
            let lease =
                run.lease_until_ms.map_or(String::new(), |t| format!("{:.1}s", (t as f64 - now as f64) / 1000.0));
            let held = if run.status == "running" { holder(run) } else { String::new() };
            table.add_row([run.run_id.clone(), run.saga.clone(), run.status.clone(), held, lease]);
        }
        let summary: Vec<String> = counts.iter().map(|(status, n)| format!("{status} {n}")).collect();
        // Clear the screen, then draw.
        print!("\x1b[2J\x1b[H{} — {} runs: {}\n{table}\n", db.name(), runs.len(), summary.join(", "));
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
            _ = tokio::signal::ctrl_c() => return Ok(Outcome::Success),
        }
    }
}

pub fn journal(args: JournalArgs) -> anyhow::Result<Outcome> {
    let db = args.db.open()?;
    let events = db.events(&args.run_id)?;
    if events.is_empty() && !db.runs()?.iter().any(|r| r.run_id == args.run_id) {
        anyhow::bail!("{}: no run '{}'", db.name(), args.run_id);
    }
    if let Some(path) = &args.as_saga {
        return export_saga(&*db, &args.run_id, &events, path);
    }
    for event in events {
        println!("{}", serde_json::to_string(&event)?);
    }
    Ok(Outcome::Success)
}

/// `journal --as-saga`: the run as a saga file and its fixture.
fn export_saga(
    db: &dyn Backend,
    run_id: &str,
    events: &[saga::journal::Event],
    path: &Path,
) -> anyhow::Result<Outcome> {
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("session").to_string();
    let definition = session::as_saga(&stem, events);
    if definition["saga"]["steps"].as_array().is_none_or(|s| s.is_empty()) {
        anyhow::bail!("run '{run_id}' made no call that completed or failed: there is nothing to export");
    }
    let before = session::state_before(events, &db.current_state()?)
        .map_err(|e| anyhow::anyhow!("cannot rebuild the store before run '{run_id}': {e}"))?;
    let fixture = path.with_file_name(format!("{stem}.fixture.json"));
    std::fs::write(path, serde_json::to_string_pretty(&definition)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::write(&fixture, before.to_canonical_json())
        .with_context(|| format!("cannot write {}", fixture.display()))?;
    eprintln!("wrote {} and {}", path.display(), fixture.display());
    Ok(Outcome::Success)
}

pub fn state(args: StateArgs) -> anyhow::Result<Outcome> {
    let state: State = match (&args.db, &args.state) {
        (Some(db), _) => backend::open(db, Durability::Normal, false)?.current_state()?,
        (None, Some(path)) => fixture::load(path)?,
        (None, None) => anyhow::bail!("give --db FILE or --state FIXTURE"),
    };
    if args.digest {
        println!("{}", state.digest());
    } else {
        println!("{}", state.to_canonical_json());
    }
    Ok(Outcome::Success)
}
