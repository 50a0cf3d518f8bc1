//! The in-memory backend: a [`MemoryStore`], a result cache, and a registry that keeps the
//! runs registered with it and their journals. Other runs' journals live in their reports
//! (and JSON Lines files, if any) only.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use serde_json::Value;

use super::{
    Backend, CommitError, DbError, RegisterError, RunRecord, duplicate_event, finished_status, lock, now_ms,
    this_process,
};
use crate::saga::journal::Event;
use crate::store::{Change, MemoryStore, State, Txn};

/// The in-memory backend.
#[derive(Debug, Default)]
pub struct MemoryBackend {
    pub store: MemoryStore,
    results: Mutex<HashMap<String, Value>>,
    registry: Mutex<Registry>,
}

/// Registered runs and their journals (by run id).
#[derive(Debug, Default)]
struct Registry {
    runs: Vec<RunRecord>,
    journals: HashMap<String, Journal>,
}

/// A registered run's journal (by seq), and where the run is in [`Registry::runs`].
#[derive(Debug)]
struct Journal {
    run: usize,
    events: BTreeMap<u64, Event>,
}

impl Registry {
    /// Refuses `events` of a run another process holds (registered so by a test: in one
    /// process, runs are this process's).
    fn fence(&self, events: &[Event]) -> Result<(), CommitError> {
        for event in events {
            if let Some(journal) = self.journals.get(&event.run_id) {
                CommitError::unless_held(&event.run_id, &self.runs[journal.run].owner)?;
            }
        }
        Ok(())
    }

    /// Refuses `events` if one of them is already recorded.
    fn check(&self, events: &[Event]) -> Result<(), CommitError> {
        match events.iter().find(|e| self.journals.get(&e.run_id).is_some_and(|j| j.events.contains_key(&e.seq))) {
            Some(event) => Err(CommitError::Backend(duplicate_event(event))),
            None => Ok(()),
        }
    }

    /// Appends `events` of registered runs, and records run ends.
    fn append(&mut self, events: &[Event]) {
        for event in events {
            let Some(journal) = self.journals.get_mut(&event.run_id) else { continue };
            journal.events.insert(event.seq, event.clone());
            if let Some(status) = finished_status(event) {
                let run = &mut self.runs[journal.run];
                run.status = status.to_string();
                run.finished_ms = Some(now_ms());
            }
        }
    }
}

/// Makes `run` this process's, under a lease until `lease_until_ms`.
fn take(run: &mut RunRecord, lease_until_ms: u64) {
    run.status = "running".into();
    run.owner = this_process().into();
    run.pid = std::process::id();
    run.lease_until_ms = Some(lease_until_ms);
}

/// Whether a worker may take `run` at `now_ms`: queued, another process's and unfinished
/// with its lease run out, or this process's and not `held` ([`Backend::claim_runs`]).
fn claimable(run: &RunRecord, now_ms: u64, held: &[String]) -> bool {
    let abandoned = match run.owner == this_process() {
        true => !held.contains(&run.run_id),
        false => run.lease_until_ms.is_some_and(|t| t < now_ms),
    };
    run.status == "queued" || (run.status == "running" && abandoned)
}

impl MemoryBackend {
    pub fn new(state: State) -> MemoryBackend {
        MemoryBackend { store: MemoryStore::new(state), ..MemoryBackend::default() }
    }
}

impl Backend for MemoryBackend {
    fn snapshot(&self) -> State {
        self.store.snapshot()
    }

    fn commit(&self, txn: &Txn, result: Option<(&str, &Value)>, events: &[Event]) -> Result<Vec<Change>, CommitError> {
        // Holding the cache and registry locks across the store commit makes the three one
        // atomic step for their readers.
        let mut results = lock(&self.results);
        let mut registry = lock(&self.registry);
        registry.fence(events)?;
        if let Some(output) = result.and_then(|(key, _)| results.get(key)) {
            return Err(CommitError::AlreadyCommitted(output.clone()));
        }
        registry.check(events)?;
        let changes = self.store.commit(txn)?;
        if let Some((key, value)) = result {
            results.insert(key.to_string(), value.clone());
        }
        registry.append(events);
        Ok(changes)
    }

    fn record(&self, events: &[Event]) -> Result<(), CommitError> {
        let mut registry = lock(&self.registry);
        registry.fence(events)?;
        registry.check(events)?;
        registry.append(events);
        Ok(())
    }

    fn cached(&self, key: &str) -> Option<Value> {
        lock(&self.results).get(key).cloned()
    }

    fn name(&self) -> String {
        "memory".into()
    }

    fn current_state(&self) -> Result<State, DbError> {
        Ok(self.store.snapshot())
    }

    fn seed_if_new(&self, state: &State) -> Result<bool, DbError> {
        // The registry's lock keeps a run from registering in between.
        let registry = lock(&self.registry);
        let now = self.store.snapshot();
        let new = now.version() == 0 && now.doc_count() == 0 && registry.runs.is_empty();
        if new {
            self.store.reset(state.clone());
        }
        Ok(new)
    }

    fn register_run(&self, run: &RunRecord) -> Result<(), RegisterError> {
        let mut registry = lock(&self.registry);
        if registry.journals.contains_key(&run.run_id) {
            return Err(RegisterError::Exists { run_id: run.run_id.clone(), db: "memory".into() });
        }
        let journal = Journal { run: registry.runs.len(), events: BTreeMap::new() };
        registry.journals.insert(run.run_id.clone(), journal);
        registry.runs.push(RunRecord { started_ms: now_ms(), finished_ms: None, ..run.clone() });
        Ok(())
    }

    fn adopt_run(&self, run_id: &str, seen: &RunRecord, lease_until_ms: u64) -> Result<bool, DbError> {
        let mut registry = lock(&self.registry);
        let run = registry
            .runs
            .iter_mut()
            .find(|r| r.run_id == run_id && r.owner == seen.owner && r.pid == seen.pid && r.status == "running");
        Ok(run.map(|r| take(r, lease_until_ms)).is_some())
    }

    fn claim_runs(
        &self,
        now_ms: u64,
        lease_until_ms: u64,
        limit: usize,
        held: &[String],
    ) -> Result<Vec<RunRecord>, DbError> {
        let mut registry = lock(&self.registry);
        let mut claimable: Vec<&mut RunRecord> =
            registry.runs.iter_mut().filter(|r| claimable(r, now_ms, held)).collect();
        claimable.sort_by(|a, b| (a.started_ms, &a.run_id).cmp(&(b.started_ms, &b.run_id)));
        Ok(claimable
            .into_iter()
            .take(limit)
            .map(|r| {
                take(r, lease_until_ms);
                r.clone()
            })
            .collect())
    }

    fn renew_leases(&self, lease_until_ms: u64) -> Result<u64, DbError> {
        let mut registry = lock(&self.registry);
        let mine = registry.runs.iter_mut().filter(|r| r.owner == this_process() && r.status == "running");
        Ok(mine.map(|r| r.lease_until_ms = Some(lease_until_ms)).count() as u64)
    }

    fn runs(&self) -> Result<Vec<RunRecord>, DbError> {
        let mut runs = lock(&self.registry).runs.clone();
        runs.sort_by(|a, b| (a.started_ms, &a.run_id).cmp(&(b.started_ms, &b.run_id)));
        Ok(runs)
    }

    fn unfinished_runs(&self) -> Result<Vec<RunRecord>, DbError> {
        let mut runs = self.runs()?;
        runs.retain(|r| r.status == "queued" || r.status == "running");
        Ok(runs)
    }

    fn events(&self, run_id: &str) -> Result<Vec<Event>, DbError> {
        Ok(lock(&self.registry).journals.get(run_id).map(|j| j.events.values().cloned().collect()).unwrap_or_default())
    }

    fn journal_bytes(&self, run_id: &str) -> Result<u64, DbError> {
        let registry = lock(&self.registry);
        let events = registry.journals.get(run_id).into_iter().flat_map(|j| j.events.values());
        Ok(events.map(|e| serde_json::to_string(e).map_or(0, |s| s.len() as u64)).sum())
    }
}
