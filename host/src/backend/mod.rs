//! Where runs keep everything durable: the store's writes, the idempotency result cache,
//! the run registry and the journal, behind one [`Backend`] trait.
//!
//! - [`memory`]: in this process only (verify campaigns, runs and servers without `--db`);
//! - [`sqlite`]: one SQLite file, so that a saga killed at any instant can be resumed.
//!
//! Every backend passes the same conformance suite (`tests/backend.rs`).

pub mod memory;
pub mod sqlite;

use serde::Serialize;
use serde_json::Value;

use crate::saga::journal::{Event, EventKind};
use crate::store::{Change, Conflict, State, Txn};

pub use memory::MemoryBackend;
pub use sqlite::{Durability, SqliteBackend};

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
}

/// A storage error, naming the database.
#[derive(Debug, thiserror::Error)]
#[error("database {db}: {error}")]
pub struct DbError {
    /// The database as the user named it (a file's path).
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
    /// `running` until the run finishes, then its final status.
    pub status: String,
    /// The process that runs it (a resume leaves alone runs whose process is alive).
    pub pid: u32,
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
            started_ms: 0,
            finished_ms: None,
        }
    }
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

    /// Whether commits may block on storage (files, network): the engine then makes them
    /// off the async workers.
    fn blocks(&self) -> bool {
        false
    }

    /// Registers a run that is about to start; its journal is kept from then on (the memory
    /// backend keeps only registered runs' journals, so runs nobody lists cost nothing).
    fn register_run(&self, run: &RunRecord) -> Result<(), RegisterError>;

    /// Takes over an unfinished run from process `seen_pid`, the one the caller saw running
    /// it: a compare-and-swap, so that of two processes resuming it at once only one gets
    /// it. Returns whether this process got it.
    fn adopt_run(&self, run_id: &str, seen_pid: u32) -> Result<bool, DbError>;

    /// Every run, oldest first.
    fn runs(&self) -> Result<Vec<RunRecord>, DbError>;

    /// A run's journal as written so far, in order.
    fn events(&self, run_id: &str) -> Result<Vec<Event>, DbError>;

    /// Bytes of journal records a run wrote (as JSON).
    fn journal_bytes(&self, run_id: &str) -> Result<u64, DbError>;
}

/// The status a run ends with, when `event` ends it.
fn finished_status(event: &Event) -> Option<&str> {
    (event.event == EventKind::SagaFinished)
        .then(|| event.data.as_ref().and_then(|d| d.get("status")).and_then(Value::as_str).unwrap_or("finished"))
}

/// A journal record that is already there.
fn duplicate_event(event: &Event) -> String {
    format!("run '{}': journal record seq {} already exists", event.run_id, event.seq)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
