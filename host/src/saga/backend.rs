//! Where a run keeps its state: the store, the idempotency result cache and the journal,
//! committed together.

use std::collections::HashMap;
use std::sync::Mutex;

use serde_json::Value;

use super::journal::Event;
use crate::store::{Change, Conflict, MemoryStore, State, Txn};

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

/// A run's state. A call's writes, its cached result and the journal events that record it
/// commit together or not at all.
pub trait Backend: Send + Sync {
    /// The current state (O(1)).
    fn snapshot(&self) -> State;

    /// Commits `txn` if nothing it read has changed, with `result` cached under its
    /// idempotency key and `events` appended to the journal. When `result`'s key is already
    /// cached, nothing is written and the cached output comes back as
    /// [`CommitError::AlreadyCommitted`]: the check and the write are one atomic step.
    fn commit(&self, txn: &Txn, result: Option<(&str, &Value)>, events: &[Event]) -> Result<Vec<Change>, CommitError>;

    /// Appends events that come with no state change.
    fn record(&self, events: &[Event]) -> Result<(), CommitError>;

    /// The cached result of the call with this idempotency key, if it succeeded before.
    fn cached(&self, key: &str) -> Option<Value>;

    /// Whether commits may block on storage (files, network): the engine then makes them
    /// off the async workers.
    fn blocks(&self) -> bool {
        false
    }
}

/// The in-memory backend: a [`MemoryStore`] and a result cache; the journal lives in the
/// run's report (and its JSON Lines file, if any).
#[derive(Debug, Default)]
pub struct MemoryBackend {
    pub store: MemoryStore,
    results: Mutex<HashMap<String, Value>>,
}

impl MemoryBackend {
    pub fn new(state: State) -> MemoryBackend {
        MemoryBackend { store: MemoryStore::new(state), results: Mutex::default() }
    }
}

impl Backend for MemoryBackend {
    fn snapshot(&self) -> State {
        self.store.snapshot()
    }

    fn commit(&self, txn: &Txn, result: Option<(&str, &Value)>, _events: &[Event]) -> Result<Vec<Change>, CommitError> {
        // Holding the cache lock across the store commit makes the pair atomic for readers
        // of `cached`.
        let mut results = self.results.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(output) = result.and_then(|(key, _)| results.get(key)) {
            return Err(CommitError::AlreadyCommitted(output.clone()));
        }
        let changes = self.store.commit(txn)?;
        if let Some((key, value)) = result {
            results.insert(key.to_string(), value.clone());
        }
        Ok(changes)
    }

    fn record(&self, _events: &[Event]) -> Result<(), CommitError> {
        Ok(())
    }

    fn cached(&self, key: &str) -> Option<Value> {
        self.results.lock().unwrap_or_else(|p| p.into_inner()).get(key).cloned()
    }
}
