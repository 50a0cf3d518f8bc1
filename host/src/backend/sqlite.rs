//! The SQLite backend: the store, the idempotency result cache, the run registry and the
//! journal in one SQLite database, so that a saga killed at any instant can be resumed.
//!
//! A call's writes, its cached result and the journal events that record it commit in one
//! SQLite transaction: the state and the journal never disagree. Steps of concurrent runs
//! share transactions (group commit, [`super::group`]): each is still atomic on its own
//! (checked before it writes; a savepoint where a refusal could come after a write), and
//! each caller returns only once the transaction holding its step committed. The database
//! runs in WAL mode. `synchronous=NORMAL` (the default) survives a killed process: every
//! committed transaction is in the WAL; after a power loss the last transactions may be
//! lost, but the database stays consistent with its journal.
//! `synchronous=FULL` also survives power loss at the cost of an fsync per transaction.
//! Nothing else waits for a group's transaction: a run's reads between its commits go to a
//! second connection while the writing one is busy, and checkpoints run on a thread of their
//! own ([`checkpoint`]).
//!
//! Each process keeps the state in memory (an O(1)-snapshot [`State`]) and catches up with
//! commits of other processes (`PRAGMA data_version` says cheaply when); a commit is
//! validated against the database under its write lock, and takes its version from the
//! database's own counter, so concurrent processes never lose updates. Under that lock a
//! commit also checks the result cache: of two deliveries of one call, the second writes
//! nothing. Journal records are never overwritten, a run is taken over by one process at a
//! time, and a new database is seeded once.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

use rusqlite::{Connection, OpenFlags, OptionalExtension, TransactionBehavior, params};
use serde_json::Value;

use super::group::Group;
use super::{
    Backend, CommitError, DbError, RegisterError, RunRecord, UNFINISHED, apply_commits, finished_status, lock, now_ms,
    this_process, write_at_once,
};
use crate::saga::journal::Event;
use crate::store::{Change, State, Txn};
use crate::sync::{read, try_lock, write};
use checkpoint::Checkpointer;

mod checkpoint;
mod wal_writes;

/// How hard commits push to disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Durability {
    /// `synchronous=NORMAL` in WAL mode: survives a killed process.
    Normal,
    /// `synchronous=FULL`: also survives power loss; an fsync per commit.
    Full,
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

/// What each later schema version adds (`meta.schema` says which a database has).
const MIGRATIONS: &[&str] = &[
    // 2: run owners and their leases, for workers (`sagabox worker`).
    "ALTER TABLE runs ADD COLUMN owner TEXT NOT NULL DEFAULT '';
     ALTER TABLE runs ADD COLUMN lease_until_ms INTEGER;
     CREATE INDEX runs_by_status ON runs (status, started_ms);",
    // 3: journal records in a rowid table. A WITHOUT ROWID table keeps a row in its key's
    // B-tree, where a row over ~1 KB spills to overflow pages; records that carry the
    // documents their step wrote are 1-3 KB, and spilling doubled what each one wrote.
    "CREATE TABLE events_v3 (
         run_id TEXT NOT NULL, seq INTEGER NOT NULL, body TEXT NOT NULL, PRIMARY KEY (run_id, seq));
     INSERT INTO events_v3 SELECT run_id, seq, body FROM events;
     DROP TABLE events;
     ALTER TABLE events_v3 RENAME TO events;",
    // 4: the queue's order in full, so that a claim reads the oldest runs off the index.
    "DROP INDEX runs_by_status;
     CREATE INDEX runs_queue ON runs (status, started_ms, run_id);",
    // 5: a run's results cached under the run (`ids::cache_key`). Each result is copied
    // under its run, so that runs an earlier sagabox started find theirs when resumed; the
    // row as it was stays for the client-named keys among them.
    RESULTS_UNDER_THEIR_RUNS,
];

/// The migration that gives every cached result a copy under its run (SQLite's and
/// PostgreSQL's spelling agree).
pub(super) const RESULTS_UNDER_THEIR_RUNS: &str = "INSERT INTO results (key, run_id, output)
     SELECT run_id || '/' || key, run_id, output FROM results WHERE key NOT LIKE '%/%'
     ON CONFLICT DO NOTHING;";

/// The ids of up to ?2 runs a claim takes, oldest first: queued runs, running ones another
/// process (not ?3) holds whose lease ran out before ?1 (now), and running ones this process
/// holds that are not in ?4 (a JSON array: see [`Backend::claim_runs`]). Each kind is read off
/// `runs_queue` in order and stops at the limit, so a claim costs the same however long the
/// queue is (one `WHERE queued OR expired` scanned and sorted the whole table: 39 ms at
/// 40,000 queued runs).
const CLAIMABLE: &str = "
SELECT run_id FROM (
    SELECT * FROM (SELECT run_id, started_ms FROM runs WHERE status = 'queued'
                   ORDER BY started_ms, run_id LIMIT ?2)
    UNION ALL
    SELECT * FROM (SELECT run_id, started_ms FROM runs
                   WHERE status = 'running' AND lease_until_ms < ?1 AND owner <> ?3
                   ORDER BY started_ms, run_id LIMIT ?2)
    UNION ALL
    SELECT * FROM (SELECT run_id, started_ms FROM runs
                   WHERE status = 'running' AND owner = ?3 AND run_id NOT IN (SELECT value FROM json_each(?4))
                   ORDER BY started_ms, run_id LIMIT ?2))
ORDER BY started_ms, run_id LIMIT ?2";

/// The columns of a run, in [`run_from_row`]'s order.
const RUN_COLUMNS: &str =
    "run_id, saga, saga_path, definition, input, seed, status, pid, owner, lease_until_ms, started_ms, finished_ms";

/// A claim: takes the runs [`CLAIMABLE`] picks for this process (?3, pid ?5) until ?6, and
/// returns them. One statement, prepared once per connection.
static CLAIM: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "UPDATE runs SET status = 'running', pid = ?5, owner = ?3, lease_until_ms = ?6
         WHERE run_id IN ({CLAIMABLE}) RETURNING {RUN_COLUMNS}"
    )
});

fn run_from_row(r: &rusqlite::Row) -> rusqlite::Result<RunRecord> {
    Ok(RunRecord {
        run_id: r.get(0)?,
        saga: r.get(1)?,
        saga_path: r.get(2)?,
        definition: r.get(3)?,
        input: serde_json::from_str(&r.get::<_, String>(4)?).unwrap_or(Value::Null),
        seed: r.get::<_, i64>(5)? as u64,
        status: r.get(6)?,
        pid: r.get(7)?,
        owner: r.get(8)?,
        lease_until_ms: r.get::<_, Option<i64>>(9)?.map(|v| v as u64),
        started_ms: r.get::<_, i64>(10)? as u64,
        finished_ms: r.get::<_, Option<i64>>(11)?.map(|v| v as u64),
    })
}

/// Inserts `run` into the registry, its start time the database's clock.
fn insert_run(conn: &Connection, run: &RunRecord) -> rusqlite::Result<()> {
    let mut insert = conn.prepare_cached(
        "INSERT INTO runs (run_id, saga, saga_path, definition, input, seed, status, pid, owner, lease_until_ms, started_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
    )?;
    insert.execute(params![
        run.run_id,
        run.saga,
        run.saga_path,
        run.definition,
        run.input.to_string(),
        run.seed as i64,
        run.status,
        run.pid,
        run.owner,
        run.lease_until_ms.map(|t| t as i64),
        now_ms() as i64
    ])?;
    Ok(())
}

/// Brings the schema to the newest version, in one transaction.
/// A database of a newer schema is refused: this sagabox might look for what it holds (its
/// cached results, say) where it no longer keeps it.
fn migrate(conn: &mut Connection) -> Result<(), String> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(|e| e.to_string())?;
    let version: i64 =
        tx.query_row("SELECT value FROM meta WHERE name = 'schema'", [], |r| r.get(0)).map_err(|e| e.to_string())?;
    let known = MIGRATIONS.len() as i64 + 1;
    if version > known {
        return Err(format!(
            "the database's schema is version {version}, newer than this sagabox's ({known}): upgrade sagabox"
        ));
    }
    let apply = |n: usize, sql: &str| {
        tx.execute_batch(sql)?;
        tx.execute("UPDATE meta SET value = ?1 WHERE name = 'schema'", params![n as i64 + 2]).map(drop)
    };
    for (n, sql) in MIGRATIONS.iter().enumerate().skip((version - 1).max(0) as usize) {
        apply(n, sql).map_err(|e| e.to_string())?;
    }
    tx.commit().map_err(|e| e.to_string())
}

/// The SQLite backend.
pub struct SqliteBackend {
    path: PathBuf,
    /// Writes (every commit, the registry, the queue) and what reads with them.
    conn: Mutex<Connection>,
    /// `conn`'s `PRAGMA data_version` when `state` was last brought up to date through it: a
    /// cheap test of whether another process committed since (it ignores `conn`'s own).
    data_version: Mutex<i64>,
    /// What a run reads between its commits (a snapshot's catching up, the result cache)
    /// while a group's transaction holds `conn`: every step of every run asks both, and
    /// none waits for the transaction (WAL mode lets this connection read meanwhile).
    reader: Mutex<Reader>,
    /// The state as of the database's version `state.version()`.
    state: RwLock<State>,
    /// Events with no state change, written with the next commit (or at a run's start and end).
    pending: Mutex<Vec<Record>>,
    /// Step commits of concurrent runs, written many to a transaction.
    group: Group<StepCommit, Result<Vec<Change>, StepError>>,
    /// Checkpoints, made off the commits' path.
    checkpointer: Checkpointer,
}

/// Most steps one transaction writes: bounds how long a batch holds the write lock.
const MAX_GROUP: usize = 256;

/// One step's commit (or, without `txn`, journal records that must be written at once, or
/// a run to register), owned so that whichever caller leads the group can write it.
///
/// Its records and result come serialized by the caller: the leader's time is what every
/// run with a step in the group waits for, so nothing is done there that callers can do
/// for themselves.
#[derive(Default)]
struct StepCommit {
    txn: Option<Txn>,
    /// The call's idempotency key and its output (JSON text).
    result: Option<(String, String)>,
    events: Vec<Record>,
    run: Option<RunRecord>,
}

/// A journal record as the `events` table holds it.
#[derive(Clone)]
struct Record {
    run_id: String,
    seq: u64,
    /// The event, as JSON.
    body: String,
    /// The run's status, when the record ends the run.
    finished: Option<String>,
}

impl Record {
    fn of(event: &Event) -> serde_json::Result<Record> {
        Ok(Record {
            run_id: event.run_id.clone(),
            seq: event.seq,
            body: serde_json::to_string(event)?,
            finished: finished_status(event).map(str::to_string),
        })
    }
}

/// The reading connection.
struct Reader {
    conn: Connection,
    /// Its `PRAGMA data_version` when `state` was last brought up to date through it (this
    /// backend's own commits change it too).
    data_version: i64,
}

fn is_constraint(e: &rusqlite::Error) -> bool {
    e.sqlite_error_code() == Some(rusqlite::ErrorCode::ConstraintViolation)
}

/// The last commit's version, as the database counts them.
fn db_version(conn: &Connection) -> rusqlite::Result<u64> {
    conn.prepare_cached("SELECT value FROM meta WHERE name = 'version'")?
        .query_row([], |r| r.get::<_, i64>(0))
        .map(|v| v as u64)
}

/// Whether the database holds no state and no run, and was never seeded.
fn is_new(conn: &Connection) -> rusqlite::Result<bool> {
    let count = |sql: &str| conn.query_row(sql, [], |r| r.get::<_, i64>(0));
    Ok(db_version(conn)? == 0 && count("SELECT COUNT(*) FROM docs")? == 0 && count("SELECT COUNT(*) FROM runs")? == 0)
}

/// Writes `state` as the starting state (version 1).
fn write_seed(tx: &rusqlite::Transaction, state: &State) -> rusqlite::Result<()> {
    let mut insert = tx.prepare("INSERT OR REPLACE INTO docs (ns, key, body, version) VALUES (?1, ?2, ?3, 1)")?;
    for (ns, namespace) in state.namespaces() {
        for (key, doc) in namespace.iter() {
            insert.execute(params![ns, key, &*doc.text])?;
        }
        tx.execute("INSERT OR REPLACE INTO namespaces VALUES (?1, 1)", params![ns])?;
    }
    tx.execute("UPDATE meta SET value = 1 WHERE name = 'version'", [])?;
    Ok(())
}

/// Why a step was not written.
enum StepError {
    /// A journal record of the caller's is already there.
    Duplicate(CommitError),
    /// The run it registers is already registered.
    RunExists,
    /// Anything else: a conflict, a cached result, or the database failed.
    Failed(CommitError),
}

impl StepError {
    fn into_commit_error(self) -> CommitError {
        match self {
            StepError::Duplicate(e) | StepError::Failed(e) => e,
            StepError::RunExists => CommitError::Backend("the run is already registered".into()),
        }
    }
}

/// A journal record that is already there: another process writes this run's journal.
fn duplicate_event(record: &Record) -> String {
    format!("{} (another process writes this run)", super::duplicate_record(&record.run_id, record.seq))
}

impl SqliteBackend {
    /// Opens (or creates) the database at `path`.
    pub fn open(path: &Path, durability: Durability) -> Result<SqliteBackend, DbError> {
        SqliteBackend::open_with(path, durability, true)
    }

    /// Opens the database at `path`, which must exist: commands that only read or finish
    /// runs never create one.
    pub fn open_existing(path: &Path, durability: Durability) -> Result<SqliteBackend, DbError> {
        if !path.is_file() {
            let error = "no such database (`sagabox run --db` creates one)".to_string();
            return Err(DbError { db: path.display().to_string(), error });
        }
        SqliteBackend::open_with(path, durability, false)
    }

    fn open_with(path: &Path, durability: Durability, create: bool) -> Result<SqliteBackend, DbError> {
        let fail = |e: rusqlite::Error| DbError { db: path.display().to_string(), error: e.to_string() };
        let mut flags = OpenFlags::default();
        if !create {
            flags.remove(OpenFlags::SQLITE_OPEN_CREATE);
        }
        let mut conn = connect(path, flags).map_err(fail)?;
        if !create && !has_schema(&conn).map_err(fail)? {
            return Err(DbError { db: path.display().to_string(), error: "not a sagabox database".into() });
        }
        enable_wal(&conn).map_err(|error| DbError { db: path.display().to_string(), error })?;
        let sync = match durability {
            Durability::Normal => "NORMAL",
            Durability::Full => "FULL",
        };
        conn.pragma_update(None, "synchronous", sync).map_err(fail)?;
        conn.execute_batch(SCHEMA).map_err(fail)?;
        migrate(&mut conn).map_err(|error| DbError { db: path.display().to_string(), error })?;
        let reader = connect(path, flags).map_err(fail)?;
        reader.pragma_update(None, "query_only", true).map_err(fail)?;
        let checkpoints = connect(path, flags).map_err(fail)?;
        let checkpointer = Checkpointer::start(checkpoints, &mut conn, path.display().to_string())?;
        let backend = SqliteBackend {
            path: path.to_path_buf(),
            conn: Mutex::new(conn),
            data_version: Mutex::new(-1),
            reader: Mutex::new(Reader { conn: reader, data_version: -1 }),
            state: RwLock::new(State::default()),
            pending: Mutex::new(Vec::new()),
            group: Group::new(MAX_GROUP),
            checkpointer,
        };
        backend.reload()?;
        Ok(backend)
    }

    fn error(&self, e: impl std::fmt::Display) -> DbError {
        DbError { db: self.path.display().to_string(), error: e.to_string() }
    }

    fn commit_error(&self, e: impl std::fmt::Display) -> CommitError {
        CommitError::Backend(self.error(e).to_string())
    }

    /// Reads the whole state from the database.
    fn reload(&self) -> Result<(), DbError> {
        let conn = lock(&self.conn);
        // Read before the state: a commit in between makes the next snapshot catch up.
        let version = data_version(&conn).map_err(|e| self.error(e))?;
        let state = self.read_state(&conn)?;
        *write(&self.state) = state;
        *lock(&self.data_version) = version;
        Ok(())
    }

    /// The state as the database holds it, read in one transaction.
    fn read_state(&self, conn: &Connection) -> Result<State, DbError> {
        let tx = conn.unchecked_transaction().map_err(|e| self.error(e))?;
        let version = db_version(&tx).map_err(|e| self.error(e))?;
        let mut stmt = tx
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
        let mut keys = tx.prepare("SELECT ns, keys_version FROM namespaces").map_err(|e| self.error(e))?;
        let keys_versions = keys
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)? as u64)))
            .map_err(|e| self.error(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.error(e))?;
        Ok(State::from_versioned(docs, keys_versions, version))
    }

    /// Brings the in-memory state up to the database's when another connection committed.
    fn refresh(&self) -> Result<(), DbError> {
        self.on_free_connection(|conn, last_seen| {
            // Read first: a commit after this read makes the next refresh catch up again.
            let seen = data_version(conn).map_err(|e| self.error(e))?;
            if seen == *last_seen {
                return Ok(());
            }
            // One read transaction: the version and the rows it reads agree.
            let tx = conn.unchecked_transaction().map_err(|e| self.error(e))?;
            self.catch_up(&tx)?;
            drop(tx);
            *last_seen = seen;
            Ok(())
        })
    }

    /// Runs `read` with a connection and its last seen `data_version`: the writing one when
    /// it is free (its pages are cached, and this process's own commits do not count as
    /// changes there), else the reading one, so that a read never waits for a transaction.
    fn on_free_connection<T>(&self, read: impl FnOnce(&Connection, &mut i64) -> T) -> T {
        if let Some(conn) = try_lock(&self.conn) {
            return read(&conn, &mut lock(&self.data_version));
        }
        let mut reader = lock(&self.reader);
        let Reader { conn, data_version } = &mut *reader;
        read(conn, data_version)
    }

    /// Brings the in-memory state up to the database's version and returns that version.
    /// Run it inside a transaction. Only the documents written since the version the state
    /// holds are read (deleted ones keep their row with a NULL body), applied commit by
    /// commit; then the state takes the database's own version, so a commit that wrote no
    /// document can never make a later catch-up skip another process's commit. A state
    /// already newer than this transaction's (the writing connection committed after the
    /// reading one began) stays as it is.
    fn catch_up(&self, conn: &Connection) -> Result<u64, DbError> {
        let version = db_version(conn).map_err(|e| self.error(e))?;
        let mut state = write(&self.state);
        if state.version() < version {
            let mut stmt = conn
                .prepare_cached("SELECT ns, key, body, version FROM docs WHERE version > ?1 ORDER BY version")
                .map_err(|e| self.error(e))?;
            let rows = stmt
                .query_map(params![state.version() as i64], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, Option<String>>(2)?,
                        r.get::<_, i64>(3)? as u64,
                    ))
                })
                .map_err(|e| self.error(e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| self.error(e))?;
            apply_commits(&mut state, &rows, version);
        }
        Ok(version)
    }

    /// Whether the database holds no state and no run yet.
    pub fn is_new(&self) -> Result<bool, DbError> {
        is_new(&lock(&self.conn)).map_err(|e| self.error(e))
    }

    /// Writes `state` as the database's starting state, whatever it held.
    pub fn seed(&self, state: &State) -> Result<(), DbError> {
        {
            let mut conn = lock(&self.conn);
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(|e| self.error(e))?;
            write_seed(&tx, state).map_err(|e| self.error(e))?;
            tx.commit().map_err(|e| self.error(e))?;
        }
        self.reload()
    }

    /// Writes the pending events in `conn`'s transaction; returns how many it handled: drop
    /// them once the transaction commits. One that is already there (of a run whose journal
    /// another process took over) is dropped with a warning, so that it does not fail other
    /// runs' commits.
    fn write_pending(&self, conn: &Connection) -> Result<usize, CommitError> {
        let pending = lock(&self.pending).clone();
        // A run another process took over gets nothing more from this one.
        let taken_over = self.taken_over(conn, pending.iter().map(|r| r.run_id.as_str()))?;
        for record in pending.iter().filter(|r| !taken_over.contains(r.run_id.as_str())) {
            match self.write_record(conn, record) {
                Err(e) if is_constraint(&e) => tracing::warn!("dropping a journal record: {}", duplicate_event(record)),
                Err(e) => return Err(self.commit_error(e)),
                Ok(()) => {}
            }
        }
        Ok(pending.len())
    }

    /// Of the runs `run_ids` names, those another process holds (a warning names each).
    fn taken_over<'a>(
        &self,
        conn: &Connection,
        run_ids: impl Iterator<Item = &'a str>,
    ) -> Result<HashSet<&'a str>, CommitError> {
        let (mut seen, mut taken_over) = (HashSet::new(), HashSet::new());
        for run_id in run_ids.filter(|id| seen.insert(*id)) {
            let owner = owner_of(conn, run_id).map_err(|e| self.commit_error(e))?;
            if let Some(Err(e)) = owner.map(|o| CommitError::unless_held(run_id, &o)) {
                tracing::warn!("dropping the journal records this process held back: {e}");
                taken_over.insert(run_id);
            }
        }
        Ok(taken_over)
    }

    /// Writes `records` in `conn`'s transaction; one that is already there is an error.
    fn write_events(&self, conn: &Connection, records: &[Record]) -> Result<(), StepError> {
        for record in records {
            self.write_record(conn, record).map_err(|e| match is_constraint(&e) {
                true => StepError::Duplicate(self.commit_error(duplicate_event(record))),
                false => StepError::Failed(self.commit_error(e)),
            })?;
        }
        Ok(())
    }

    /// Writes one journal record, and the run's end if it ends the run.
    fn write_record(&self, conn: &Connection, record: &Record) -> rusqlite::Result<()> {
        conn.prepare_cached("INSERT INTO events (run_id, seq, body) VALUES (?1, ?2, ?3)")?.execute(params![
            record.run_id,
            record.seq as i64,
            record.body
        ])?;
        if let Some(status) = &record.finished {
            conn.prepare_cached("UPDATE runs SET status = ?1, finished_ms = ?2 WHERE run_id = ?3")?
                .execute(params![status, now_ms() as i64, record.run_id])?;
        }
        Ok(())
    }

    /// `events` as records, serialized here on the caller's thread.
    fn records(&self, events: &[Event]) -> Result<Vec<Record>, CommitError> {
        events.iter().map(|e| Record::of(e).map_err(|e| self.commit_error(format!("a journal record: {e}")))).collect()
    }

    /// The output cached under `key`, read in `conn`'s transaction.
    fn cached_in(&self, conn: &Connection, key: &str) -> Result<Option<Value>, CommitError> {
        let text: Option<String> = conn
            .prepare_cached("SELECT output FROM results WHERE key = ?1")
            .and_then(|mut s| s.query_row(params![key], |r| r.get(0)))
            .optional()
            .map_err(|e| self.commit_error(e))?;
        text.map(|t| serde_json::from_str(&t).map_err(|e| self.commit_error(format!("cached result {key}: {e}"))))
            .transpose()
    }
}

/// How long a statement waits for another connection's lock before it fails.
const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

/// A connection to the database at `path`, set up for this backend's statements.
fn connect(path: &Path, flags: OpenFlags) -> rusqlite::Result<Connection> {
    let conn = match wal_writes::register() {
        Ok(vfs) => Connection::open_with_flags_and_vfs(path, flags, vfs)?,
        Err(e) => {
            tracing::warn!("WAL writes are not gathered: {e}");
            Connection::open_with_flags(path, flags)?
        }
    };
    conn.busy_timeout(BUSY_TIMEOUT)?;
    // Room for every statement of the commit path and the registry (16 by default).
    conn.set_prepared_statement_cache_capacity(64);
    // Plan each statement once. SQLite marks a statement whose plan may depend on a
    // bound value (a `LIMIT ?`, as in a claim) to be planned again when that value is
    // bound anew, and rusqlite's statement cache clears the bindings of every statement
    // it takes back: such a statement was planned on every use (a worker spent 4.6 % of
    // its time re-planning its claim). No plan here depends on a bound value.
    conn.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)?;
    Ok(conn)
}

/// Puts the database in WAL mode (a no-op once it is), which the reader connection and the
/// checkpoint thread rely on.
///
/// On a database not yet in WAL mode the switch reads the header and then writes it, and
/// SQLite calls no busy handler when a reading transaction asks to write (waiting could
/// deadlock): a process racing others to open a new database got "database is locked" at
/// once. It waits and tries again here instead, for as long as the busy timeout.
fn enable_wal(conn: &Connection) -> Result<(), String> {
    let deadline = Instant::now() + BUSY_TIMEOUT;
    let mut pause = Duration::from_millis(1);
    loop {
        match conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get::<_, String>(0)) {
            Ok(mode) if mode.eq_ignore_ascii_case("wal") => return Ok(()),
            Ok(mode) => {
                return Err(format!(
                    "cannot use WAL mode (SQLite kept journal mode `{mode}`; a WAL needs a local \
                     file system with shared memory)"
                ));
            }
            Err(e) if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy) => {
                if Instant::now() >= deadline {
                    return Err(format!("cannot switch to WAL mode: {e} (waited {BUSY_TIMEOUT:?})"));
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// The process that holds `run_id`, if the run is registered. Read in a write transaction, it
/// fences the write: under the write lock, no other process can take the run over before
/// the write commits.
fn owner_of(conn: &Connection, run_id: &str) -> rusqlite::Result<Option<String>> {
    conn.prepare_cached("SELECT owner FROM runs WHERE run_id = ?1")?.query_row(params![run_id], |r| r.get(0)).optional()
}

fn data_version(conn: &Connection) -> rusqlite::Result<i64> {
    conn.prepare_cached("PRAGMA data_version")?.query_row([], |r| r.get(0))
}

/// Whether `conn` holds sagabox's tables.
fn has_schema(conn: &Connection) -> rusqlite::Result<bool> {
    conn.query_row("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'meta'", [], |r| {
        r.get::<_, i64>(0)
    })
    .map(|n| n > 0)
}

impl Backend for SqliteBackend {
    fn snapshot(&self) -> State {
        if let Err(e) = self.refresh() {
            tracing::warn!("cannot catch up with the database: {e}");
        }
        read(&self.state).clone()
    }

    fn commit(&self, txn: &Txn, result: Option<(&str, &Value)>, events: &[Event]) -> Result<Vec<Change>, CommitError> {
        let step = StepCommit {
            txn: Some(txn.clone()),
            result: result.map(|(key, output)| (key.to_string(), output.to_string())),
            events: self.records(events)?,
            run: None,
        };
        self.write_step(step).map_err(StepError::into_commit_error)
    }

    fn record(&self, events: &[Event]) -> Result<(), CommitError> {
        let records = self.records(events)?;
        if !write_at_once(events) {
            lock(&self.pending).extend(records);
            return Ok(());
        }
        match self.write_step(StepCommit { events: records.clone(), ..StepCommit::default() }) {
            Ok(_) => Ok(()),
            Err(StepError::Duplicate(e) | StepError::Failed(e @ CommitError::TakenOver { .. })) => Err(e),
            // Kept for the next commit.
            Err(e) => {
                lock(&self.pending).extend(records);
                Err(e.into_commit_error())
            }
        }
    }

    fn blocks(&self) -> bool {
        true
    }

    fn name(&self) -> String {
        self.path.display().to_string()
    }

    fn current_state(&self) -> Result<State, DbError> {
        let conn = lock(&self.conn);
        self.read_state(&conn)
    }

    fn seed_if_new(&self, state: &State) -> Result<bool, DbError> {
        {
            let mut conn = lock(&self.conn);
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(|e| self.error(e))?;
            if !is_new(&tx).map_err(|e| self.error(e))? {
                return Ok(false);
            }
            write_seed(&tx, state).map_err(|e| self.error(e))?;
            tx.commit().map_err(|e| self.error(e))?;
        }
        self.reload()?;
        Ok(true)
    }

    fn cached(&self, key: &str) -> Option<Value> {
        self.on_free_connection(|conn, _| self.cached_in(conn, key)).unwrap_or_else(|e| {
            tracing::warn!("cannot read the result cache: {e}");
            None
        })
    }

    fn register_run(&self, run: &RunRecord) -> Result<(), RegisterError> {
        // Through the group: runs that start together share a transaction with their steps.
        match self.write_step(StepCommit { run: Some(run.clone()), ..StepCommit::default() }) {
            Ok(_) => Ok(()),
            Err(StepError::RunExists) => {
                Err(RegisterError::Exists { run_id: run.run_id.clone(), db: self.path.display().to_string() })
            }
            Err(e) => Err(self.error(e.into_commit_error()).into()),
        }
    }

    fn adopt_run(&self, run_id: &str, seen: &RunRecord, lease_until_ms: u64) -> Result<bool, DbError> {
        let changed = lock(&self.conn)
            .execute(
                "UPDATE runs SET pid = ?1, owner = ?2, lease_until_ms = ?3
                 WHERE run_id = ?4 AND owner = ?5 AND pid = ?6 AND status = 'running'",
                params![std::process::id(), this_process(), lease_until_ms as i64, run_id, seen.owner, seen.pid],
            )
            .map_err(|e| self.error(e))?;
        Ok(changed == 1)
    }

    fn claim_runs(
        &self,
        now_ms: u64,
        lease_until_ms: u64,
        limit: usize,
        held: &[String],
    ) -> Result<Vec<RunRecord>, DbError> {
        let held = serde_json::to_string(held).map_err(|e| self.error(e))?;
        let mut conn = lock(&self.conn);
        let mut claim = || -> rusqlite::Result<Vec<RunRecord>> {
            // Under the write lock: no other process takes the same runs.
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let mut runs: Vec<RunRecord> = tx
                .prepare_cached(&CLAIM)?
                .query_map(
                    params![
                        now_ms as i64,
                        limit as i64,
                        this_process(),
                        held,
                        std::process::id(),
                        lease_until_ms as i64
                    ],
                    run_from_row,
                )?
                .collect::<Result<_, _>>()?;
            tx.commit()?;
            // RETURNING gives no order.
            runs.sort_by(|a, b| (a.started_ms, &a.run_id).cmp(&(b.started_ms, &b.run_id)));
            Ok(runs)
        };
        claim().map_err(|e| self.error(e))
    }

    fn renew_leases(&self, lease_until_ms: u64) -> Result<u64, DbError> {
        lock(&self.conn)
            .execute(
                "UPDATE runs SET lease_until_ms = ?1 WHERE owner = ?2 AND status = 'running'",
                params![lease_until_ms as i64, this_process()],
            )
            .map(|n| n as u64)
            .map_err(|e| self.error(e))
    }

    fn runs(&self) -> Result<Vec<RunRecord>, DbError> {
        self.select_runs("TRUE")
    }

    fn unfinished_runs(&self) -> Result<Vec<RunRecord>, DbError> {
        self.select_runs(UNFINISHED)
    }

    fn events(&self, run_id: &str) -> Result<Vec<Event>, DbError> {
        let conn = lock(&self.conn);
        // Cached: a worker reads each run's journal as it starts the run.
        let mut stmt =
            conn.prepare_cached("SELECT body FROM events WHERE run_id = ?1 ORDER BY seq").map_err(|e| self.error(e))?;
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

    fn journal_bytes(&self, run_id: &str) -> Result<u64, DbError> {
        lock(&self.conn)
            .query_row("SELECT COALESCE(SUM(LENGTH(body)), 0) FROM events WHERE run_id = ?1", params![run_id], |r| {
                r.get::<_, i64>(0)
            })
            .map(|n| n as u64)
            .map_err(|e| self.error(e))
    }
}

impl SqliteBackend {
    /// The runs `condition` (SQL) selects, oldest first.
    fn select_runs(&self, condition: &str) -> Result<Vec<RunRecord>, DbError> {
        let conn = lock(&self.conn);
        let sql = format!("SELECT {RUN_COLUMNS} FROM runs WHERE {condition} ORDER BY started_ms, run_id");
        let mut stmt = conn.prepare_cached(&sql).map_err(|e| self.error(e))?;
        let rows = stmt.query_map([], run_from_row).map_err(|e| self.error(e))?;
        rows.collect::<Result<_, _>>().map_err(|e| self.error(e))
    }

    /// Writes `step` in a transaction it may share with other runs' steps (group commit),
    /// and returns once that transaction committed.
    fn write_step(&self, step: StepCommit) -> Result<Vec<Change>, StepError> {
        self.group.submit(step, |steps| self.write_group(&steps)).unwrap_or_else(|_| {
            Err(StepError::Failed(self.commit_error("the commit sharing this step's transaction panicked")))
        })
    }

    /// Writes `steps` in one transaction, each atomically (a savepoint): a step that is
    /// refused (a conflict, a cached result, a journal record already there) writes nothing
    /// and the others go on. If the transaction fails, every step fails with it.
    fn write_group(&self, steps: &[StepCommit]) -> Vec<Result<Vec<Change>, StepError>> {
        let mut conn = lock(&self.conn);
        match self.try_write_group(&mut conn, steps) {
            Ok(outcomes) => outcomes,
            Err(e) => steps.iter().map(|_| Err(StepError::Failed(e.clone()))).collect(),
        }
    }

    fn try_write_group(
        &self,
        conn: &mut Connection,
        steps: &[StepCommit],
    ) -> Result<Vec<Result<Vec<Change>, StepError>>, CommitError> {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(|e| self.commit_error(e))?;
        // Validated against the database's state; versions follow the database's counter.
        let seen = data_version(&tx).map_err(|e| self.commit_error(e))?;
        let base = self.catch_up(&tx).map_err(|e| self.commit_error(e))?;
        let mut state = read(&self.state).clone();
        let flushed = self.write_pending(&tx)?;
        let mut version = base;
        let mut outcomes = Vec::with_capacity(steps.len());
        for step in steps {
            let outcome = match self.refusal(&tx, &state, step) {
                Some(refused) => Err(refused),
                None => self.write_checked(&tx, &state, version + 1, step)?,
            };
            if let (Ok(_), Some(txn)) = (&outcome, &step.txn) {
                version += 1;
                state.apply(version, txn.writes());
            }
            outcomes.push(outcome);
        }
        if version > base {
            tx.prepare_cached("UPDATE meta SET value = ?1 WHERE name = 'version'")
                .and_then(|mut s| s.execute(params![version as i64]))
                .map_err(|e| self.commit_error(e))?;
        }
        tx.commit().map_err(|e| self.commit_error(e))?;
        lock(&self.pending).drain(..flushed);
        // This connection's data_version ignores its own commit: the state is current as of it.
        *write(&self.state) = state;
        *lock(&self.data_version) = seen;
        Ok(outcomes)
    }

    /// Why `step` must not be written, if it must not: read in `conn`'s transaction, against
    /// `state` (the database's, with the group's earlier steps), before it writes anything.
    fn refusal(&self, conn: &Connection, state: &State, step: &StepCommit) -> Option<StepError> {
        let check = || -> Result<(), CommitError> {
            // Under the write lock: a run another process took over is no longer written here...
            if let Some(run_id) = step.events.first().map(|e| &e.run_id)
                && let Some(owner) = owner_of(conn, run_id).map_err(|e| self.commit_error(e))?
            {
                CommitError::unless_held(run_id, &owner)?;
            }
            // ...and another delivery of this call that committed first wins.
            if let Some((key, _)) = &step.result
                && let Some(output) = self.cached_in(conn, key)?
            {
                return Err(CommitError::AlreadyCommitted(output));
            }
            match &step.txn {
                Some(txn) => txn.validate(state).map_err(CommitError::from),
                None => Ok(()),
            }
        };
        check().err().map(StepError::Failed)
    }

    /// Writes `step`, which passed its checks, as version `version`. What can still refuse
    /// it is a row already there (its run, a journal record), and those are its first
    /// writes: with one of them, a refusal leaves nothing to undo (SQLite undoes a failed
    /// statement itself); with several, the step is written under a savepoint, which costs a
    /// copy of every page the step touches (a tenth of the writer's time when every step
    /// had one). Without a savepoint, a step the database fails to write fails the whole
    /// transaction (`Err`): it may hold half the step.
    fn write_checked(
        &self,
        conn: &Connection,
        state: &State,
        version: u64,
        step: &StepCommit,
    ) -> Result<Result<Vec<Change>, StepError>, CommitError> {
        let statement =
            |sql: &str| conn.prepare_cached(sql).and_then(|mut s| s.execute([])).map_err(|e| self.commit_error(e));
        let guarded = usize::from(step.run.is_some()) + step.events.len() > 1;
        if !guarded {
            return match self.write_one(conn, state, version, step) {
                Err(StepError::Failed(e)) => Err(e),
                outcome => Ok(outcome),
            };
        }
        statement("SAVEPOINT step")?;
        let outcome = self.write_one(conn, state, version, step);
        if outcome.is_err() {
            statement("ROLLBACK TO step")?;
        }
        statement("RELEASE step")?;
        Ok(outcome)
    }

    /// Writes `step` in `conn`'s transaction, the rows that may already be there first.
    fn write_one(
        &self,
        conn: &Connection,
        state: &State,
        version: u64,
        step: &StepCommit,
    ) -> Result<Vec<Change>, StepError> {
        let failed = |e: rusqlite::Error| StepError::Failed(self.commit_error(e));
        if let Some(run) = &step.run {
            match insert_run(conn, run) {
                Err(e) if is_constraint(&e) => return Err(StepError::RunExists),
                other => other.map_err(failed)?,
            }
        }
        self.write_events(conn, &step.events)?;
        let mut changes = Vec::new();
        if let Some(txn) = &step.txn {
            changes = txn.changes(state);
            let mut put = conn
                .prepare_cached("INSERT OR REPLACE INTO docs (ns, key, body, version) VALUES (?1, ?2, ?3, ?4)")
                .map_err(failed)?;
            for (ns, key, text) in txn.writes() {
                let existed = state.get(ns, key).is_some();
                put.execute(params![ns, key, text.map(|t| &**t), version as i64]).map_err(failed)?;
                if existed != text.is_some() {
                    conn.prepare_cached("INSERT OR REPLACE INTO namespaces VALUES (?1, ?2)")
                        .and_then(|mut s| s.execute(params![ns, version as i64]))
                        .map_err(failed)?;
                }
            }
        }
        if let Some((key, output)) = &step.result {
            let run_id = step.events.first().map_or("", |e| e.run_id.as_str());
            conn.prepare_cached("INSERT INTO results (key, run_id, output) VALUES (?1, ?2, ?3)")
                .and_then(|mut s| s.execute(params![key, run_id, output]))
                .map_err(failed)?;
        }
        Ok(changes)
    }

    /// Transactions that wrote steps so far (fewer than the steps when concurrent runs'
    /// commits were grouped).
    pub fn transactions(&self) -> u64 {
        self.group.batches()
    }

    /// Time spent writing transactions of steps so far: against the wall time, how busy the
    /// one writer was (every run with a step in a transaction waits for it).
    pub fn writing_time(&self) -> Duration {
        self.group.writing_time()
    }

    /// Checkpoints made off the commits' path so far ([`checkpoint`]).
    pub fn checkpoints(&self) -> u64 {
        self.checkpointer.checkpoints()
    }

    /// Pages this backend's commits appended to the WAL so far.
    pub fn wal_pages_written(&self) -> u64 {
        self.checkpointer.pages_appended()
    }

    /// WAL pages the checkpoints off the commits' path copied into the database so far.
    pub fn wal_pages_checkpointed(&self) -> u64 {
        self.checkpointer.frames_copied()
    }

    /// The most WAL pages one checkpoint on the commits' path copied so far (its commit and
    /// the runs' waiting for it), short of the WAL's bound.
    pub fn most_wal_pages_checkpointed_by_writer(&self) -> u64 {
        self.checkpointer.most_copied_by_writer()
    }

    /// Times a commit waited for the checkpoint thread at the WAL's bound (16,000 pages) so far.
    pub fn checkpoint_waits_at_bound(&self) -> u64 {
        self.checkpointer.waits_at_bound()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{assert_every_commit_there, commit_at_once, counting, event};
    use super::*;
    use crate::saga::journal::{DocWrite, EventKind};
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

    fn open(path: &Path) -> SqliteBackend {
        SqliteBackend::open(path, Durability::Normal).unwrap()
    }

    fn allocated(db: &SqliteBackend) -> u64 {
        let doc = db.current_state().unwrap().get("pools", "p").unwrap().text.clone();
        serde_json::from_str::<Value>(&doc).unwrap()["allocated"].as_u64().unwrap()
    }

    fn run_record(run_id: &str, pid: u32) -> RunRecord {
        RunRecord { pid, ..RunRecord::starting(run_id, "s", "s.json", "{}".into(), &json!({}), 1) }
    }

    #[test]
    fn seeding_checks_and_seeds_in_one_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        let b = open(&path);
        // Another process holds the write lock: it seeds and commits a step.
        let other = Connection::open(&path).unwrap();
        other
            .execute_batch(
                "BEGIN IMMEDIATE;
                 INSERT INTO docs VALUES ('pools', 'p', '{\"allocated\":7}', 2);
                 INSERT INTO namespaces VALUES ('pools', 1);
                 UPDATE meta SET value = 2 WHERE name = 'version';",
            )
            .unwrap();
        let seeding = std::thread::spawn(move || b.seed_if_new(&state()).unwrap());
        std::thread::sleep(Duration::from_millis(200));
        other.execute_batch("COMMIT").unwrap();
        assert!(!seeding.join().unwrap(), "seeded a database that was no longer new");
        assert_eq!(allocated(&open(&path)), 7, "the seed overwrote a committed step");
    }

    /// The journal's table as SQLite stores it, and the schema version.
    fn events_table(path: &Path) -> (String, i64) {
        let conn = Connection::open(path).unwrap();
        let sql = conn.query_row("SELECT sql FROM sqlite_master WHERE name = 'events'", [], |r| r.get(0)).unwrap();
        let schema = conn.query_row("SELECT value FROM meta WHERE name = 'schema'", [], |r| r.get(0)).unwrap();
        (sql, schema)
    }

    #[test]
    fn results_an_earlier_sagabox_cached_are_found_under_their_runs_and_a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        // A database as schema 4 left it: results cached under their bare keys.
        let old = Connection::open(&path).unwrap();
        old.execute_batch(&format!(
            "{SCHEMA}{}; UPDATE meta SET value = 4 WHERE name = 'schema';",
            MIGRATIONS[..3].join(";")
        ))
        .unwrap();
        old.execute_batch(
            r#"INSERT INTO results VALUES ('k1', 'r1', '"booked"'), ('client-key', 'r2', '{"paid":3}');"#,
        )
        .unwrap();
        drop(old);
        let db = open(&path);
        // A resumed run looks its results up under itself...
        assert_eq!(db.cached("r1/k1"), Some(json!("booked")));
        assert_eq!(db.cached("r2/client-key"), Some(json!({ "paid": 3 })));
        // ...a client's retry under its own key, whichever run it comes in.
        assert_eq!(db.cached("client-key"), Some(json!({ "paid": 3 })));
        drop(db);
        assert_eq!(open(&path).cached("r1/k1"), Some(json!("booked")), "migrated twice");

        let newer = Connection::open(&path).unwrap();
        newer.execute("UPDATE meta SET value = value + 1 WHERE name = 'schema'", []).unwrap();
        drop(newer);
        let refused = SqliteBackend::open(&path, Durability::Normal).err().expect("a newer schema was opened");
        assert!(refused.error.contains("newer than this sagabox's"), "{}", refused.error);
    }

    #[test]
    fn a_database_of_schema_2_keeps_its_journal_when_it_moves_to_a_rowid_table() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        // A database as schema 2 left it, with a run's journal in it.
        let old = Connection::open(&path).unwrap();
        old.execute_batch(&format!("{SCHEMA}{}; UPDATE meta SET value = 2 WHERE name = 'schema';", MIGRATIONS[0]))
            .unwrap();
        let mut completed = event("r", 1, EventKind::StepCompleted);
        completed.writes.push(DocWrite {
            ns: "pools".into(),
            key: "p".into(),
            before: None,
            after: Some(format!("{{\"note\":\"{}\"}}", "x".repeat(3000)).into()),
        });
        for e in [event("r", 0, EventKind::SagaStarted), completed.clone()] {
            old.execute(
                "INSERT INTO events VALUES ('r', ?1, ?2)",
                params![e.seq as i64, serde_json::to_string(&e).unwrap()],
            )
            .unwrap();
        }
        drop(old);
        assert!(events_table(&path).0.contains("WITHOUT ROWID"));

        let db = open(&path);
        let (sql, schema) = events_table(&path);
        assert!(!sql.contains("WITHOUT ROWID"), "{sql}");
        assert_eq!(schema, MIGRATIONS.len() as i64 + 1);
        let events = db.events("r").unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[1], completed);
        // The key still refuses a second record at a taken position, and the run goes on.
        let err = db.record(&[event("r", 1, EventKind::SagaResumed)]).unwrap_err();
        assert!(matches!(&err, CommitError::Backend(m) if m.contains("seq 1")), "{err}");
        db.record(&[event("r", 2, EventKind::SagaFinished)]).unwrap();
        drop(db);
        // Opening it again migrates nothing twice.
        assert_eq!(open(&path).events("r").unwrap().len(), 3);
        assert_eq!(events_table(&path).1, MIGRATIONS.len() as i64 + 1);
    }

    /// Processes opening a new database at the same instant (lined up on a barrier, many
    /// times over) each open it, migrate it once between them and write to it. CI once saw
    /// "database is locked" from one of four openers: the switch to WAL reads the header,
    /// then writes it, and SQLite does not wait for a lock when a read transaction asks to
    /// write.
    #[test]
    fn processes_opening_a_new_database_at_once_all_open_it_and_migrate_it_once() {
        const OPENERS: usize = 6;
        for round in 0..40 {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("db.sqlite");
            let start = std::sync::Barrier::new(OPENERS);
            let opened: Vec<SqliteBackend> = std::thread::scope(|scope| {
                let openers: Vec<_> = (0..OPENERS)
                    .map(|_| {
                        scope.spawn(|| {
                            start.wait();
                            SqliteBackend::open(&path, Durability::Normal)
                        })
                    })
                    .collect();
                let opened = openers.into_iter().map(|o| o.join().unwrap());
                opened.collect::<Result<_, _>>().unwrap_or_else(|e| panic!("round {round}: {e}"))
            });
            let mode: String =
                Connection::open(&path).unwrap().query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
            assert_eq!(mode, "wal", "round {round}");
            let (sql, schema) = events_table(&path);
            assert!(!sql.contains("WITHOUT ROWID") && schema == MIGRATIONS.len() as i64 + 1, "{schema}: {sql}");
            for (i, db) in opened.iter().enumerate() {
                db.record(&[event(&format!("r{i}"), 0, EventKind::SagaStarted)]).unwrap();
            }
            assert_eq!(opened[0].events(&format!("r{}", OPENERS - 1)).unwrap().len(), 1);
        }
    }

    /// How many virtual-machine steps SQLite takes to pick the run a claim of one takes
    /// from a queue of `queued` runs (and one run another process holds), and which run.
    fn claim_steps(queued: usize) -> (i32, String) {
        let dir = tempfile::tempdir().unwrap();
        let db = open(&dir.path().join("db.sqlite"));
        let mut conn = lock(&db.conn);
        let tx = conn.transaction().unwrap();
        let run = |id: &str| RunRecord::starting(id, "s", "s.json", "{}".repeat(200), &json!({}), 0);
        for n in 0..queued {
            insert_run(&tx, &run(&format!("q{n:06}")).queued()).unwrap();
        }
        let held = RunRecord { owner: "elsewhere/1/0".into(), lease_until_ms: Some(now_ms() + 60_000), ..run("held") };
        insert_run(&tx, &held).unwrap();
        tx.commit().unwrap();
        let mut claim = conn.prepare(CLAIMABLE).unwrap();
        let ids: Vec<String> = claim
            .query_map(params![now_ms() as i64, 1, this_process(), "[]"], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(ids.len(), 1, "{ids:?}");
        (claim.get_status(rusqlite::StatementStatus::VmStep), ids[0].clone())
    }

    #[test]
    fn a_claim_reads_as_much_of_a_long_queue_as_of_a_short_one() {
        let (short, first) = claim_steps(10);
        let (long, first_of_many) = claim_steps(20_000);
        assert_eq!((first.as_str(), first_of_many.as_str()), ("q000000", "q000000"), "not the oldest run");
        // Scanning and sorting the whole table took 13 steps a run (260,026 here).
        assert!(long <= 2 * short, "a claim took {long} steps from 20,000 queued runs, {short} from 10");
    }

    /// A worker claims runs as its slots free up, a few at a time, so a claim's statement
    /// must be planned once, not on every claim. SQLite planned it again on every use (its
    /// `LIMIT ?` is a value the plan may depend on, and the statement cache clears the
    /// bindings): 4.6 % of a worker's time.
    #[test]
    fn claims_reuse_their_prepared_statement() {
        let dir = tempfile::tempdir().unwrap();
        let db = open(&dir.path().join("db.sqlite"));
        for n in 0..20 {
            db.register_run(&run_record(&format!("q{n:02}"), 0).queued()).unwrap();
        }
        let mut held = Vec::new();
        for n in 0..20 {
            let now = now_ms() + n;
            let claimed = db.claim_runs(now, now + 60_000, 1, &held).unwrap();
            assert_eq!(claimed.iter().map(|r| r.run_id.as_str()).collect::<Vec<_>>(), [format!("q{n:02}")]);
            held.extend(claimed.into_iter().map(|r| r.run_id));
        }
        let conn = lock(&db.conn);
        let claim = conn.prepare_cached(&CLAIM).unwrap();
        // The statement the claims ran, not a new one.
        assert_eq!(claim.get_status(rusqlite::StatementStatus::Run), 20, "runs of the cached claim");
        assert_eq!(claim.get_status(rusqlite::StatementStatus::RePrepare), 0, "re-planned by 20 claims");
    }

    #[test]
    fn a_journal_record_is_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        let (a, b) = (open(&path), open(&path));
        a.record(&[event("r", 0, EventKind::SagaStarted)]).unwrap();
        let err = b.record(&[event("r", 0, EventKind::SagaResumed)]).unwrap_err();
        assert!(matches!(&err, CommitError::Backend(m) if m.contains("'r'") && m.contains("seq 0")), "{err}");
        assert_eq!(a.events("r").unwrap()[0].event, EventKind::SagaStarted);
        // The failed write does not block b's other runs.
        b.record(&[event("other", 0, EventKind::SagaStarted)]).unwrap();
        let mut txn = Txn::new(b.snapshot(), WriteQuota::default());
        txn.put("pools", "q", "{}").unwrap();
        b.commit(&txn, None, &[event("other", 1, EventKind::StepCompleted)]).unwrap();
        assert_eq!(b.events("other").unwrap().len(), 2);
    }

    /// A step that adds one to the counter `pools/{counter}` and writes `marks/{key}`.
    fn step(db: &SqliteBackend, counter: &str, key: &str, result: Option<&str>, event: Event) -> StepCommit {
        StepCommit {
            txn: Some(counting(db, counter, key)),
            result: result.map(|k| (k.to_string(), json!(key).to_string())),
            events: records(&[event]),
            run: None,
        }
    }

    fn records(events: &[Event]) -> Vec<Record> {
        events.iter().map(|e| Record::of(e).unwrap()).collect()
    }

    #[test]
    fn a_group_writes_each_step_atomically_and_refuses_only_the_bad_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        let db = open(&path);
        db.seed(&state()).unwrap();
        db.commit(&Txn::new(db.snapshot(), WriteQuota::default()), Some(("cached", &json!("first"))), &[]).unwrap();
        db.record(&[event("r", 0, EventKind::SagaStarted)]).unwrap();
        db.register_run(&run_record("old", 1)).unwrap();
        let steps = vec![
            step(&db, "p", "a", Some("ka"), event("r", 1, EventKind::StepCompleted)),
            // Read the counter before `a` wrote it, in the same transaction: a conflict.
            step(&db, "p", "stale", None, event("s", 0, EventKind::StepCompleted)),
            // Another delivery of a call that committed before.
            step(&db, "p", "again", Some("cached"), event("t", 0, EventKind::StepCompleted)),
            // A journal record that is already there.
            step(&db, "q", "dup", None, event("r", 0, EventKind::StepCompleted)),
            // Two records, the second already there: the first is taken back.
            StepCommit {
                events: records(&[event("u", 0, EventKind::StepStarted), event("r", 0, EventKind::StepCompleted)]),
                ..step(&db, "q", "half", None, event("u", 0, EventKind::StepStarted))
            },
            StepCommit { events: records(&[event("r", 2, EventKind::SagaFinished)]), ..StepCommit::default() },
            // A run registered with the others, and one registered before.
            StepCommit { run: Some(run_record("new", 1)), ..StepCommit::default() },
            StepCommit { run: Some(run_record("old", 2)), ..StepCommit::default() },
        ];
        let outcomes = db.write_group(&steps);
        assert_eq!(outcomes[0].as_ref().ok().map(Vec::len), Some(2));
        assert!(matches!(&outcomes[1], Err(StepError::Failed(CommitError::Conflict(c))) if c.key == "p"));
        assert!(matches!(&outcomes[2], Err(StepError::Failed(CommitError::AlreadyCommitted(v))) if v == "first"));
        assert!(matches!(&outcomes[3], Err(StepError::Duplicate(_))));
        assert!(matches!(&outcomes[4], Err(StepError::Duplicate(_))));
        assert!(outcomes[5].is_ok() && outcomes[6].is_ok());
        assert!(matches!(&outcomes[7], Err(StepError::RunExists)));
        // What a refused step wrote before it was refused is gone; the others are durable.
        drop(db);
        let db = open(&path);
        assert_eq!(allocated(&db), 1);
        let marks: Vec<String> =
            db.current_state().unwrap().namespace("marks").unwrap().iter().map(|(k, _)| k.to_string()).collect();
        assert_eq!(marks, ["a"]);
        assert!(db.current_state().unwrap().get("pools", "q").is_none());
        assert_eq!(db.cached("ka"), Some(json!("a")));
        let kinds: Vec<EventKind> = db.events("r").unwrap().into_iter().map(|e| e.event).collect();
        assert_eq!(kinds, [EventKind::SagaStarted, EventKind::StepCompleted, EventKind::SagaFinished]);
        assert!(db.events("s").unwrap().is_empty() && db.events("t").unwrap().is_empty());
        assert!(db.events("u").unwrap().is_empty(), "a refused step's first record stayed");
        let mut runs: Vec<(String, u32)> = db.runs().unwrap().into_iter().map(|r| (r.run_id, r.pid)).collect();
        runs.sort();
        assert_eq!(runs, [("new".to_string(), 1), ("old".to_string(), 1)], "the first registration of 'old' stands");
    }

    #[test]
    fn a_step_the_database_fails_to_write_fails_its_whole_transaction_and_leaves_no_half() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        let db = open(&path);
        db.seed(&state()).unwrap();
        // A document SQLite will not store, as a full disk would not: the step's journal
        // record is written before it, and must not stay without it.
        lock(&db.conn)
            .execute_batch(
                "CREATE TRIGGER poison BEFORE INSERT ON docs WHEN NEW.key = 'poison'
                 BEGIN SELECT RAISE(ABORT, 'the disk refused it'); END;",
            )
            .unwrap();
        let steps = vec![
            step(&db, "p", "a", None, event("r", 0, EventKind::StepCompleted)),
            step(&db, "q", "poison", None, event("u", 0, EventKind::StepCompleted)),
        ];
        for outcome in db.write_group(&steps) {
            assert!(matches!(&outcome, Err(StepError::Failed(CommitError::Backend(m))) if m.contains("refused")));
        }
        drop(db);
        let db = open(&path);
        assert!(db.events("u").unwrap().is_empty(), "half a step was committed");
        assert!(db.events("r").unwrap().is_empty() && db.current_state().unwrap().get("marks", "a").is_none());
        assert_eq!(allocated(&db), 0);
    }

    #[test]
    fn concurrent_commits_share_transactions_and_every_acknowledged_one_is_durable() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        let db = std::sync::Arc::new(SqliteBackend::open(&path, Durability::Full).unwrap());
        db.seed(&state()).unwrap();
        let total = commit_at_once(db.clone(), 8, 40);
        let transactions = db.transactions();
        drop(db);
        assert_every_commit_there(&open(&path), 8, 40);
        assert!(transactions < total, "{transactions} transactions for {total} commits: none were grouped");
    }

    #[test]
    fn snapshots_and_cache_lookups_do_not_wait_for_a_transaction_in_progress() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        let db = std::sync::Arc::new(open(&path));
        db.seed(&state()).unwrap();
        db.commit(&Txn::new(db.snapshot(), WriteQuota::default()), Some(("k", &json!("out"))), &[]).unwrap();
        // Another process commits, so that the next snapshot has to catch up.
        let other = open(&path);
        let mut txn = Txn::new(other.snapshot(), WriteQuota::default());
        txn.put("pools", "p", r#"{"allocated":7}"#).unwrap();
        other.commit(&txn, None, &[]).unwrap();
        // A group's transaction in progress holds the writing connection...
        let writing = lock(&db.conn);
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = db.clone();
        std::thread::spawn(move || {
            let allocated = reader.snapshot().get("pools", "p").map(|d| d.text.to_string());
            tx.send((allocated, reader.cached("k"))).unwrap();
        });
        // ...and a run's snapshot and its cache lookup are served meanwhile, up to date.
        let served = rx.recv_timeout(Duration::from_secs(20));
        drop(writing);
        let (allocated, cached) = served.expect("a snapshot or a cache lookup waited for the writing connection");
        assert_eq!(allocated.as_deref(), Some(r#"{"allocated":7}"#));
        assert_eq!(cached, Some(json!("out")));
    }

    #[test]
    fn a_reused_run_id_is_reported_as_such() {
        let dir = tempfile::tempdir().unwrap();
        let db = open(&dir.path().join("db.sqlite"));
        db.register_run(&run_record("r", 1)).unwrap();
        let err = db.register_run(&run_record("r", 2)).unwrap_err();
        assert!(matches!(err, RegisterError::Exists { ref run_id, .. } if run_id == "r"), "{err}");
    }

    #[test]
    fn opening_a_missing_database_for_reading_creates_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing.sqlite");
        let err = SqliteBackend::open_existing(&path, Durability::Normal).err().unwrap();
        assert!(err.to_string().contains("missing.sqlite") && err.to_string().contains("no such database"), "{err}");
        assert!(!path.exists());
    }
}
