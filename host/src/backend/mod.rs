//! Where runs keep everything durable: the store's writes, the idempotency result cache,
//! the run registry and the journal, behind one [`Backend`] trait.
//!
//! - [`memory`]: in this process only (verify campaigns, runs and servers without `--db`);
//! - [`sqlite`]: one SQLite file, so that a saga killed at any instant can be resumed;
//! - [`postgres`]: one PostgreSQL database that many processes on many machines share.
//!
//! [`open`] picks one from what the user gave `--db`: a `postgres://` URL or a file.
//!
//! Every backend passes the same conformance suite (`tests/backend.rs`).

mod group;
pub mod memory;
pub mod postgres;
pub mod sqlite;
#[cfg(test)]
mod testing;

use crate::ids::now_ms;
use crate::sync::lock;
use std::path::Path;
use std::sync::Arc;

use serde::Serialize;
use serde_json::Value;

use crate::saga::journal::{Event, EventKind};
use crate::store::{Change, Conflict, State, Txn};

pub use memory::MemoryBackend;
pub use postgres::PostgresBackend;
pub use sqlite::{Durability, SqliteBackend};

/// How long a process holds a run without renewing its lease (`durable::Heartbeat` renews
/// it every third of that).
pub const DEFAULT_LEASE: std::time::Duration = std::time::Duration::from_secs(15);

/// Why a commit did not happen. Nothing was written either way.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommitError {
    #[error(transparent)]
    Conflict(#[from] Conflict),
    #[error("the state backend failed: {0}")]
    Backend(String),
    /// A commit under the same idempotency key happened first (another delivery of the same
    /// call, possibly from another process): this one is dropped, and that one's result
    /// stands.
    #[error("already committed under this idempotency key")]
    AlreadyCommitted(Value),
    /// The run is no longer this process's: its lease ran out (the process was stalled, or
    /// cut off from the database) and another process took it over, which now writes its
    /// journal. This process must stop the run and write nothing more of it.
    #[error("run '{run_id}' was taken over by {owner} (this process's lease on it ran out)")]
    TakenOver { run_id: String, owner: String },
}

impl CommitError {
    /// Refuses a write of `run_id`'s journal when its registry row names `owner` and that
    /// is another process ([`holds`]).
    pub(crate) fn unless_held(run_id: &str, owner: &str) -> Result<(), CommitError> {
        match holds(owner) {
            true => Ok(()),
            false => Err(CommitError::TakenOver { run_id: run_id.to_string(), owner: owner.to_string() }),
        }
    }
}

/// Whether this process may write the journal of a run whose registry row names `owner`:
/// its own run, or one from before owners were recorded (empty). A commit checks it in its
/// transaction, so that a process whose run was taken over while it stalled (a fence) never
/// writes into the new owner's journal.
pub(crate) fn holds(owner: &str) -> bool {
    owner.is_empty() || owner == this_process()
}

/// A storage error, naming the database.
#[derive(Debug, thiserror::Error)]
#[error("database {db}: {error}")]
pub struct DbError {
    /// The database as the user named it (a file's path, a URL without its password).
    pub db: String,
    pub error: String,
}

/// Why a run could not be registered.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error("run '{run_id}' already exists in {db}")]
    Exists { run_id: String, db: String },
    #[error(transparent)]
    Db(#[from] DbError),
}

/// A run as the registry records it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunRecord {
    pub run_id: String,
    pub saga: String,
    pub saga_path: String,
    /// The saga file's text when the run started (a resume uses it, not the file).
    #[serde(skip)]
    pub definition: String,
    pub input: Value,
    pub seed: u64,
    /// `queued` until a worker takes it (`sagabox submit`), `running` until it finishes,
    /// then its final status.
    pub status: String,
    /// The process that runs it, on the machine `owner` names.
    pub pid: u32,
    /// Who holds the run: `host/pid/nonce` of a process ([`this_process`]); empty while
    /// queued, and in databases from before leases.
    pub owner: String,
    /// Until when the owner holds it (unix ms): the owner renews its leases while it lives,
    /// and a run whose lease ran out is free for a worker to take over.
    pub lease_until_ms: Option<u64>,
    /// Set by the registry when the run is registered.
    pub started_ms: u64,
    pub finished_ms: Option<u64>,
}

impl RunRecord {
    /// A run this process is about to start.
    pub fn starting(
        run_id: &str,
        saga: &str,
        saga_path: &str,
        definition: String,
        input: &Value,
        seed: u64,
    ) -> RunRecord {
        RunRecord {
            run_id: run_id.to_string(),
            saga: saga.to_string(),
            saga_path: saga_path.to_string(),
            definition,
            input: input.clone(),
            seed,
            status: "running".into(),
            pid: std::process::id(),
            owner: this_process().to_string(),
            lease_until_ms: Some(now_ms() + DEFAULT_LEASE.as_millis() as u64),
            started_ms: 0,
            finished_ms: None,
        }
    }

    /// A run for a worker to take: queued, nobody's yet.
    pub fn queued(mut self) -> RunRecord {
        self.status = "queued".into();
        self.owner.clear();
        self.pid = 0;
        self.lease_until_ms = None;
        self
    }

    /// The machine of the process that holds the run, if it names one.
    pub fn owner_host(&self) -> Option<&str> {
        self.owner.split('/').next().filter(|h| !h.is_empty())
    }
}

/// This process as run owners name it: `host/pid/nonce` (the nonce tells apart two lives of
/// one pid).
pub fn this_process() -> &'static str {
    static OWNER: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    OWNER.get_or_init(|| format!("{}/{}/{:08x}", this_host(), std::process::id(), rand::random::<u32>()))
}

/// This machine's name (`localhost` if it has none).
pub fn this_host() -> &'static str {
    static HOST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HOST.get_or_init(|| {
        let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().replace('/', "_");
        if name.is_empty() { "localhost".into() } else { name }
    })
}

/// What [`Backend::cached_or_snapshot`] found.
pub enum BeforeCall {
    /// An earlier delivery's result: the call is not run again.
    Cached(Value),
    /// No result cached: the state to run the call on.
    Fresh(State),
}

/// Where runs keep their state. A call's writes, its cached result and the journal events
/// that record it commit together or not at all.
pub trait Backend: Send + Sync {
    /// The current state (O(1)).
    fn snapshot(&self) -> State;

    /// Commits `txn` if nothing it read has changed, with `result` cached under its
    /// idempotency key and `events` appended to the journal. When `result`'s key is already
    /// cached, nothing is written and the cached output comes back as
    /// [`CommitError::AlreadyCommitted`]: the check and the write are one atomic step. A
    /// journal record that is already there refuses the commit too.
    fn commit(&self, txn: &Txn, result: Option<(&str, &Value)>, events: &[Event]) -> Result<Vec<Change>, CommitError>;

    /// Appends events that come with no state change. A backend may hold them until its
    /// next commit, except a run's first and last events.
    fn record(&self, events: &[Event]) -> Result<(), CommitError>;

    /// The cached result of the call with this idempotency key, if it succeeded before.
    fn cached(&self, key: &str) -> Option<Value>;

    /// What a call about to run looks up first: its result cached under `key`, or else the
    /// state to run it on (as [`Backend::snapshot`]). A backend across a network reads both
    /// in one round trip.
    fn cached_or_snapshot(&self, key: &str) -> BeforeCall {
        match self.cached(key) {
            Some(output) => BeforeCall::Cached(output),
            None => BeforeCall::Fresh(self.snapshot()),
        }
    }

    /// Whether commits may block on storage (files, network): the engine then makes them
    /// off the async workers.
    fn blocks(&self) -> bool {
        false
    }

    /// Registers a run that is about to start, or a queued one ([`RunRecord::queued`]), as
    /// `run` describes it (its start time is the registry's); its journal is kept from then
    /// on (the memory backend keeps only registered runs' journals, so runs nobody lists
    /// cost nothing).
    fn register_run(&self, run: &RunRecord) -> Result<(), RegisterError>;

    /// Takes over an unfinished run from `seen`, the holder the caller saw (its owner, or
    /// for databases from before leases its pid): a compare-and-swap, so that of two
    /// processes resuming it at once only one gets it. The run is then this process's, under
    /// a lease until `lease_until_ms`. Returns whether this process got it.
    fn adopt_run(&self, run_id: &str, seen: &RunRecord, lease_until_ms: u64) -> Result<bool, DbError>;

    /// Takes up to `limit` runs for this process, under a lease until `lease_until_ms`:
    /// queued runs; unfinished runs of other processes whose lease ran out before `now_ms`
    /// (their owner died, or stalled: its later commits are then refused with
    /// [`CommitError::TakenOver`]); and this process's own unfinished runs that are not in
    /// `held`, the runs its caller holds on purpose (it runs them, or gave up on them): an
    /// earlier claim or adoption whose answer was lost took those, and nothing runs them.
    /// Oldest first. Two processes never take the same run.
    fn claim_runs(
        &self,
        now_ms: u64,
        lease_until_ms: u64,
        limit: usize,
        held: &[String],
    ) -> Result<Vec<RunRecord>, DbError>;

    /// Extends to `lease_until_ms` the lease of every unfinished run this process holds;
    /// returns how many it holds.
    fn renew_leases(&self, lease_until_ms: u64) -> Result<u64, DbError>;

    /// The database as messages name it (a file's path, a URL without its password).
    fn name(&self) -> String;

    /// The state as the database holds it now, read from it (not this process's copy).
    fn current_state(&self) -> Result<State, DbError>;

    /// Writes `state` as the starting state if the database holds no state and no run yet;
    /// returns whether it did. The check and the write are one atomic step: two processes
    /// starting on a new database at once seed it once, and never over a committed step.
    fn seed_if_new(&self, state: &State) -> Result<bool, DbError>;

    /// Every run, oldest first.
    fn runs(&self) -> Result<Vec<RunRecord>, DbError>;

    /// The queued and running runs, oldest first: what workers and `resume` look at, read
    /// without the finished ones (which pile up).
    fn unfinished_runs(&self) -> Result<Vec<RunRecord>, DbError>;

    /// A run's journal as written so far, in order.
    fn events(&self, run_id: &str) -> Result<Vec<Event>, DbError>;

    /// Bytes of journal records a run wrote (as JSON).
    fn journal_bytes(&self, run_id: &str) -> Result<u64, DbError>;
}

/// Runs `f`, a call on `backend` that may block on its storage, off the async workers when
/// it can block and the caller is on a multi-threaded runtime (so that other tasks go on
/// meanwhile, e.g. the runs whose steps a group commit is waiting for).
pub fn blocking<R>(backend: &dyn Backend, f: impl FnOnce() -> R) -> R {
    let multi_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if backend.blocks() && multi_thread { tokio::task::block_in_place(f) } else { f() }
}

/// Opens the database `db` names: a `postgres://` (or `postgresql://`) URL, or else a
/// SQLite file. `create`: whether a missing SQLite file may be created (commands that only
/// read or finish runs never create one). `durability`: see [`Durability`] and
/// [`PostgresBackend::open_durable`].
pub fn open(db: &str, durability: Durability, create: bool) -> Result<Arc<dyn Backend>, DbError> {
    if postgres::is_postgres_url(db) {
        return Ok(Arc::new(PostgresBackend::open_durable(db, durability)?));
    }
    let path = Path::new(db);
    Ok(Arc::new(if create {
        SqliteBackend::open(path, durability)?
    } else {
        SqliteBackend::open_existing(path, durability)?
    }))
}

/// A stored document: namespace, key, canonical text (None once deleted), the version of
/// the commit that wrote it.
pub(crate) type DocRow = (String, String, Option<String>, u64);

/// Brings `state` up to `version` with the documents written since its own version, in
/// version order, applied commit by commit. The state then takes `version` itself, so that
/// a commit that wrote no document never makes a later catch-up skip another's.
pub(crate) fn apply_commits(state: &mut State, rows: &[DocRow], version: u64) {
    for commit in rows.chunk_by(|a, b| a.3 == b.3) {
        let writes: Vec<(&str, &str, Option<std::sync::Arc<str>>)> = commit
            .iter()
            .map(|(ns, key, body, _)| (ns.as_str(), key.as_str(), body.as_deref().map(Into::into)))
            .collect();
        state.apply(commit[0].3, writes.iter().map(|(ns, key, body)| (*ns, *key, body.as_ref())));
    }
    state.apply(version, std::iter::empty());
}

/// Whether `events` must be written at once: a run's first and last events. Events that
/// change no state otherwise wait for the next commit.
fn write_at_once(events: &[Event]) -> bool {
    events.iter().any(|e| matches!(e.event, EventKind::SagaStarted | EventKind::SagaResumed | EventKind::SagaFinished))
}

/// The runs [`Backend::unfinished_runs`] lists, as SQL.
const UNFINISHED: &str = "status IN ('queued', 'running')";

/// The status a run ends with, when `event` ends it.
fn finished_status(event: &Event) -> Option<&str> {
    (event.event == EventKind::SagaFinished)
        .then(|| event.data.as_ref().and_then(|d| d.get("status")).and_then(Value::as_str).unwrap_or("finished"))
}

/// A journal record that is already there.
fn duplicate_event(event: &Event) -> String {
    duplicate_record(&event.run_id, event.seq)
}

/// The journal record `seq` of `run_id` is already there.
fn duplicate_record(run_id: &str, seq: u64) -> String {
    format!("run '{run_id}': journal record seq {seq} already exists")
}
