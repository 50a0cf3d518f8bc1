//! `sagabox serve`: the plugins' tools, and sagas, over MCP.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use sagabox::backend::{Backend, Durability, MemoryBackend};
use sagabox::durable::{DEFAULT_LEASE, Heartbeat};
use sagabox::saga::definition::DurationSpec;
use sagabox::saga::{self, Saga};
use sagabox::serve::http::{self, HttpOptions};
use sagabox::serve::transaction::ending_reason;
use sagabox::serve::{Context, OnDisconnect, OnFailure, Server};
use sagabox::store::{State, fixture};
use tokio_util::sync::CancellationToken;

use super::{Outcome, PluginArgs};

#[derive(clap::Args)]
pub struct Args {
    /// Serve Streamable HTTP at ADDR:PORT (path /mcp) instead of stdio. A non-loopback
    /// address needs --token.
    #[arg(long, value_name = "ADDR:PORT")]
    http: Option<SocketAddr>,

    /// With --http: require `Authorization: Bearer TOKEN` on every request.
    #[arg(long, env = "SAGABOX_TOKEN", requires = "http")]
    token: Option<String>,

    /// With --http: a browser origin allowed besides the local ones (e.g. https://app.example.com:443).
    /// Repeatable.
    #[arg(long = "allow-origin", value_name = "ORIGIN", requires = "http")]
    allow_origins: Vec<String>,

    /// The starting state (a fixture file or directory); with --db, it seeds a new database.
    #[arg(long, value_name = "FIXTURE")]
    state: Option<PathBuf>,

    /// Keep the state, the journal and every transaction in this database (a SQLite file, or
    /// a postgres:// URL that several servers share): after a crash, `sagabox resume --db
    /// FILE|URL` compensates the transactions left open.
    #[arg(long, value_name = "FILE|URL")]
    db: Option<String>,

    /// With --db: normal survives a killed process; full also survives power loss (or, on
    /// PostgreSQL, a crashed server).
    #[arg(long, value_enum, default_value = "normal", requires = "db")]
    durability: Durability,

    /// Serve every saga in DIR as a tool `saga_<name>`.
    #[arg(long, value_name = "DIR")]
    sagas: Vec<PathBuf>,

    /// What a failed call does to the transaction's earlier effects.
    #[arg(long, value_enum, default_value = "compensate")]
    on_failure: Policy,

    /// What happens to an open transaction when its client goes away.
    #[arg(long, value_enum, default_value = "compensate")]
    on_disconnect: Policy,

    /// A transaction (or an HTTP session) with no request for this long is rolled back.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    session_timeout: Duration,

    /// Also offer compensators as tools.
    #[arg(long)]
    expose_compensators: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Policy {
    Compensate,
    Keep,
}

pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    serde_json::from_value::<DurationSpec>(serde_json::Value::String(text.to_string()))
        .map(|d| d.0)
        .map_err(|e| e.to_string())
}

pub async fn run(plugin_args: &PluginArgs, args: Args) -> anyhow::Result<Outcome> {
    let runtime = Arc::new(plugin_args.load().await?);
    let mut sagas = Vec::new();
    for path in saga::saga_files(&args.sagas).context("cannot list the sagas")? {
        sagas.push(Arc::new(Saga::load(&path, &runtime)?));
    }
    let state = match &args.state {
        Some(path) => fixture::load(path)?,
        None => State::default(),
    };
    // Only a database's runs are registered: a resume needs them, and a server without one
    // would keep every session's journal for as long as it runs.
    let (backend, register_runs): (Arc<dyn Backend>, _) = match &args.db {
        None => (Arc::new(MemoryBackend::new(state)), false),
        Some(url) => (super::durable::open_seeded(url, args.durability, &state, args.state.is_some())?, true),
    };
    // The sessions it registers stay its own while it lives.
    let _heartbeat = register_runs.then(|| Heartbeat::start(Arc::clone(&backend), DEFAULT_LEASE));
    let context = Context {
        runtime,
        backend,
        register_runs,
        on_failure: match args.on_failure {
            Policy::Compensate => OnFailure::Compensate,
            Policy::Keep => OnFailure::Keep,
        },
        idle_timeout: args.session_timeout,
    };
    let on_disconnect = match args.on_disconnect {
        Policy::Compensate => OnDisconnect::Compensate,
        Policy::Keep => OnDisconnect::Keep,
    };
    let server = Server::new(context, &sagas, args.expose_compensators, on_disconnect)?;
    match args.http {
        None => server.serve_stdio().await?,
        Some(addr) => {
            let stop = CancellationToken::new();
            let options = HttpOptions {
                addr,
                token: args.token.clone(),
                allowed_origins: args.allow_origins.clone(),
                session_timeout: args.session_timeout,
            };
            let served = http::serve(Arc::clone(&server), options, stop.clone(), |bound| {
                // On stderr, so that scripts binding port 0 learn the port.
                eprintln!("sagabox: serving MCP on http://{bound}/mcp");
            });
            tokio::pin!(served);
            tokio::select! {
                result = &mut served => result?,
                _ = shutdown_signal() => {
                    stop.cancel();
                    served.await?;
                }
            }
        }
    }
    // Whatever is still open when the server stops is treated like a client that left.
    let commit = on_disconnect == OnDisconnect::Keep;
    server.transactions.end_all(commit, ending_reason("server_stopped", "the server stopped")).await;
    Ok(Outcome::Success)
}

/// SIGINT or SIGTERM.
pub(super) async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(term) => term,
            Err(_) => return std::future::pending().await,
        };
        tokio::select! {
            _ = interrupt => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}
