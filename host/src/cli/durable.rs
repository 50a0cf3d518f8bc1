//! `sagabox resume`, `runs`, `journal` and `state`: working with a durable database.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use sagabox::backend::{Backend, Durability, SqliteBackend};
use sagabox::saga::session::{self, SESSION_SOURCE};
use sagabox::saga::{self, RunOptions, Saga, Status};
use sagabox::store::{State, fixture};

use super::run::print_summary;
use super::{Outcome, PluginArgs};

/// Where a durable run keeps everything.
#[derive(clap::Args, Clone)]
pub struct DbArgs {
    /// The SQLite database (it must exist: `sagabox run --db` creates it).
    #[arg(long, value_name = "FILE")]
    pub db: PathBuf,
    /// normal: survives a killed process (WAL, synchronous=NORMAL); full: also power loss
    /// (an fsync per commit).
    #[arg(long, value_enum, default_value = "normal")]
    pub durability: Durability,
}

impl DbArgs {
    pub fn open(&self) -> anyhow::Result<SqliteBackend> {
        Ok(SqliteBackend::open_existing(&self.db, self.durability)?)
    }
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
    #[arg(long)]
    json: bool,
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
    /// Read a database...
    #[arg(long, value_name = "FILE", conflicts_with = "state", required_unless_present = "state")]
    db: Option<PathBuf>,
    /// ...or a fixture file or directory.
    #[arg(long, value_name = "FIXTURE")]
    state: Option<PathBuf>,
    /// Print the SHA-256 digest (the one `verify` uses) instead of the canonical JSON.
    #[arg(long)]
    digest: bool,
}

/// Whether process `pid` is alive on this machine.
fn alive(pid: u32) -> bool {
    #[cfg(unix)]
    {
        // 0 and negative pids name process groups or every process for kill(2): never a run's.
        let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
        if pid <= 0 || pid as u32 == std::process::id() {
            return false;
        }
        // SAFETY: signal 0 only checks that the process exists.
        let found = unsafe { libc::kill(pid, 0) } == 0;
        // EPERM: it exists, under another user.
        found || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        false
    }
}

pub async fn resume(plugin_args: &PluginArgs, args: ResumeArgs) -> anyhow::Result<Outcome> {
    let runtime = plugin_args.load().await?;
    let db = args.db.open()?;
    let runs: Vec<_> = db
        .runs()?
        .into_iter()
        .filter(|r| r.status == "running" && args.run_id.as_ref().is_none_or(|id| id == &r.run_id))
        .collect();
    if let Some(id) = &args.run_id
        && runs.is_empty()
    {
        anyhow::bail!(
            "{}: no unfinished run '{id}' (see `sagabox runs --db {}`)",
            args.db.db.display(),
            args.db.db.display()
        );
    }
    let mut all_completed = true;
    let mut cannot = Vec::new();
    for record in runs {
        if alive(record.pid) && !args.force {
            eprintln!("skipping run {}: its process {} is still alive (use --force)", record.run_id, record.pid);
            continue;
        }
        if record.saga_path == SESSION_SOURCE {
            // An agent's session: its client cannot come back, so its transaction is undone.
            if !db.adopt_run(&record.run_id, record.pid)? {
                eprintln!("skipping session {}: another process took it over", record.run_id);
                continue;
            }
            let mut options = RunOptions::new(record.run_id.clone(), record.input.clone());
            options.resume = db.events(&record.run_id)?;
            let report = session::abort_interrupted(&runtime, &db, &record.saga, options).await;
            // A session's resume succeeds when everything was undone.
            all_completed &= report.compensation_failures.is_empty();
            report_run(&report, args.json)?;
            continue;
        }
        // A run that cannot be rebuilt (its saga no longer validates against the loaded
        // plugins) is reported; the others are still resumed.
        let saga = match Saga::from_text(&record.definition, Path::new(&record.saga_path), &runtime) {
            Ok(saga) => saga,
            Err(e) => {
                eprintln!("error: cannot resume run {}: {e}", record.run_id);
                cannot.push(record.run_id);
                continue;
            }
        };
        // Another resume may have taken it since we listed the runs: only one runs it.
        if !db.adopt_run(&record.run_id, record.pid)? {
            eprintln!("skipping run {}: another process took it over", record.run_id);
            continue;
        }
        let mut options = RunOptions::new(record.run_id.clone(), record.input.clone());
        options.seed = record.seed;
        options.resume = db.events(&record.run_id)?;
        let report = saga::run(&runtime, &saga, &db, options).await;
        all_completed &= report.status == Status::Completed;
        report_run(&report, args.json)?;
    }
    if !cannot.is_empty() {
        anyhow::bail!("{} run(s) left unfinished: {}", cannot.len(), cannot.join(", "));
    }
    Ok(if all_completed { Outcome::Success } else { Outcome::Failure })
}

fn report_run(report: &saga::RunReport, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        print_summary(report);
    }
    Ok(())
}

pub fn runs(args: RunsArgs) -> anyhow::Result<Outcome> {
    let db = args.db.open()?;
    let runs = db.runs()?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&runs)?);
        return Ok(Outcome::Success);
    }
    let mut table = Table::new();
    table.load_preset(UTF8_BORDERS_ONLY).set_header(["run", "saga", "status", "started (unix ms)", "journal bytes"]);
    for run in &runs {
        let bytes = db.journal_bytes(&run.run_id)?;
        table.add_row([
            run.run_id.clone(),
            run.saga.clone(),
            run.status.clone(),
            run.started_ms.to_string(),
            bytes.to_string(),
        ]);
    }
    println!("{table}");
    Ok(Outcome::Success)
}

pub fn journal(args: JournalArgs) -> anyhow::Result<Outcome> {
    let db = args.db.open()?;
    let events = db.events(&args.run_id)?;
    if events.is_empty() && !db.runs()?.iter().any(|r| r.run_id == args.run_id) {
        anyhow::bail!("{}: no run '{}'", args.db.db.display(), args.run_id);
    }
    if let Some(path) = &args.as_saga {
        return export_saga(&db, &args.run_id, &events, path);
    }
    for event in events {
        println!("{}", serde_json::to_string(&event)?);
    }
    Ok(Outcome::Success)
}

/// `journal --as-saga`: the run as a saga file and its fixture.
fn export_saga(
    db: &SqliteBackend,
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
        (Some(db), _) => SqliteBackend::open_existing(db, Durability::Normal)?.current_state()?,
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
