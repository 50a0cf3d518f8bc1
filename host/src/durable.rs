//! The durable backend: the store, the idempotency result cache, the run registry and the
//! journal in one SQLite database, so that a saga killed at any instant can be resumed.
//!
//! A call's writes, its cached result and the journal events that record it commit in one
//! SQLite transaction: the state and the journal never disagree. The database runs in WAL
//! mode. `synchronous=NORMAL` (the default) survives a killed process: every committed
//! transaction is in the WAL; after a power loss the last transactions may be lost, but the
//! database stays consistent with its journal. `synchronous=FULL` also survives power loss
//! at the cost of an fsync per commit.
//!
//! Each process keeps the state in memory (an O(1)-snapshot [`State`]) and catches up with
//! commits of other processes (`PRAGMA data_version`); a commit is validated against the
//! database under its write lock, so concurrent processes never lose updates.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};
use serde::Serialize;
use serde_json::Value;

use crate::saga::backend::{Backend, CommitError};
use crate::saga::journal::{Event, EventKind};
use crate::store::{Change, State, Txn};

/// How hard commits push to disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Durability {
    /// `synchronous=NORMAL` in WAL mode: survives a killed process.
    Normal,
    /// `synchronous=FULL`: also survives power loss; an fsync per commit.
    Full,
}

/// A database error, naming the file.
#[derive(Debug, thiserror::Error)]
#[error("database {path}: {error}")]
pub struct DbError {
    pub path: PathBuf,
    pub error: String,
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

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('version', 0), ('schema', 1);
-- Documents; a deleted one keeps its row with a NULL body, so other processes see the delete.
CREATE TABLE IF NOT EXISTS docs (
    ns TEXT NOT NULL, key TEXT NOT NULL, body TEXT, version INTEGER NOT NULL,
    PRIMARY KEY (ns, key)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS docs_by_version ON docs (version);
CREATE TABLE IF NOT EXISTS namespaces (ns TEXT PRIMARY KEY, keys_version INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS results (key TEXT PRIMARY KEY, run_id TEXT NOT NULL, output TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, saga TEXT NOT NULL, saga_path TEXT NOT NULL, definition TEXT NOT NULL,
    input TEXT NOT NULL, seed INTEGER NOT NULL, status TEXT NOT NULL, pid INTEGER NOT NULL,
    started_ms INTEGER NOT NULL, finished_ms INTEGER);
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT NOT NULL, seq INTEGER NOT NULL, body TEXT NOT NULL, PRIMARY KEY (run_id, seq)) WITHOUT ROWID;
";

/// The SQLite backend.
pub struct SqliteBackend {
    path: PathBuf,
    conn: Mutex<Connection>,
    /// The state as of the last commit this process saw.
    state: RwLock<State>,
    /// `PRAGMA data_version` when `state` was last brought up to date.
    data_version: Mutex<i64>,
    /// Events with no state change, written with the next commit (or at a run's start and end).
    pending: Mutex<Vec<Event>>,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl SqliteBackend {
    /// Opens (or creates) the database at `path`.
    pub fn open(path: &Path, durability: Durability) -> Result<SqliteBackend, DbError> {
        let fail = |e: rusqlite::Error| DbError { path: path.to_path_buf(), error: e.to_string() };
        let conn = Connection::open(path).map_err(fail)?;
        conn.busy_timeout(Duration::from_secs(30)).map_err(fail)?;
        conn.pragma_update(None, "journal_mode", "WAL").map_err(fail)?;
        let sync = match durability {
            Durability::Normal => "NORMAL",
            Durability::Full => "FULL",
        };
        conn.pragma_update(None, "synchronous", sync).map_err(fail)?;
        conn.execute_batch(SCHEMA).map_err(fail)?;
        let backend = SqliteBackend {
            path: path.to_path_buf(),
            conn: Mutex::new(conn),
            state: RwLock::new(State::default()),
            data_version: Mutex::new(-1),
            pending: Mutex::new(Vec::new()),
        };
        backend.reload()?;
        Ok(backend)
    }

    fn error(&self, e: impl std::fmt::Display) -> DbError {
        DbError { path: self.path.clone(), error: e.to_string() }
    }

    /// Reads the whole state from the database.
    fn reload(&self) -> Result<(), DbError> {
        let conn = lock(&self.conn);
        let state = self.read_state(&conn)?;
        let version = data_version(&conn).map_err(|e| self.error(e))?;
        *self.state.write().unwrap_or_else(|p| p.into_inner()) = state;
        *lock(&self.data_version) = version;
        Ok(())
    }

    fn read_state(&self, conn: &Connection) -> Result<State, DbError> {
        let version: i64 = conn
            .query_row("SELECT value FROM meta WHERE name = 'version'", [], |r| r.get(0))
            .map_err(|e| self.error(e))?;
        let mut stmt = conn
            .prepare("SELECT ns, key, body, version FROM docs WHERE body IS NOT NULL ORDER BY ns, key")
            .map_err(|e| self.error(e))?;
        let rows = stmt
            .query_map([], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, String>(2)?, r.get::<_, i64>(3)?))
            })
            .map_err(|e| self.error(e))?;
        let mut docs = Vec::new();
        for row in rows {
            let (ns, key, body, v) = row.map_err(|e| self.error(e))?;
            docs.push((ns, key, body, v as u64));
        }
        let mut keys = conn.prepare("SELECT ns, keys_version FROM namespaces").map_err(|e| self.error(e))?;
        let keys_versions = keys
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)? as u64)))
            .map_err(|e| self.error(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.error(e))?;
        Ok(State::from_versioned(docs, keys_versions, version as u64))
    }

    /// Brings the in-memory state up to date when another connection has committed.
    fn catch_up(&self, conn: &Connection) -> Result<(), DbError> {
        let version = data_version(conn).map_err(|e| self.error(e))?;
        let mut seen = lock(&self.data_version);
        if *seen == version {
            return Ok(());
        }
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        // Only the documents written since our last commit, commit by commit (deleted ones
        // keep their row with a NULL body), applied as the writing commit applied them.
        let mut stmt = conn
            .prepare_cached("SELECT ns, key, body, version FROM docs WHERE version > ?1 ORDER BY version")
            .map_err(|e| self.error(e))?;
        let rows = stmt
            .query_map(params![state.version() as i64], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, Option<String>>(2)?,
                    r.get::<_, i64>(3)?,
                ))
            })
            .map_err(|e| self.error(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.error(e))?;
        for commit in rows.chunk_by(|a, b| a.3 == b.3) {
            let writes: Vec<(&str, &str, Option<std::sync::Arc<str>>)> = commit
                .iter()
                .map(|(ns, key, body, _)| (ns.as_str(), key.as_str(), body.as_deref().map(Into::into)))
                .collect();
            state.apply(commit[0].3 as u64, writes.iter().map(|(ns, key, body)| (*ns, *key, body.as_ref())));
        }
        *seen = version;
        Ok(())
    }

    /// Whether the database holds no state and no run yet.
    pub fn is_new(&self) -> Result<bool, DbError> {
        let conn = lock(&self.conn);
        let count = |sql: &str| conn.query_row(sql, [], |r| r.get::<_, i64>(0)).map_err(|e| self.error(e));
        Ok(count("SELECT COUNT(*) FROM docs")? == 0 && count("SELECT COUNT(*) FROM runs")? == 0)
    }

    /// Writes `state` as the database's starting state.
    pub fn seed(&self, state: &State) -> Result<(), DbError> {
        let mut conn = lock(&self.conn);
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(|e| self.error(e))?;
        {
            let mut insert = tx
                .prepare("INSERT OR REPLACE INTO docs (ns, key, body, version) VALUES (?1, ?2, ?3, 1)")
                .map_err(|e| self.error(e))?;
            for (ns, namespace) in state.namespaces() {
                for (key, doc) in namespace.iter() {
                    insert.execute(params![ns, key, &*doc.text]).map_err(|e| self.error(e))?;
                }
                tx.execute("INSERT OR REPLACE INTO namespaces VALUES (?1, 1)", params![ns])
                    .map_err(|e| self.error(e))?;
            }
        }
        tx.execute("UPDATE meta SET value = 1 WHERE name = 'version'", []).map_err(|e| self.error(e))?;
        tx.commit().map_err(|e| self.error(e))?;
        drop(conn);
        self.reload()
    }

    /// Registers a run that is about to start.
    pub fn register_run(&self, run: &RunRecord) -> Result<(), DbError> {
        lock(&self.conn)
            .execute(
                "INSERT INTO runs (run_id, saga, saga_path, definition, input, seed, status, pid, started_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'running', ?7, ?8)",
                params![
                    run.run_id,
                    run.saga,
                    run.saga_path,
                    run.definition,
                    run.input.to_string(),
                    run.seed as i64,
                    run.pid,
                    now_ms() as i64
                ],
            )
            .map_err(|e| self.error(e))?;
        Ok(())
    }

    /// Marks a resumed run as run by this process.
    pub fn adopt_run(&self, run_id: &str) -> Result<(), DbError> {
        lock(&self.conn)
            .execute("UPDATE runs SET pid = ?1 WHERE run_id = ?2", params![std::process::id(), run_id])
            .map_err(|e| self.error(e))?;
        Ok(())
    }

    /// Every run, oldest first.
    pub fn runs(&self) -> Result<Vec<RunRecord>, DbError> {
        let conn = lock(&self.conn);
        let mut stmt = conn
            .prepare(
                "SELECT run_id, saga, saga_path, definition, input, seed, status, pid, started_ms, finished_ms
                 FROM runs ORDER BY started_ms, run_id",
            )
            .map_err(|e| self.error(e))?;
        let rows = stmt
            .query_map([], |r| {
                Ok(RunRecord {
                    run_id: r.get(0)?,
                    saga: r.get(1)?,
                    saga_path: r.get(2)?,
                    definition: r.get(3)?,
                    input: serde_json::from_str(&r.get::<_, String>(4)?).unwrap_or(Value::Null),
                    seed: r.get::<_, i64>(5)? as u64,
                    status: r.get(6)?,
                    pid: r.get(7)?,
                    started_ms: r.get::<_, i64>(8)? as u64,
                    finished_ms: r.get::<_, Option<i64>>(9)?.map(|v| v as u64),
                })
            })
            .map_err(|e| self.error(e))?;
        rows.collect::<Result<_, _>>().map_err(|e| self.error(e))
    }

    /// A run's journal, in order.
    pub fn events(&self, run_id: &str) -> Result<Vec<Event>, DbError> {
        let conn = lock(&self.conn);
        let mut stmt =
            conn.prepare("SELECT body FROM events WHERE run_id = ?1 ORDER BY seq").map_err(|e| self.error(e))?;
        let bodies = stmt.query_map(params![run_id], |r| r.get::<_, String>(0)).map_err(|e| self.error(e))?;
        let mut events = Vec::new();
        for body in bodies {
            let body = body.map_err(|e| self.error(e))?;
            events.push(
                serde_json::from_str(&body).map_err(|e| self.error(format!("a journal record of {run_id}: {e}")))?,
            );
        }
        Ok(events)
    }

    /// Bytes of journal records a run wrote.
    pub fn journal_bytes(&self, run_id: &str) -> Result<u64, DbError> {
        lock(&self.conn)
            .query_row("SELECT COALESCE(SUM(LENGTH(body)), 0) FROM events WHERE run_id = ?1", params![run_id], |r| {
                r.get::<_, i64>(0)
            })
            .map(|n| n as u64)
            .map_err(|e| self.error(e))
    }

    /// The state as the database holds it now.
    pub fn current_state(&self) -> Result<State, DbError> {
        let conn = lock(&self.conn);
        self.read_state(&conn)
    }

    /// Writes `events` (and everything pending before them) in `tx`, and records run ends.
    /// Returns how many pending events it wrote: drop them once `tx` commits.
    fn write_events(&self, tx: &rusqlite::Transaction, events: &[Event]) -> rusqlite::Result<usize> {
        let pending = lock(&self.pending).clone();
        let mut insert = tx.prepare_cached("INSERT OR REPLACE INTO events (run_id, seq, body) VALUES (?1, ?2, ?3)")?;
        for event in pending.iter().chain(events) {
            let body = serde_json::to_string(event).unwrap_or_default();
            insert.execute(params![event.run_id, event.seq as i64, body])?;
            if event.event == EventKind::SagaFinished {
                let status =
                    event.data.as_ref().and_then(|d| d.get("status")).and_then(Value::as_str).unwrap_or("finished");
                tx.execute(
                    "UPDATE runs SET status = ?1, finished_ms = ?2 WHERE run_id = ?3",
                    params![status, now_ms() as i64, event.run_id],
                )?;
            }
        }
        Ok(pending.len())
    }

    /// Forgets the first `n` pending events, which a committed transaction wrote.
    fn written(&self, n: usize) {
        lock(&self.pending).drain(..n);
    }
}

fn data_version(conn: &Connection) -> rusqlite::Result<i64> {
    conn.query_row("PRAGMA data_version", [], |r| r.get(0))
}

impl Backend for SqliteBackend {
    fn snapshot(&self) -> State {
        {
            let conn = lock(&self.conn);
            if let Err(e) = self.catch_up(&conn) {
                tracing::warn!("cannot catch up with the database: {e}");
            }
        }
        self.state.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn commit(&self, txn: &Txn, result: Option<(&str, &Value)>, events: &[Event]) -> Result<Vec<Change>, CommitError> {
        let backend = |e: &dyn std::fmt::Display| CommitError::Backend(self.error(e).to_string());
        let mut conn = lock(&self.conn);
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(|e| backend(&e))?;
        // Under the write lock: the in-memory state is brought up to the database's, and the
        // transaction is validated against it.
        self.catch_up(&tx).map_err(|e| backend(&e))?;
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        txn.validate(&state)?;
        let changes = txn.changes(&state);
        let version = state.version() + 1;
        let write = || -> rusqlite::Result<usize> {
            let mut put =
                tx.prepare_cached("INSERT OR REPLACE INTO docs (ns, key, body, version) VALUES (?1, ?2, ?3, ?4)")?;
            for (ns, key, text) in txn.writes() {
                let existed = state.get(ns, key).is_some();
                put.execute(params![ns, key, text.map(|t| &**t), version as i64])?;
                if existed != text.is_some() {
                    tx.execute("INSERT OR REPLACE INTO namespaces VALUES (?1, ?2)", params![ns, version as i64])?;
                }
            }
            if let Some((key, output)) = result {
                let run_id = events.first().map_or("", |e| e.run_id.as_str());
                tx.execute(
                    "INSERT OR REPLACE INTO results (key, run_id, output) VALUES (?1, ?2, ?3)",
                    params![key, run_id, output.to_string()],
                )?;
            }
            let flushed = self.write_events(&tx, events)?;
            tx.execute("UPDATE meta SET value = ?1 WHERE name = 'version'", params![version as i64])?;
            Ok(flushed)
        };
        let flushed = write().map_err(|e| backend(&e))?;
        tx.commit().map_err(|e| backend(&e))?;
        self.written(flushed);
        state.apply(version, txn.writes());
        // Our own commit changed data_version only for other connections; ours is current.
        Ok(changes)
    }

    fn record(&self, events: &[Event]) -> Result<(), CommitError> {
        // Events that change no state wait for the next commit, except a run's first and last.
        let urgent = events
            .iter()
            .any(|e| matches!(e.event, EventKind::SagaStarted | EventKind::SagaResumed | EventKind::SagaFinished));
        lock(&self.pending).extend_from_slice(events);
        if !urgent {
            return Ok(());
        }
        let mut conn = lock(&self.conn);
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| CommitError::Backend(self.error(e).to_string()))?;
        let flushed = self.write_events(&tx, &[]).map_err(|e| CommitError::Backend(self.error(e).to_string()))?;
        tx.commit().map_err(|e| CommitError::Backend(self.error(e).to_string()))?;
        self.written(flushed);
        Ok(())
    }

    fn cached(&self, key: &str) -> Option<Value> {
        let conn = lock(&self.conn);
        let text: Option<String> = conn
            .query_row("SELECT output FROM results WHERE key = ?1", params![key], |r| r.get(0))
            .optional()
            .unwrap_or_else(|e| {
                tracing::warn!("cannot read the result cache: {e}");
                None
            });
        text.and_then(|t| serde_json::from_str(&t).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::WriteQuota;
    use serde_json::json;

    fn state() -> State {
        State::from_json(&json!({ "pools": { "p": { "allocated": 0 } }, "users": { "u": { "n": 1 } } })).unwrap()
    }

    #[test]
    fn state_survives_reopening_and_digests_agree() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        let db = SqliteBackend::open(&path, Durability::Normal).unwrap();
        assert!(db.is_new().unwrap());
        db.seed(&state()).unwrap();
        let mut txn = Txn::new(db.snapshot(), WriteQuota::default());
        txn.put("pools", "p", r#"{"allocated":5}"#).unwrap();
        txn.delete("users", "u").unwrap();
        db.commit(&txn, Some(("k", &json!({"ok": true}))), &[]).unwrap();
        let expected = db.snapshot().digest();
        drop(db);
        let again = SqliteBackend::open(&path, Durability::Full).unwrap();
        assert!(!again.is_new().unwrap());
        assert_eq!(again.snapshot().digest(), expected);
        assert_eq!(again.current_state().unwrap().digest(), expected);
        assert!(again.snapshot().namespace("users").is_none());
        assert_eq!(again.cached("k"), Some(json!({"ok": true})));
    }

    #[test]
    fn two_connections_never_lose_an_update() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        let a = SqliteBackend::open(&path, Durability::Normal).unwrap();
        a.seed(&state()).unwrap();
        let b = SqliteBackend::open(&path, Durability::Normal).unwrap();
        let mut from_a = Txn::new(a.snapshot(), WriteQuota::default());
        let mut from_b = Txn::new(b.snapshot(), WriteQuota::default());
        from_a.get("pools", "p");
        from_b.get("pools", "p");
        from_a.put("pools", "p", r#"{"allocated":1}"#).unwrap();
        from_b.put("pools", "p", r#"{"allocated":2}"#).unwrap();
        a.commit(&from_a, None, &[]).unwrap();
        assert!(matches!(b.commit(&from_b, None, &[]), Err(CommitError::Conflict(_))));
        // b catches up and sees a's write.
        assert_eq!(&*b.snapshot().get("pools", "p").unwrap().text, r#"{"allocated":1}"#);
        // Deletes and new keys reach it too, and both end at the state the database holds.
        let mut more = Txn::new(a.snapshot(), WriteQuota::default());
        more.delete("users", "u").unwrap();
        more.put("orders", "o1", "{}").unwrap();
        a.commit(&more, None, &[]).unwrap();
        let seen = b.snapshot();
        assert!(seen.namespace("users").is_none());
        assert!(seen.get("orders", "o1").is_some());
        assert_eq!(seen.digest(), a.current_state().unwrap().digest());
        // b's next commit is validated against the caught-up state: no false conflict.
        let mut after = Txn::new(b.snapshot(), WriteQuota::default());
        after.get("orders", "o1");
        after.put("orders", "o2", "{}").unwrap();
        b.commit(&after, None, &[]).unwrap();
    }
}
