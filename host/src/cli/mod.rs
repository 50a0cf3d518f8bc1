//! The command line: argument parsing, output formatting and exit codes. Library errors
//! become `anyhow` errors here, at the edge.
//!
//! Exit codes: 0 success; 1 the call or saga did not succeed (the output says why); 2 the
//! command could not run (bad arguments, unreadable or invalid input, plugin load failure).

mod bench;
mod bench_durable;
mod call;
mod durable;
mod fixtures;
mod new;
mod plugins;
mod queue;
mod run;
mod serve;
mod serve_bench;
mod verify;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use sagabox::runtime::{Operator, Runtime, RuntimeOptions};

/// A WebAssembly plugin host that runs sagas of sandboxed tool calls, rolls back failed
/// ones, and verifies that every rollback restores the state.
#[derive(Parser)]
#[command(name = "sagabox", version, propagate_version = true)]
struct Cli {
    #[command(flatten)]
    plugins: PluginArgs,

    /// More log output on stderr (-v: debug, -vv: trace). SAGABOX_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,

    #[command(subcommand)]
    command: Command,
}

/// Where plugins come from.
#[derive(clap::Args, Clone)]
pub struct PluginArgs {
    /// Also load every *.wasm in DIR (with DIR/<name>.policy.toml as its policy). Repeatable.
    #[arg(long = "plugins", value_name = "DIR", global = true)]
    dirs: Vec<PathBuf>,

    /// Do not load the bundled plugins.
    #[arg(long, global = true)]
    no_bundled: bool,

    /// Cache compiled plugins in DIR [default: $XDG_CACHE_HOME/sagabox or ~/.cache/sagabox].
    #[arg(long, value_name = "DIR", env = "SAGABOX_CACHE_DIR", global = true)]
    cache_dir: Option<PathBuf>,

    /// Compile every plugin afresh and cache nothing.
    #[arg(long, global = true)]
    no_cache: bool,

    /// The operator's ceiling on what plugin policies may be granted (TOML; see "Policies"
    /// in the README). Without it, directory plugins get no host directory, environment or
    /// network, and at most the default limits.
    #[arg(long, value_name = "FILE", env = "SAGABOX_OPERATOR", global = true)]
    operator: Option<PathBuf>,
}

impl PluginArgs {
    pub fn options(&self) -> RuntimeOptions {
        let defaults = RuntimeOptions::default();
        RuntimeOptions {
            bundled: !self.no_bundled,
            plugin_dirs: self.dirs.clone(),
            cache_dir: if self.no_cache { None } else { self.cache_dir.clone().or(defaults.cache_dir) },
            ..defaults
        }
    }

    /// The options, with the operator's ceiling read from its file.
    pub fn options_with_operator(&self) -> anyhow::Result<RuntimeOptions> {
        let operator = match &self.operator {
            Some(path) => Operator::load(path)?,
            None => Operator::default(),
        };
        Ok(RuntimeOptions { operator, ..self.options() })
    }

    /// The plugins that load; each one that does not is reported on stderr (naming its file)
    /// and the others still serve.
    pub async fn load(&self) -> anyhow::Result<Runtime> {
        Ok(self.load_reporting().await?.0)
    }

    /// [`PluginArgs::load`], also telling how many plugins did not load.
    pub async fn load_reporting(&self) -> anyhow::Result<(Runtime, usize)> {
        let (runtime, errors) =
            Runtime::load_partial(self.options_with_operator()?).await.context("cannot load the plugins")?;
        for error in &errors {
            eprintln!("warning: plugin not loaded: {error}");
        }
        Ok((runtime, errors.len()))
    }
}

#[derive(Subcommand)]
enum Command {
    /// List the loaded plugins, their tools, compensators, SHA-256 and limits.
    Plugins(plugins::Args),
    /// Call one tool in a sandbox and print its JSON result.
    Call(call::Args),
    /// Run a saga; on failure, compensate the completed steps.
    Run(run::RunArgs),
    /// Finish the unfinished runs of a durable database (after a crash).
    Resume(durable::ResumeArgs),
    /// Queue runs of a saga in a database, for workers; prints their ids.
    Submit(queue::SubmitArgs),
    /// Take queued runs (and runs whose holder died) from a database and run them.
    Worker(queue::WorkerArgs),
    /// List the runs of a durable database.
    Runs(durable::RunsArgs),
    /// Print a run's journal from a durable database, as JSON Lines.
    Journal(durable::JournalArgs),
    /// Print a database's (or fixture's) state as canonical JSON, or its digest.
    State(durable::StateArgs),
    /// Check sagas against the loaded plugins without running them.
    Validate(run::ValidateArgs),
    /// Run a rollback verification campaign over sagas; fails when any case fails.
    Verify(verify::Args),
    /// Serve the plugins' tools (and sagas) to agents over MCP; a session is a saga.
    Serve(serve::Args),
    /// Generate large seeded fixtures.
    #[command(subcommand)]
    Fixtures(fixtures::Command),
    /// Measure plugin loading and per-call costs; prints numbers.
    Bench(bench::Args),
    /// Write a ready-to-build plugin project (Rust, Python or JavaScript) with a saga.
    New(new::Args),
}

/// What a command reports back: success, or a failure the output already explained.
pub enum Outcome {
    Success,
    Failure,
}

pub fn main() -> ExitCode {
    restore_sigpipe();
    let cli = Cli::parse();
    init_logging(cli.verbose);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Plugins(args) => plugins::run(&cli.plugins, args).await,
            Command::Call(args) => call::run(&cli.plugins, args).await,
            Command::Run(args) => run::run(&cli.plugins, args).await,
            Command::Validate(args) => run::validate(&cli.plugins, args).await,
            Command::Resume(args) => durable::resume(&cli.plugins, args).await,
            Command::Submit(args) => queue::submit(&cli.plugins, args).await,
            Command::Worker(args) => queue::worker(&cli.plugins, args).await,
            Command::Runs(args) => durable::runs(args).await,
            Command::Journal(args) => durable::journal(args),
            Command::State(args) => durable::state(args),
            Command::Verify(args) => verify::run(&cli.plugins, args).await,
            Command::Serve(args) => serve::run(&cli.plugins, args).await,
            Command::Fixtures(command) => fixtures::run(command),
            Command::Bench(args) => bench::run(&cli.plugins, args).await,
            Command::New(args) => new::run(args),
        }
    });
    match result {
        Ok(Outcome::Success) => ExitCode::SUCCESS,
        Ok(Outcome::Failure) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Lets a closed pipe end the process quietly (`sagabox verify … | head`), as Unix tools do,
/// instead of making `println!` panic on the broken pipe.
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: setting a signal disposition to its default, before any other thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "debug",
        _ => "trace",
    };
    // A plugin's first compile can take tens of seconds: say so, and which plugin.
    let default = format!("{default},{}=info", sagabox::runtime::COMPILE_PROGRESS);
    let filter = tracing_subscriber::EnvFilter::try_from_env("SAGABOX_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // No colour codes in logs that go to a file or a pipe.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).try_init();
}

/// Reads a JSON value given inline or as `@FILE` / a path to an existing file.
pub fn json_arg(text: &str, what: &str) -> anyhow::Result<serde_json::Value> {
    let path = text.strip_prefix('@').map(PathBuf::from).or_else(|| {
        let p = PathBuf::from(text);
        (!text.trim_start().starts_with(['{', '[', '"']) && p.is_file()).then_some(p)
    });
    let (source, body) = match path {
        Some(path) => {
            let body = std::fs::read_to_string(&path)
                .with_context(|| format!("cannot read {what} file {}", path.display()))?;
            (format!("{what} file {}", path.display()), body)
        }
        None => (what.to_string(), text.to_string()),
    };
    serde_json::from_str(&body).with_context(|| format!("{source} is not valid JSON"))
}
