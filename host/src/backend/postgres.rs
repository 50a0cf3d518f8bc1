//! The PostgreSQL backend: the store, the idempotency result cache, the run registry and the
//! journal in one PostgreSQL database, so that many sagabox processes on many machines
//! share them.
//!
//! It keeps the guarantees of the SQLite backend. A call's writes, its cached result and
//! the journal events that record it commit in one transaction. Commits are serialized by
//! a row lock on the store's version counter (`meta`), under which a commit is validated
//! against every commit before it, so concurrent processes never lose updates; it takes
//! its version from that counter. The steps a process commits at once share one such
//! transaction (group commit, [`super::group`]), each still checked and refused on its own.
//! Each process keeps the state in memory (an O(1)-snapshot [`State`]) and catches up by
//! reading only the documents written since its version.
//!
//! The schema is created and migrated by sagabox itself ([`MIGRATIONS`], embedded in the
//! binary, applied once under an advisory lock). Tables live in the connection's current
//! schema, so `?options=-csearch_path%3Dname` in the URL gives a deployment (or a test) its
//! own. Connections come from a `deadpool-postgres` pool; a query that fails because its
//! connection broke (the server restarted, `pg_terminate_backend`) is retried on a new one.
//!
//! The trait is synchronous: each method runs its queries on this backend's own small tokio
//! runtime, which drives the connections, and waits for them (the engine calls it off the
//! async workers, see [`Backend::blocks`]).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Mutex, RwLock};
use std::time::Duration;

use deadpool_postgres::GenericClient;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use serde_json::Value;
use tokio_postgres::NoTls;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;

use super::group::Group;
use super::sqlite::Durability;
use super::{
    Backend, BeforeCall, CommitError, DbError, DocRow, RegisterError, RunRecord, UNFINISHED, apply_commits,
    finished_status, holds, lock, now_ms, this_process, write_at_once,
};
use crate::saga::journal::Event;
use crate::store::{Change, State, Txn};
use crate::sync::{read, write};

/// The schema, one migration per version; a database records which it has applied
/// (`sagabox_migrations`). Append, never edit: deployed databases hold the old ones.
const MIGRATIONS: &[&str] = &[
    "
CREATE TABLE meta (name TEXT PRIMARY KEY, value BIGINT NOT NULL);
INSERT INTO meta VALUES ('version', 0);
-- Documents; a deleted one keeps its row with a NULL body, so other processes see the delete.
CREATE TABLE docs (
    ns TEXT NOT NULL, key TEXT NOT NULL, body TEXT, version BIGINT NOT NULL, PRIMARY KEY (ns, key));
CREATE INDEX docs_by_version ON docs (version);
CREATE TABLE namespaces (ns TEXT PRIMARY KEY, keys_version BIGINT NOT NULL);
CREATE TABLE results (key TEXT PRIMARY KEY, run_id TEXT NOT NULL, output TEXT NOT NULL);
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY, saga TEXT NOT NULL, saga_path TEXT NOT NULL, definition TEXT NOT NULL,
    input TEXT NOT NULL, seed BIGINT NOT NULL, status TEXT NOT NULL, pid BIGINT NOT NULL,
    started_ms BIGINT NOT NULL, finished_ms BIGINT);
CREATE TABLE events (run_id TEXT NOT NULL, seq BIGINT NOT NULL, body TEXT NOT NULL, PRIMARY KEY (run_id, seq));
",
    "
-- Run owners and their leases, for workers (`sagabox worker`).
ALTER TABLE runs ADD COLUMN owner TEXT NOT NULL DEFAULT '', ADD COLUMN lease_until_ms BIGINT;
CREATE INDEX runs_by_status ON runs (status, started_ms);
",
    "
-- The queue's order in full: a claim reads the oldest queued runs off this index and stops.
DROP INDEX runs_by_status;
CREATE INDEX runs_queue ON runs (status, started_ms, run_id);
",
    // A run's results cached under the run (`ids::cache_key`), old ones copied there too.
    super::sqlite::RESULTS_UNDER_THEIR_RUNS,
];

/// Claims up to $5 runs for this process ($1 its pid, $2 its name) until $3, oldest first:
/// queued runs, running ones another process holds whose lease ran out before $4 (now), and
/// running ones this process holds that are not in $6 (`lost`: see [`Backend::claim_runs`]).
/// Each kind is read off `runs_queue` in order and stops at the limit, so a claim's cost does
/// not grow with the queue (one `WHERE queued OR expired` sorted every queued run, on every
/// claim: 48 ms at 40,000; the expired half still reads every running run). SKIP LOCKED:
/// workers claiming at once take different runs. When several kinds are there, the statement
/// locks up to $5 of each and takes the oldest $5: until it ends, another claimer skips the
/// rest (they stay claimable). Built once, and prepared once per connection.
static CLAIM: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "WITH queued AS (
             SELECT run_id, started_ms FROM runs WHERE status = 'queued'
             ORDER BY started_ms, run_id LIMIT $5 FOR UPDATE SKIP LOCKED),
         expired AS (
             SELECT run_id, started_ms FROM runs WHERE status = 'running' AND lease_until_ms < $4 AND owner <> $2
             ORDER BY started_ms, run_id LIMIT $5 FOR UPDATE SKIP LOCKED),
         lost AS (
             SELECT run_id, started_ms FROM runs WHERE status = 'running' AND owner = $2 AND run_id <> ALL($6)
             ORDER BY started_ms, run_id LIMIT $5 FOR UPDATE SKIP LOCKED),
         chosen AS (
             SELECT run_id FROM (SELECT * FROM queued UNION ALL SELECT * FROM expired UNION ALL SELECT * FROM lost)
                 AS claimable
             ORDER BY started_ms, run_id LIMIT $5)
         UPDATE runs SET status = 'running', pid = $1, owner = $2, lease_until_ms = $3
         WHERE run_id IN (SELECT run_id FROM chosen)
         RETURNING {RUN_COLUMNS}"
    )
});

/// Documents a seeding statement inserts.
const SEED_ROWS: usize = 5_000;

/// The store's version (the last commit's).
const VERSION: &str = "SELECT value FROM meta WHERE name = 'version'";
/// The documents written after version $1, in the order they were written.
///
/// The upper bound, always true, makes the condition a range, which PostgreSQL estimates at
/// 0.5 % of the rows when the table has no statistics yet (new, or seeded or grown since
/// autovacuum last analyzed it) and reads through `docs_by_version`. `version > $1` alone is
/// then estimated at a third of the rows and read by scanning the table, in every commit: at
/// 10,000 documents 0.8 ms of a 10,000-step saga's commits, against 0.1 at its start.
const DOCS_SINCE: &str = "SELECT ns, key, body, version FROM docs
                          WHERE version > $1 AND version <= 9223372036854775807 ORDER BY version, ns, key";

/// The columns of a run, in [`run_from_row`]'s order.
const RUN_COLUMNS: &str =
    "run_id, saga, saga_path, definition, input, seed, status, pid, owner, lease_until_ms, started_ms, finished_ms";

/// How many times a query is tried when its connection breaks, and the first pause.
const ATTEMPTS: u32 = 6;
const FIRST_PAUSE: Duration = Duration::from_millis(25);
/// How long a new connection waits for the server to free a connection slot (as long as
/// one waits for the pool), and the longest pause between its tries.
const SLOT_WAIT: Duration = Duration::from_secs(60);
const LONGEST_SLOT_PAUSE: Duration = Duration::from_millis(500);

/// Whether `url` names a PostgreSQL database (rather than a SQLite file).
pub fn is_postgres_url(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// `url` with its password replaced by `***`, for messages.
pub fn redact(url: &str) -> String {
    let mut out = url.to_string();
    if let Some(scheme_end) = out.find("://") {
        let authority_start = scheme_end + 3;
        let authority_end = out[authority_start..].find(['/', '?']).map_or(out.len(), |i| authority_start + i);
        if let Some(at) = out[authority_start..authority_end].rfind('@').map(|i| authority_start + i)
            && let Some(colon) = out[authority_start..at].find(':').map(|i| authority_start + i)
        {
            out.replace_range(colon + 1..at, "***");
        }
    }
    // A password may also come as a query parameter.
    if let Some(start) = out.find("password=").map(|i| i + "password=".len()) {
        let end = out[start..].find('&').map_or(out.len(), |i| start + i);
        out.replace_range(start..end, "***");
    }
    out
}

/// What a transaction attempt failed with.
enum Failure {
    /// The connection broke or the server asked to retry: the attempt may be repeated.
    Transient(String),
    /// The server refused a new connection because every slot it allows (its own, or the
    /// role's or database's limit) is taken: other processes will free one, so it is waited
    /// for, up to [`SLOT_WAIT`].
    NoSlot(String),
    /// Anything else, final.
    Fatal(CommitError),
}

impl From<tokio_postgres::Error> for Failure {
    fn from(e: tokio_postgres::Error) -> Failure {
        if e.code() == Some(&SqlState::TOO_MANY_CONNECTIONS) {
            Failure::NoSlot(describe(&e))
        } else if is_transient(&e) {
            Failure::Transient(describe(&e))
        } else {
            Failure::Fatal(CommitError::Backend(describe(&e)))
        }
    }
}

impl From<CommitError> for Failure {
    fn from(e: CommitError) -> Failure {
        Failure::Fatal(e)
    }
}

impl From<deadpool_postgres::PoolError> for Failure {
    fn from(e: deadpool_postgres::PoolError) -> Failure {
        // Creating a connection fails the same way a broken one does.
        match e {
            deadpool_postgres::PoolError::Backend(e) => e.into(),
            other => Failure::Transient(other.to_string()),
        }
    }
}

/// Errors that a new connection (or a new try) may not repeat.
fn is_transient(e: &tokio_postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    match e.code() {
        // Connection exceptions (class 08), the server shutting down or starting
        // (pg_terminate_backend is ADMIN_SHUTDOWN), serialization failures and deadlocks.
        Some(code) => {
            code.code().starts_with("08")
                || [
                    SqlState::ADMIN_SHUTDOWN,
                    SqlState::CRASH_SHUTDOWN,
                    SqlState::CANNOT_CONNECT_NOW,
                    SqlState::T_R_SERIALIZATION_FAILURE,
                    SqlState::T_R_DEADLOCK_DETECTED,
                ]
                .contains(code)
        }
        // No server error: an I/O error (a reset connection, a refused connect).
        None => std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>()),
    }
}

/// The server's message with its detail, or the driver's.
fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => match db.detail() {
            Some(detail) => format!("{} ({detail})", db.message()),
            None => db.message().to_string(),
        },
        None => match std::error::Error::source(e) {
            Some(source) => format!("{e}: {source}"),
            None => e.to_string(),
        },
    }
}

/// The PostgreSQL backend.
pub struct PostgresBackend {
    /// The URL with its password redacted, for messages.
    name: String,
    pool: Pool,
    /// A connection of its own for lease renewals, so that commits waiting on the version
    /// row's lock never hold a renewal back past the lease.
    leases: Pool,
    /// Drives the pools' connections; shut down in the background on drop, so that a
    /// backend can be dropped inside another runtime.
    runtime: Option<tokio::runtime::Runtime>,
    /// The state as of the database's version `state.version()`.
    state: RwLock<State>,
    /// Events with no state change, written with the next commit (or at a run's start and end).
    pending: Mutex<Vec<Event>>,
    /// Step commits of concurrent runs, written many to a transaction: the version row's
    /// lock, and the round trips under it, are taken once for all of them.
    group: Group<StepCommit, Result<Vec<Change>, CommitError>>,
}

/// Most steps one transaction writes: bounds how long a group holds the version row's lock.
const MAX_GROUP: usize = 256;

impl Drop for PostgresBackend {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl PostgresBackend {
    /// Connects to the database at `url`, creating or migrating sagabox's tables, with the
    /// server's own durability (`synchronous_commit` as the server sets it).
    pub fn open(url: &str) -> Result<PostgresBackend, DbError> {
        PostgresBackend::open_with(url, None)
    }

    /// [`PostgresBackend::open`] with commits as durable as `durability` says: `Full` waits
    /// for the server's WAL flush (`synchronous_commit=on`); `Normal`, like SQLite's, does
    /// not (`off`): a killed sagabox loses nothing, a crashed server may lose its last
    /// commits, never half of one (the journal and the state stay one).
    pub fn open_durable(url: &str, durability: Durability) -> Result<PostgresBackend, DbError> {
        PostgresBackend::open_with(url, Some(durability))
    }

    fn open_with(url: &str, durability: Option<Durability>) -> Result<PostgresBackend, DbError> {
        let name = redact(url);
        let fail = |error: String| DbError { db: name.clone(), error };
        let mut config: tokio_postgres::Config = url.parse().map_err(|e| fail(format!("not a PostgreSQL URL: {e}")))?;
        if let Some(durability) = durability {
            let setting = match durability {
                Durability::Normal => "off",
                Durability::Full => "on",
            };
            let options = format!("{} -c synchronous_commit={setting}", config.get_options().unwrap_or_default());
            config.options(options.trim());
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("sagabox-postgres")
            .enable_all()
            .build()
            .map_err(|e| fail(format!("cannot start the connection runtime: {e}")))?;
        let pool = |size: usize| {
            let manager =
                Manager::from_config(config.clone(), NoTls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
            Pool::builder(manager)
                .max_size(size)
                .runtime(deadpool_postgres::Runtime::Tokio1)
                .create_timeout(Some(Duration::from_secs(10)))
                .wait_timeout(Some(Duration::from_secs(60)))
                .build()
                .map_err(|e| fail(e.to_string()))
        };
        let (pool, leases) = (pool(8)?, pool(1)?);
        let backend = PostgresBackend {
            name,
            pool,
            leases,
            runtime: Some(runtime),
            state: RwLock::new(State::default()),
            pending: Mutex::new(Vec::new()),
            group: Group::new(MAX_GROUP),
        };
        backend.block_on(backend.migrate()).map_err(|e| backend.db_error(e))?;
        let state = backend.current_state()?;
        *write(&backend.state) = state;
        Ok(backend)
    }

    /// Runs `future` on this backend's runtime and waits for it, from any thread (inside
    /// another runtime's worker too: the engine moves blocking backends off its workers).
    fn block_on<F: Future>(&self, future: F) -> F::Output {
        let runtime = self.runtime.as_ref().expect("the runtime lives until drop");
        let _context = runtime.enter();
        // Unconstrained: inside a caller's tokio task, the task's cooperative budget would
        // run out and never be refilled here (this loop never yields to its scheduler).
        futures::executor::block_on(tokio::task::unconstrained(future))
    }

    fn error(&self, e: impl std::fmt::Display) -> DbError {
        DbError { db: self.name.clone(), error: e.to_string() }
    }

    fn db_error(&self, e: CommitError) -> DbError {
        match e {
            CommitError::Backend(message) => self.error(message),
            other => self.error(other),
        }
    }

    /// `e` with the database named in its message.
    fn named(&self, e: CommitError) -> CommitError {
        match e {
            CommitError::Backend(message) => CommitError::Backend(self.error(message).to_string()),
            other => other,
        }
    }

    /// Runs `attempt` on a pooled connection, again on a new one while it fails transiently.
    /// Error messages do not name the database yet.
    async fn with_retry<T>(
        &self,
        attempt: impl AsyncFnMut(&mut deadpool_postgres::Client, u32) -> Result<T, Failure>,
    ) -> Result<T, CommitError> {
        self.with_retry_on(&self.pool, attempt).await
    }

    /// [`Self::with_retry`] on connections of `pool`.
    async fn with_retry_on<T>(
        &self,
        pool: &Pool,
        mut attempt: impl AsyncFnMut(&mut deadpool_postgres::Client, u32) -> Result<T, Failure>,
    ) -> Result<T, CommitError> {
        let mut pause = FIRST_PAUSE;
        let mut tries = 0;
        let (mut slot_pause, mut waiting_for_slot) = (FIRST_PAUSE, None);
        loop {
            tries += 1;
            let result = match pool.get().await {
                Ok(mut client) => attempt(&mut client, tries).await,
                Err(e) => Err(e.into()),
            };
            match result {
                Ok(value) => return Ok(value),
                Err(Failure::Fatal(e)) => return Err(e),
                Err(Failure::Transient(e)) if tries >= ATTEMPTS => {
                    return Err(CommitError::Backend(format!("{e} (tried {tries} times)")));
                }
                Err(Failure::Transient(e)) => {
                    tracing::warn!(db = %self.name, "retrying after a broken connection: {e}");
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
                Err(Failure::NoSlot(e)) => {
                    // Counted apart from broken connections: a busy server is no sign of a
                    // broken one, and its slots free up as other processes finish.
                    tries -= 1;
                    let since = *waiting_for_slot.get_or_insert_with(|| {
                        tracing::warn!(db = %self.name, "waiting for a free connection slot: {e}");
                        std::time::Instant::now()
                    });
                    if since.elapsed() >= SLOT_WAIT {
                        return Err(CommitError::Backend(format!(
                            "{e} (waited {}s for a free connection slot; raise the server's max_connections \
                             or run fewer processes)",
                            SLOT_WAIT.as_secs()
                        )));
                    }
                    tokio::time::sleep(slot_pause).await;
                    slot_pause = (slot_pause * 2).min(LONGEST_SLOT_PAUSE);
                }
            }
        }
    }

    /// The runs `condition` (SQL) selects, oldest first.
    fn select_runs(&self, condition: &str) -> Result<Vec<RunRecord>, DbError> {
        let sql = format!("SELECT {RUN_COLUMNS} FROM runs WHERE {condition} ORDER BY started_ms, run_id");
        self.read(async |client, _| Ok(client.query(&sql, &[]).await?.iter().map(run_from_row).collect()))
    }

    /// Read-only queries, retried like any other.
    fn read<T>(
        &self,
        query: impl AsyncFnMut(&mut deadpool_postgres::Client, u32) -> Result<T, Failure>,
    ) -> Result<T, DbError> {
        self.block_on(self.with_retry(query)).map_err(|e| self.db_error(e))
    }

    /// Creates or migrates the schema; two processes starting at once migrate it once.
    async fn migrate(&self) -> Result<(), CommitError> {
        self.with_retry(async |client, _| {
            let tx = client.transaction().await?;
            tx.batch_execute(
                "SELECT pg_advisory_xact_lock(hashtext('sagabox migrations ' || current_schema()));
                 CREATE TABLE IF NOT EXISTS sagabox_migrations (version INT PRIMARY KEY, applied_ms BIGINT NOT NULL);",
            )
            .await?;
            let applied: i32 =
                tx.query_one("SELECT COALESCE(MAX(version), 0) FROM sagabox_migrations", &[]).await?.get(0);
            let known = MIGRATIONS.len() as i32;
            if applied > known {
                return Err(Failure::Fatal(CommitError::Backend(format!(
                    "the database's schema is version {applied}, newer than this sagabox's ({known}): upgrade sagabox"
                ))));
            }
            for (n, sql) in MIGRATIONS.iter().enumerate().skip(applied as usize) {
                tx.batch_execute(sql).await?;
                tx.execute("INSERT INTO sagabox_migrations VALUES ($1, $2)", &[&(n as i32 + 1), &(now_ms() as i64)])
                    .await?;
            }
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    /// Documents written after `since` with the version they were written at, the
    /// namespaces' key-set versions, and the database's version, read in one snapshot.
    async fn read_since(
        client: &mut deadpool_postgres::Client,
        since: u64,
    ) -> Result<(Vec<DocRow>, Vec<(String, u64)>, u64), tokio_postgres::Error> {
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await?;
        let (docs, keys, version) = Self::rows_since(&tx, since).await?;
        tx.commit().await?;
        Ok((docs, keys, version))
    }

    /// [`Self::read_since`] in the caller's transaction.
    async fn rows_since(
        tx: &impl GenericClient,
        since: u64,
    ) -> Result<(Vec<DocRow>, Vec<(String, u64)>, u64), tokio_postgres::Error> {
        let version = Self::version_in(tx).await?;
        let docs = tx
            .query(&tx.prepare_cached(DOCS_SINCE).await?, &[&(since as i64)])
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get::<_, i64>(3) as u64))
            .collect();
        let keys = tx
            .query(
                &tx.prepare_cached("SELECT ns, keys_version FROM namespaces WHERE keys_version > $1").await?,
                &[&(since as i64)],
            )
            .await?
            .iter()
            .map(|r| (r.get(0), r.get::<_, i64>(1) as u64))
            .collect();
        Ok((docs, keys, version))
    }

    /// The database's version (the statement is prepared once per connection).
    async fn version_in(client: &impl GenericClient) -> Result<u64, tokio_postgres::Error> {
        Ok(client.query_one(&client.prepare_cached(VERSION).await?, &[]).await?.get::<_, i64>(0) as u64)
    }

    /// The documents written since `since`, and the version they bring the state to, when
    /// the database's `version` is past it.
    async fn read_if_behind(
        client: &mut deadpool_postgres::Client,
        since: u64,
        version: u64,
    ) -> Result<Behind, Failure> {
        if version == since {
            return Ok(None);
        }
        let (docs, _, version) = Self::read_since(client, since).await?;
        Ok(Some((docs, version)))
    }

    /// The state, brought up to date with what [`Self::read_if_behind`] read.
    fn caught_up(&self, read_rows: Result<Behind, DbError>) -> State {
        match read_rows {
            Ok(Some((docs, version))) => self.apply_rows(docs, version),
            Ok(None) => {}
            Err(e) => tracing::warn!("cannot catch up with the database: {e}"),
        }
        read(&self.state).clone()
    }

    /// Brings the in-memory state up to `version` with the rows read since its own.
    fn apply_rows(&self, docs: Vec<DocRow>, version: u64) {
        let mut state = write(&self.state);
        if state.version() < version {
            // Rows this state already holds (read again by a catch-up that started earlier) are left out.
            let since = state.version();
            let newer: Vec<DocRow> = docs.into_iter().filter(|row| row.3 > since).collect();
            apply_commits(&mut state, &newer, version);
        }
    }

    /// The output cached under `key`.
    async fn cached_in(client: &impl GenericClient, key: &str) -> Result<Option<Value>, Failure> {
        // Prepared once per connection: every call of a durable run asks, before it runs.
        let row = client
            .query_opt(&client.prepare_cached("SELECT output FROM results WHERE key = $1").await?, &[&key])
            .await?;
        row.map(|r| {
            let text: String = r.get(0);
            serde_json::from_str(&text)
                .map_err(|e| Failure::Fatal(CommitError::Backend(format!("cached result {key}: {e}"))))
        })
        .transpose()
    }

    /// Writes `pending` (held back earlier), then `events`, in `tx`, and records run ends,
    /// with `statements` prepared on `tx`'s connection. `taken_over`: the runs that another
    /// process holds, read in `tx` ([`HOLDERS`]); the caller has refused `events` of them,
    /// and their `pending` ones are dropped with a warning. A pending record that is already
    /// there is dropped with a warning; one of `events` fails its statement, and so the
    /// transaction.
    ///
    /// Its statements are all sent when the future is first polled, before any reply is
    /// awaited: a COMMIT polled after it in the same round trip runs after them.
    async fn write_events(
        &self,
        tx: &impl tokio_postgres::GenericClient,
        statements: &JournalStatements,
        (pending, events): (&[&Event], &[&Event]),
        taken_over: &HashMap<String, String>,
    ) -> Result<(), Failure> {
        let (pending, dropped): (Vec<&Event>, Vec<&Event>) =
            pending.iter().copied().partition(|e| !taken_over.contains_key(&e.run_id));
        if let Some(event) = dropped.first() {
            let owner = &taken_over[&event.run_id];
            tracing::warn!(
                "dropping {} journal records held back of run '{}': taken over by {owner}",
                dropped.len(),
                event.run_id
            );
        }
        let held_back = Records::of(pending.iter().copied())?;
        let own = Records::of(events.iter().copied())?;
        // Only a run's own commit carries its end (`write_at_once`): never a held-back record.
        let (finished, statuses): (Vec<&str>, Vec<&str>) =
            events.iter().filter_map(|e| Some((e.run_id.as_str(), finished_status(e)?))).unzip();
        let now = now_ms() as i64;
        let (inserted, (), ()) = futures::try_join!(
            async {
                match held_back.runs.is_empty() {
                    true => Ok(Vec::new()),
                    false => tx.query(&statements.held_back, &held_back.params()).await,
                }
            },
            async {
                match own.runs.is_empty() {
                    true => Ok(()),
                    false => tx.execute(&statements.own, &own.params()).await.map(drop),
                }
            },
            async {
                match finished.is_empty() {
                    true => Ok(()),
                    false => tx.execute(&statements.finish, &[&finished, &statuses, &now]).await.map(drop),
                }
            },
        )
        .map_err(|e| journal_failure(e, events))?;
        let inserted: std::collections::HashSet<(String, i64)> =
            inserted.iter().map(|r| (r.get(0), r.get(1))).collect();
        for event in pending.iter().filter(|e| !inserted.contains(&(e.run_id.clone(), e.seq as i64))) {
            tracing::warn!("dropping a journal record: {}", duplicate_event(event));
        }
        Ok(())
    }

    /// Takes out the held-back events of `run_id`'s run: its next write carries them, so
    /// that its journal is written in order whatever other runs commit meanwhile.
    fn take_pending(&self, run_id: Option<&str>) -> Vec<Event> {
        let Some(run_id) = run_id else { return Vec::new() };
        let mut pending = lock(&self.pending);
        let (theirs, others) = std::mem::take(&mut *pending).into_iter().partition(|e| e.run_id == run_id);
        *pending = others;
        theirs
    }

    /// Puts back held-back events a failed write did not write, ahead of newer ones.
    fn restore_pending(&self, mut events: Vec<Event>) {
        let mut pending = lock(&self.pending);
        events.append(&mut pending);
        *pending = events;
    }

    /// Runs a write that carries `run_id`'s held-back events, putting them back if it fails.
    fn carrying_pending<T>(
        &self,
        run_id: Option<&str>,
        write: impl FnOnce(Vec<Event>) -> Result<T, CommitError>,
    ) -> Result<T, CommitError> {
        let pending = self.take_pending(run_id);
        let written = write(pending.clone());
        // Unless the run is another process's now: then they are dropped.
        if written.as_ref().is_err_and(|e| !matches!(e, CommitError::TakenOver { .. })) {
            self.restore_pending(pending);
        }
        written
    }

    /// Writes `steps` (of different runs, in arrival order) in one transaction, each
    /// refused on its own or written; if the transaction fails, every step fails with it.
    fn write_group(&self, steps: Vec<StepCommit>) -> Vec<Result<Vec<Change>, CommitError>> {
        let mut tried = vec![None; steps.len()];
        let attempt =
            async |client: &mut deadpool_postgres::Client, _| self.try_group(client, &steps, &mut tried).await;
        match self.block_on(self.with_retry(attempt)) {
            Ok(outcomes) => outcomes,
            Err(e) => steps.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    /// Transactions that wrote steps so far (fewer than the steps when concurrent runs'
    /// commits were grouped).
    pub fn transactions(&self) -> u64 {
        self.group.batches()
    }

    /// One try of [`Self::write_group`]. `tried` keeps what an earlier try computed for each
    /// step it admitted: when that try's COMMIT got no answer, this one finds out from the
    /// journal whether it happened.
    async fn try_group(
        &self,
        client: &mut deadpool_postgres::Client,
        steps: &[StepCommit],
        tried: &mut [Option<Vec<Change>>],
    ) -> Result<Vec<Result<Vec<Change>, CommitError>>, Failure> {
        let statements = CommitStatements::prepare(client).await?;
        let tx = Pipelined::on(client);
        let since = read(&self.state).version() as i64;
        // One round trip for the BEGIN and five reads (the server runs them in order, so the
        // others are read under the lock): the row lock serializes the commits of every
        // process and the version follows it; then the steps' cached results; the documents
        // other processes wrote since this one's state; who holds the steps' runs (a fence,
        // see HOLDERS); and how far their journals go.
        let keys: Vec<&str> = steps.iter().filter_map(|s| Some(s.result.as_ref()?.0.as_str())).collect();
        let run_ids = runs_of(steps.iter().flat_map(|s| s.pending.iter().chain(&s.events)));
        let journaled = runs_of(steps.iter().flat_map(|s| &s.events));
        let params: [[&(dyn ToSql + Sync); 1]; 4] = [[&keys], [&since], [&run_ids], [&journaled]];
        let ((), version, cached, docs, holders, last_seqs) = futures::try_join!(
            tx.begin(),
            tx.query_one(&statements.lock, &[]),
            tx.query(&statements.cached, &params[0]),
            tx.query(&statements.docs, &params[1]),
            tx.query(&statements.holders, &params[2]),
            tx.query(&statements.last_seqs, &params[3]),
        )?;
        let version: i64 = version.get(0);
        let docs: Vec<DocRow> =
            docs.iter().map(|r| (r.get(0), r.get(1), r.get(2), r.get::<_, i64>(3) as u64)).collect();
        self.apply_rows(docs, version as u64);
        let found = Found {
            cached: cached.iter().map(|r| (r.get(0), r.get(1))).collect(),
            last_seqs: last_seqs.iter().filter_map(|r| Some((r.get(0), r.get::<_, Option<i64>>(1)? as u64))).collect(),
            tried_first: Self::first_records_of_tried(&*tx, steps, tried).await?,
            taken_over: held_elsewhere(&holders),
        };
        let mut group = GroupWrites::new(read(&self.state).clone(), version);
        let outcomes: Vec<_> =
            steps.iter().zip(tried.iter_mut()).map(|(step, tried)| group.admit(step, tried, &found)).collect();
        if group.admitted.is_empty() {
            return Ok(outcomes);
        }
        // One round trip for every write (the journal, the documents, the namespaces whose
        // key sets changed, the cached results, the version) and the COMMIT: the version
        // row's lock, which every process's commits queue on, is held a round trip less than
        // with the COMMIT sent after their replies. A write that fails aborts the
        // transaction, and the COMMIT then ends it without committing; its error is what the
        // join returns.
        let (held_back, own) = group.records();
        let (docs, keys, results, next) = (&group.docs, &group.key_sets, &group.results, group.version);
        futures::try_join!(
            self.write_events(&*tx, &statements.journal, (&held_back, &own), &found.taken_over),
            async { Ok(tx.execute(&statements.put, &[&docs.ns, &docs.keys, &docs.bodies, &docs.versions]).await?) },
            async { Ok(tx.execute(&statements.keys, &[&keys.0, &keys.1]).await?) },
            async { Ok(tx.execute(&statements.cache, &[&results.0, &results.1, &results.2]).await?) },
            async { Ok(tx.execute(&statements.bump, &[&next]).await?) },
            async { Ok::<_, Failure>(tx.batch_execute("COMMIT").await?) },
        )?;
        tx.committed();
        let mut state = write(&self.state);
        // A snapshot may have caught up past these commits meanwhile: then it holds them.
        for (version, step) in &group.admitted {
            if state.version() < *version as u64 {
                state.apply(*version as u64, step.txn.writes());
            }
        }
        Ok(outcomes)
    }

    /// The first journal record, as the database holds it, of each step an earlier try
    /// admitted: when that try's COMMIT got no answer, [`FirstRecords::wrote`] tells whether
    /// it committed. Read (in one statement) only on such a retry.
    async fn first_records_of_tried(
        tx: &impl tokio_postgres::GenericClient,
        steps: &[StepCommit],
        tried: &[Option<Vec<Change>>],
    ) -> Result<FirstRecords, Failure> {
        let firsts: Vec<&Event> = steps
            .iter()
            .zip(tried)
            .filter(|(_, tried)| tried.is_some())
            .filter_map(|(s, _)| s.events.first())
            .collect();
        Self::first_records(tx, &firsts).await
    }

    /// The records of the database at the places (run, seq) of `firsts`, as it holds them.
    async fn first_records(
        tx: &impl tokio_postgres::GenericClient,
        firsts: &[&Event],
    ) -> Result<FirstRecords, Failure> {
        if firsts.is_empty() {
            return Ok(FirstRecords::default());
        }
        let runs: Vec<&str> = firsts.iter().map(|e| e.run_id.as_str()).collect();
        let seqs: Vec<i64> = firsts.iter().map(|e| e.seq as i64).collect();
        let rows = tx
            .query(
                "SELECT e.run_id, e.seq, e.body FROM events e
                 JOIN unnest($1::text[], $2::bigint[]) AS w(run_id, seq) ON e.run_id = w.run_id AND e.seq = w.seq",
                &[&runs, &seqs],
            )
            .await?;
        Ok(FirstRecords(rows.iter().map(|r| ((r.get(0), r.get::<_, i64>(1) as u64), r.get(2))).collect()))
    }

    /// Writes `pending` and `events` in a transaction of their own.
    async fn write_now(&self, pending: &[Event], events: &[Event]) -> Result<(), CommitError> {
        self.with_retry(async |client, tries| {
            let holders = client.prepare_cached(HOLDERS).await?;
            let journal = JournalStatements::prepare(client).await?;
            let tx = Pipelined::on(client);
            let run_ids = runs_of(pending.iter().chain(events));
            // One round trip: the BEGIN, then whether a retried write's first try committed
            // (it finds its own records), then the runs' holders.
            let first: Vec<&Event> = events.first().filter(|_| tries > 1).into_iter().collect();
            let ((), there, holders) = futures::try_join!(
                async { Ok::<_, Failure>(tx.begin().await?) },
                Self::first_records(&*tx, &first),
                async { Ok(tx.query(&holders, &[&run_ids]).await?) },
            )?;
            if first.first().is_some_and(|first| there.wrote(first)) {
                return Ok(());
            }
            let taken_over = held_elsewhere(&holders);
            refuse_taken_over(events, &taken_over)?;
            let (pending, events): (Vec<&Event>, Vec<&Event>) = (pending.iter().collect(), events.iter().collect());
            // The COMMIT goes with the records, as in `try_group`.
            futures::try_join!(self.write_events(&*tx, &journal, (&pending, &events), &taken_over), async {
                Ok::<_, Failure>(tx.batch_execute("COMMIT").await?)
            },)?;
            tx.committed();
            Ok(())
        })
        .await
    }
}

/// A journal record that is already there: another process writes this run's journal.
fn duplicate_event(event: &Event) -> String {
    format!("{} (another process writes this run)", super::duplicate_event(event))
}

/// The statements of a group's commit ([`PostgresBackend::try_group`]), prepared once per
/// connection and taken from its cache before the transaction begins.
struct CommitStatements {
    lock: tokio_postgres::Statement,
    cached: tokio_postgres::Statement,
    docs: tokio_postgres::Statement,
    holders: tokio_postgres::Statement,
    last_seqs: tokio_postgres::Statement,
    put: tokio_postgres::Statement,
    keys: tokio_postgres::Statement,
    cache: tokio_postgres::Statement,
    bump: tokio_postgres::Statement,
    journal: JournalStatements,
}

impl CommitStatements {
    async fn prepare(client: &deadpool_postgres::Client) -> Result<CommitStatements, Failure> {
        let (lock, cached, docs, holders, last_seqs) = futures::try_join!(
            client.prepare_cached("SELECT value FROM meta WHERE name = 'version' FOR UPDATE"),
            client.prepare_cached("SELECT key, output FROM results WHERE key = ANY($1)"),
            client.prepare_cached(DOCS_SINCE),
            client.prepare_cached(HOLDERS),
            // Each run's last record off the key's end (max() with GROUP BY reads all of them).
            client.prepare_cached(
                "SELECT w.run_id, (SELECT e.seq FROM events e WHERE e.run_id = w.run_id ORDER BY e.seq DESC LIMIT 1)
                 FROM unnest($1::text[]) AS w(run_id)",
            ),
        )?;
        let (put, keys, cache, bump) = futures::try_join!(
            client.prepare_cached(
                "INSERT INTO docs (ns, key, body, version) SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[])
                 ON CONFLICT (ns, key) DO UPDATE SET body = EXCLUDED.body, version = EXCLUDED.version",
            ),
            client.prepare_cached(
                "INSERT INTO namespaces SELECT * FROM unnest($1::text[], $2::bigint[])
                 ON CONFLICT (ns) DO UPDATE SET keys_version = EXCLUDED.keys_version",
            ),
            client.prepare_cached(
                "INSERT INTO results (key, run_id, output) SELECT * FROM unnest($1::text[], $2::text[], $3::text[])",
            ),
            client.prepare_cached("UPDATE meta SET value = $1 WHERE name = 'version'"),
        )?;
        let journal = JournalStatements::prepare(client).await?;
        Ok(CommitStatements { lock, cached, docs, holders, last_seqs, put, keys, cache, bump, journal })
    }
}

/// One step's commit, owned so that whichever caller leads the group writes it.
struct StepCommit {
    txn: Txn,
    /// The call's idempotency key and its output (JSON text).
    result: Option<(String, String)>,
    /// The run's records held back since its last commit, written before `events`.
    pending: Vec<Event>,
    events: Vec<Event>,
}

/// What a group's transaction read under the version row's lock.
struct Found {
    /// The steps' idempotency keys that have a cached result, with it.
    cached: HashMap<String, String>,
    /// The last journal record of each run the steps write records of: a run's records are
    /// written in order, without gaps (`tests/backend.rs`), so any of its records up to this
    /// one is there already.
    last_seqs: HashMap<String, u64>,
    /// The first records of steps an earlier try admitted, as the database holds them.
    tried_first: FirstRecords,
    /// Runs of the steps that another process holds now, with their holders.
    taken_over: HashMap<String, String>,
}

/// Journal records as the database holds them, by run and sequence number.
#[derive(Default)]
struct FirstRecords(HashMap<(String, u64), String>);

impl FirstRecords {
    /// Whether `first` is there as it was written: the try that wrote it committed.
    fn wrote(&self, first: &Event) -> bool {
        let there = self.0.get(&(first.run_id.clone(), first.seq));
        there.is_some_and(|body| serde_json::to_string(first).is_ok_and(|ours| *body == ours))
    }
}

/// What a group's admitted steps write, gathered step by step on the state they meet.
struct GroupWrites<'s> {
    /// The database's state with the admitted steps applied.
    state: State,
    /// The last version given to a step (the database's before the first).
    version: i64,
    admitted: Vec<(i64, &'s StepCommit)>,
    /// Each document's last write in the group and that step's version: one row each (a
    /// statement may not update a row twice).
    docs: DocColumns,
    /// Namespaces in which a key appeared or disappeared, with the last such version.
    key_sets: (Vec<String>, Vec<i64>),
    /// Cached results: keys, run ids, outputs.
    results: (Vec<String>, Vec<String>, Vec<String>),
}

#[derive(Default)]
struct DocColumns {
    /// Where each document's row is.
    rows: HashMap<(String, String), usize>,
    ns: Vec<String>,
    keys: Vec<String>,
    /// None: deleted (the row stays, so other processes see the delete).
    bodies: Vec<Option<String>>,
    versions: Vec<i64>,
}

impl<'s> GroupWrites<'s> {
    fn new(state: State, version: i64) -> GroupWrites<'s> {
        GroupWrites {
            state,
            version,
            admitted: Vec::new(),
            docs: DocColumns::default(),
            key_sets: (Vec::new(), Vec::new()),
            results: (Vec::new(), Vec::new(), Vec::new()),
        }
    }

    /// Refuses `step` (writing nothing of it) or admits it as the next version.
    fn admit(
        &mut self,
        step: &'s StepCommit,
        tried: &mut Option<Vec<Change>>,
        found: &Found,
    ) -> Result<Vec<Change>, CommitError> {
        // An earlier try whose COMMIT got no answer wrote it: its first record is there, as it wrote it.
        if let (Some(previous), Some(first)) = (tried.as_ref(), step.events.first())
            && found.tried_first.wrote(first)
        {
            return Ok(previous.clone());
        }
        // Before the cache: a run another process took over learns it at once.
        refuse_taken_over(&step.events, &found.taken_over)?;
        if let Some(event) =
            step.events.iter().find(|e| found.last_seqs.get(&e.run_id).is_some_and(|&last| e.seq <= last))
        {
            return Err(CommitError::Backend(duplicate_event(event)));
        }
        if let Some((key, _)) = &step.result {
            let earlier = self.results.0.iter().position(|k| k == key).map(|i| &self.results.2[i]);
            if let Some(output) = found.cached.get(key).or(earlier) {
                let output = serde_json::from_str(output)
                    .map_err(|e| CommitError::Backend(format!("cached result {key}: {e}")))?;
                return Err(CommitError::AlreadyCommitted(output));
            }
        }
        step.txn.validate(&self.state)?;
        self.version += 1;
        let changes = step.txn.changes(&self.state);
        for (ns, key, text) in step.txn.writes() {
            if self.state.get(ns, key).is_some() != text.is_some() {
                match self.key_sets.0.iter().position(|n| n == ns) {
                    Some(i) => self.key_sets.1[i] = self.version,
                    None => {
                        self.key_sets.0.push(ns.to_string());
                        self.key_sets.1.push(self.version);
                    }
                }
            }
            self.docs.put(ns, key, text.map(|t| t.to_string()), self.version);
        }
        self.state.apply(self.version as u64, step.txn.writes());
        if let Some((key, output)) = &step.result {
            let run_id = step.events.first().map_or("", |e| e.run_id.as_str());
            self.results.0.push(key.clone());
            self.results.1.push(run_id.to_string());
            self.results.2.push(output.clone());
        }
        self.admitted.push((self.version, step));
        *tried = Some(changes.clone());
        Ok(changes)
    }

    /// The admitted steps' held-back records and their own, in order.
    fn records(&self) -> (Vec<&'s Event>, Vec<&'s Event>) {
        let held_back = self.admitted.iter().flat_map(|(_, s)| &s.pending).collect();
        let own = self.admitted.iter().flat_map(|(_, s)| &s.events).collect();
        (held_back, own)
    }
}

impl DocColumns {
    /// Records a write of `ns`/`key`, replacing an earlier one of the group.
    fn put(&mut self, ns: &str, key: &str, body: Option<String>, version: i64) {
        match self.rows.get(&(ns.to_string(), key.to_string())) {
            Some(&i) => (self.bodies[i], self.versions[i]) = (body, version),
            None => {
                self.rows.insert((ns.to_string(), key.to_string()), self.ns.len());
                self.ns.push(ns.to_string());
                self.keys.push(key.to_string());
                self.bodies.push(body);
                self.versions.push(version);
            }
        }
    }
}

/// The statements [`PostgresBackend::write_events`] sends, prepared (once per connection)
/// before the round trip that sends them, so that none of them waits for a reply there.
struct JournalStatements {
    /// Records held back earlier: one that is already there is left as it is (and not
    /// returned with those inserted).
    held_back: tokio_postgres::Statement,
    /// A commit's own records: one that is already there fails the transaction.
    own: tokio_postgres::Statement,
    /// Runs whose records end them: their status and end time.
    finish: tokio_postgres::Statement,
}

impl JournalStatements {
    async fn prepare(tx: &impl GenericClient) -> Result<JournalStatements, Failure> {
        macro_rules! insert {
            ($($tail:literal)?) => {
                concat!("INSERT INTO events (run_id, seq, body) SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[])" $(, $tail)?)
            };
        }
        let (held_back, own, finish) = futures::try_join!(
            tx.prepare_cached(insert!(" ON CONFLICT DO NOTHING RETURNING run_id, seq")),
            tx.prepare_cached(insert!()),
            tx.prepare_cached(
                "UPDATE runs SET status = f.status, finished_ms = $3
                 FROM unnest($1::text[], $2::text[]) AS f(run_id, status) WHERE runs.run_id = f.run_id",
            ),
        )?;
        Ok(JournalStatements { held_back, own, finish })
    }
}

/// Journal records as the columns of one `unnest` insert.
struct Records<'a> {
    runs: Vec<&'a str>,
    seqs: Vec<i64>,
    bodies: Vec<String>,
}

impl<'a> Records<'a> {
    fn of(events: impl IntoIterator<Item = &'a Event>) -> Result<Records<'a>, Failure> {
        let mut records = Records { runs: Vec::new(), seqs: Vec::new(), bodies: Vec::new() };
        for event in events {
            records.runs.push(&event.run_id);
            records.seqs.push(event.seq as i64);
            records.bodies.push(serde_json::to_string(event).map_err(|e| CommitError::Backend(e.to_string()))?);
        }
        Ok(records)
    }

    fn params(&self) -> [&(dyn ToSql + Sync); 3] {
        [&self.runs, &self.seqs, &self.bodies]
    }
}

/// What a failed journal write means: a record of `own` already there is named as such.
fn journal_failure(e: tokio_postgres::Error, own: &[&Event]) -> Failure {
    if e.code() == Some(&SqlState::UNIQUE_VIOLATION) {
        // The server names the key: "Key (run_id, seq)=(r, 2) already exists."
        let detail = e.as_db_error().and_then(|d| d.detail()).unwrap_or_default();
        let there = own.iter().find(|ev| detail.contains(&format!("=({}, {})", ev.run_id, ev.seq)));
        if let Some(event) = there.or(own.first()).copied() {
            return Failure::Fatal(CommitError::Backend(duplicate_event(event)));
        }
    }
    e.into()
}

/// What [`PostgresBackend::read_if_behind`] read: the documents written since the state's
/// version, and the version they bring it to; `None` when it is not behind.
type Behind = Option<(Vec<DocRow>, u64)>;

/// What a call about to run found ([`Backend::cached_or_snapshot`]).
enum Looked {
    Cached(Value),
    Behind(Behind),
}

/// A transaction whose `BEGIN` goes out in the same round trip as its first statements
/// ([`Self::begin`] polled first in their join), one round trip less than
/// `Client::transaction`, which waits for the `BEGIN`'s reply before anything else is sent.
/// Dropped before [`Self::committed`], it queues a `ROLLBACK` on the connection, as
/// `tokio_postgres::Transaction` does, so the connection goes back to the pool with no
/// transaction open, whether or not a `COMMIT` went out before the failure.
struct Pipelined<'a> {
    client: &'a tokio_postgres::Client,
    open: bool,
}

impl<'a> Pipelined<'a> {
    fn on(client: &'a tokio_postgres::Client) -> Pipelined<'a> {
        Pipelined { client, open: true }
    }

    /// The `BEGIN`: sent when first polled, like every request of the client.
    async fn begin(&self) -> Result<(), tokio_postgres::Error> {
        self.client.batch_execute("BEGIN").await
    }

    /// Ends the transaction whose `COMMIT` (sent with its writes) succeeded: no `ROLLBACK`
    /// follows it, which the server would log as a warning.
    fn committed(mut self) {
        self.open = false;
    }
}

impl std::ops::Deref for Pipelined<'_> {
    type Target = tokio_postgres::Client;

    fn deref(&self) -> &tokio_postgres::Client {
        self.client
    }
}

impl Drop for Pipelined<'_> {
    fn drop(&mut self) {
        if self.open {
            // A request is sent when its future is first polled; the reply is not awaited.
            let _ = futures::FutureExt::now_or_never(self.client.batch_execute("ROLLBACK"));
        }
    }
}

/// The holders of the runs `$1` names, locked (`FOR SHARE`) until the transaction ends: a
/// take-over (`claim_runs`, `adopt_run`) waits for it, or skips the run, and one that
/// committed first is read here. So a transaction that checks them never writes into a run
/// another process took over (a fence).
const HOLDERS: &str = "SELECT run_id, owner FROM runs WHERE run_id = ANY($1) FOR SHARE";

/// The runs whose events are written, for [`HOLDERS`].
fn runs_of<'a>(events: impl Iterator<Item = &'a Event>) -> Vec<String> {
    let mut run_ids: Vec<String> = events.map(|e| e.run_id.clone()).collect();
    run_ids.sort_unstable();
    run_ids.dedup();
    run_ids
}

/// The runs [`HOLDERS`] returned that another process holds, with their holders.
fn held_elsewhere(holders: &[tokio_postgres::Row]) -> HashMap<String, String> {
    holders.iter().map(|r| (r.get(0), r.get(1))).filter(|(_, owner): &(String, String)| !holds(owner)).collect()
}

/// Refuses `events` when their run is one of `taken_over`.
fn refuse_taken_over(events: &[Event], taken_over: &HashMap<String, String>) -> Result<(), CommitError> {
    match events.iter().find_map(|e| taken_over.get_key_value(&e.run_id)) {
        Some((run_id, owner)) => Err(CommitError::TakenOver { run_id: run_id.clone(), owner: owner.clone() }),
        None => Ok(()),
    }
}

fn run_from_row(r: &tokio_postgres::Row) -> RunRecord {
    RunRecord {
        run_id: r.get(0),
        saga: r.get(1),
        saga_path: r.get(2),
        definition: r.get(3),
        input: serde_json::from_str(r.get::<_, &str>(4)).unwrap_or(Value::Null),
        seed: r.get::<_, i64>(5) as u64,
        status: r.get(6),
        pid: r.get::<_, i64>(7) as u32,
        owner: r.get(8),
        lease_until_ms: r.get::<_, Option<i64>>(9).map(|v| v as u64),
        started_ms: r.get::<_, i64>(10) as u64,
        finished_ms: r.get::<_, Option<i64>>(11).map(|v| v as u64),
    }
}

impl Backend for PostgresBackend {
    fn snapshot(&self) -> State {
        let since = read(&self.state).version();
        let caught_up = self.read(async |client, _| {
            // One round trip when nothing changed.
            let version = Self::version_in(&*client).await?;
            Self::read_if_behind(client, since, version).await
        });
        self.caught_up(caught_up)
    }

    fn cached_or_snapshot(&self, key: &str) -> BeforeCall {
        let since = read(&self.state).version();
        let found = self.read(async |client, _| {
            // One round trip for both when nothing changed since this process's state.
            let (cached, version) =
                futures::try_join!(Self::cached_in(&*client, key), async { Ok(Self::version_in(&*client).await?) })?;
            match cached {
                Some(output) => Ok(Looked::Cached(output)),
                None => Ok(Looked::Behind(Self::read_if_behind(client, since, version).await?)),
            }
        });
        match found {
            Ok(Looked::Cached(output)) => BeforeCall::Cached(output),
            Ok(Looked::Behind(rows)) => BeforeCall::Fresh(self.caught_up(Ok(rows))),
            Err(e) => {
                tracing::warn!("cannot read the result cache or catch up with the database: {e}");
                BeforeCall::Fresh(self.snapshot())
            }
        }
    }

    fn commit(&self, txn: &Txn, result: Option<(&str, &Value)>, events: &[Event]) -> Result<Vec<Change>, CommitError> {
        // Concurrent runs' commits share a transaction (group commit); each run's commits
        // come one at a time, from the engine, in journal order.
        let run_id = events.first().map(|e| e.run_id.as_str());
        self.carrying_pending(run_id, |pending| {
            let step = StepCommit {
                txn: txn.clone(),
                result: result.map(|(key, output)| (key.to_string(), output.to_string())),
                pending,
                events: events.to_vec(),
            };
            self.group.submit(step, |steps| self.write_group(steps)).unwrap_or_else(|_| {
                Err(CommitError::Backend("the commit sharing this step's transaction panicked".to_string()))
            })
        })
        .map_err(|e| self.named(e))
    }

    fn record(&self, events: &[Event]) -> Result<(), CommitError> {
        if !write_at_once(events) {
            lock(&self.pending).extend_from_slice(events);
            return Ok(());
        }
        let run_id = events.first().map(|e| e.run_id.as_str());
        self.carrying_pending(run_id, |pending| self.block_on(self.write_now(&pending, events)))
            .map_err(|e| self.named(e))
    }

    fn cached(&self, key: &str) -> Option<Value> {
        self.read(async |client, _| Self::cached_in(&*client, key).await).unwrap_or_else(|e| {
            tracing::warn!("cannot read the result cache: {e}");
            None
        })
    }

    fn blocks(&self) -> bool {
        true
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    fn current_state(&self) -> Result<State, DbError> {
        let (docs, keys, version) = self.read(async |client, _| Ok(Self::read_since(client, 0).await?))?;
        let live = docs.into_iter().filter_map(|(ns, key, body, v)| body.map(|b| (ns, key, b, v)));
        Ok(State::from_versioned(live, keys, version))
    }

    fn seed_if_new(&self, state: &State) -> Result<bool, DbError> {
        let seeded = self.read(async |client, _| {
            let tx = client.transaction().await?;
            let version: i64 =
                tx.query_one("SELECT value FROM meta WHERE name = 'version' FOR UPDATE", &[]).await?.get(0);
            let runs: i64 = tx.query_one("SELECT COUNT(*) FROM runs", &[]).await?.get(0);
            let docs: i64 = tx.query_one("SELECT COUNT(*) FROM docs", &[]).await?.get(0);
            if version != 0 || runs != 0 || docs != 0 {
                return Ok(false);
            }
            // Many documents a statement: one statement a document took 17 s for a 100 MB store.
            let put = tx
                .prepare("INSERT INTO docs (ns, key, body, version) SELECT *, 1 FROM unnest($1::text[], $2::text[], $3::text[])")
                .await?;
            let docs: Vec<(&str, &str, &str)> = state
                .namespaces()
                .flat_map(|(ns, namespace)| namespace.iter().map(move |(key, doc)| (ns.as_str(), key, &*doc.text)))
                .collect();
            for chunk in docs.chunks(SEED_ROWS) {
                let namespaces: Vec<&str> = chunk.iter().map(|d| d.0).collect();
                let keys: Vec<&str> = chunk.iter().map(|d| d.1).collect();
                let bodies: Vec<&str> = chunk.iter().map(|d| d.2).collect();
                tx.execute(&put, &[&namespaces, &keys, &bodies]).await?;
            }
            let names: Vec<&str> = state.namespaces().map(|(ns, _)| ns.as_str()).collect();
            tx.execute("INSERT INTO namespaces SELECT *, 1 FROM unnest($1::text[])", &[&names]).await?;
            tx.execute("UPDATE meta SET value = 1 WHERE name = 'version'", &[]).await?;
            tx.commit().await?;
            Ok(true)
        })?;
        if seeded {
            let state = self.current_state()?;
            *write(&self.state) = state;
        }
        Ok(seeded)
    }

    fn register_run(&self, run: &RunRecord) -> Result<(), RegisterError> {
        let inserted = self.read(async |client, _| {
            let sql = "INSERT INTO runs (run_id, saga, saga_path, definition, input, seed, status, pid, owner,
                                         lease_until_ms, started_ms)
                       VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT DO NOTHING";
            let input = run.input.to_string();
            let params: [&(dyn ToSql + Sync); 11] = [
                &run.run_id,
                &run.saga,
                &run.saga_path,
                &run.definition,
                &input,
                &(run.seed as i64),
                &run.status,
                &(run.pid as i64),
                &run.owner,
                &run.lease_until_ms.map(|t| t as i64),
                &(now_ms() as i64),
            ];
            Ok(client.execute(sql, &params).await?)
        })?;
        if inserted == 0 {
            return Err(RegisterError::Exists { run_id: run.run_id.clone(), db: self.name.clone() });
        }
        Ok(())
    }

    fn adopt_run(&self, run_id: &str, seen: &RunRecord, lease_until_ms: u64) -> Result<bool, DbError> {
        let changed = self.read(async |client, _| {
            let sql = "UPDATE runs SET pid = $1, owner = $2, lease_until_ms = $3
                       WHERE run_id = $4 AND owner = $5 AND pid = $6 AND status = 'running'";
            let params: [&(dyn ToSql + Sync); 6] = [
                &(std::process::id() as i64),
                &this_process(),
                &(lease_until_ms as i64),
                &run_id,
                &seen.owner,
                &(seen.pid as i64),
            ];
            Ok(client.execute(sql, &params).await?)
        })?;
        Ok(changed == 1)
    }

    fn claim_runs(
        &self,
        now_ms: u64,
        lease_until_ms: u64,
        limit: usize,
        held: &[String],
    ) -> Result<Vec<RunRecord>, DbError> {
        // A retry after a lost answer takes back what the lost try took ("lost" in the claim).
        self.read(async |client, _| {
            let params: [&(dyn ToSql + Sync); 6] = [
                &(std::process::id() as i64),
                &this_process(),
                &(lease_until_ms as i64),
                &(now_ms as i64),
                &(limit as i64),
                &held,
            ];
            let claim = client.prepare_cached(&CLAIM).await?;
            let mut runs: Vec<RunRecord> = client.query(&claim, &params).await?.iter().map(run_from_row).collect();
            runs.sort_by(|a, b| (a.started_ms, &a.run_id).cmp(&(b.started_ms, &b.run_id)));
            Ok(runs)
        })
    }

    fn renew_leases(&self, lease_until_ms: u64) -> Result<u64, DbError> {
        let renew = async |client: &mut deadpool_postgres::Client, _| {
            let sql = "UPDATE runs SET lease_until_ms = $1 WHERE owner = $2 AND status = 'running'";
            Ok(client.execute(sql, &[&(lease_until_ms as i64), &this_process()]).await?)
        };
        self.block_on(self.with_retry_on(&self.leases, renew)).map_err(|e| self.db_error(e))
    }

    fn runs(&self) -> Result<Vec<RunRecord>, DbError> {
        self.select_runs("TRUE")
    }

    fn unfinished_runs(&self) -> Result<Vec<RunRecord>, DbError> {
        self.select_runs(UNFINISHED)
    }

    fn events(&self, run_id: &str) -> Result<Vec<Event>, DbError> {
        let bodies: Vec<String> = self.read(async |client, _| {
            let rows = client.query("SELECT body FROM events WHERE run_id = $1 ORDER BY seq", &[&run_id]).await?;
            Ok(rows.iter().map(|r| r.get(0)).collect())
        })?;
        bodies
            .iter()
            .map(|body| {
                serde_json::from_str(body).map_err(|e| self.error(format!("a journal record of {run_id}: {e}")))
            })
            .collect()
    }

    fn journal_bytes(&self, run_id: &str) -> Result<u64, DbError> {
        self.read(async |client, _| {
            let sql = "SELECT COALESCE(SUM(OCTET_LENGTH(body)), 0)::BIGINT FROM events WHERE run_id = $1";
            Ok(client.query_one(sql, &[&run_id]).await?.get::<_, i64>(0) as u64)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{assert_every_commit_there, commit_at_once, counting, event};
    use super::*;
    use crate::saga::journal::EventKind;
    use crate::store::WriteQuota;
    use crate::test_postgres as server;

    /// The shared buffers PostgreSQL reads to claim one run from a queue of `queued` runs, and
    /// which run it claims.
    fn claim_buffers(queued: usize) -> (u64, String) {
        let schema = server::Schema::new("claim");
        let backend = PostgresBackend::open(&schema.url).unwrap();
        server::execute(&format!(
            "INSERT INTO {0}.runs (run_id, saga, saga_path, definition, input, seed, status, pid, started_ms)
             SELECT 'q' || lpad(n::text, 6, '0'), 's', 's.json', repeat('{{}}', 200), '{{}}', 0, 'queued', 0, 1000 + n
             FROM generate_series(0, {1}) AS n",
            schema.name,
            queued - 1
        ));
        let explain = format!("EXPLAIN (ANALYZE, BUFFERS) {}", *CLAIM);
        let (plan, claimed) = backend
            .read(async |client, _| {
                let now = now_ms() as i64;
                let held: &[String] = &[];
                let params: [&(dyn ToSql + Sync); 6] = [&1i64, &this_process(), &(now + 1000), &now, &1i64, &held];
                let plan: Vec<String> = client.query(&explain, &params).await?.iter().map(|r| r.get(0)).collect();
                let claimed: String =
                    client.query_one("SELECT run_id FROM runs WHERE status = 'running'", &[]).await?.get(0);
                Ok((plan, claimed))
            })
            .unwrap();
        (buffers_read(&plan), claimed)
    }

    /// The shared buffers a statement read, from its `EXPLAIN (ANALYZE, BUFFERS)` plan.
    fn buffers_read(plan: &[String]) -> u64 {
        // The statement's nodes (not its planning): the top one counts its children's.
        let executing = plan.iter().take_while(|line| !line.trim_start().starts_with("Planning"));
        let read = |counts: &str| -> u64 {
            let count = |c: &str| {
                let c = c.trim_end_matches(',');
                c.strip_prefix("hit=").or(c.strip_prefix("read="))?.parse::<u64>().ok()
            };
            counts.split_whitespace().filter_map(count).sum()
        };
        executing.filter_map(|line| line.split("Buffers: shared").nth(1)).map(read).max().unwrap_or(0)
    }

    #[test]
    fn catching_up_reads_the_new_documents_not_the_whole_table_before_it_is_analyzed() {
        let schema = server::Schema::new("since");
        let backend = PostgresBackend::open(&schema.url).unwrap();
        // 20,000 documents, and no statistics: autovacuum has not analyzed the table (and may not).
        server::execute(&format!(
            "ALTER TABLE {0}.docs SET (autovacuum_enabled = false);
             INSERT INTO {0}.docs SELECT 'ns', 'k' || n, '{{}}', n FROM generate_series(1, 20000) AS n",
            schema.name
        ));
        let plan = backend
            .read(async |client, _| {
                let explain = format!("EXPLAIN (ANALYZE, BUFFERS) {DOCS_SINCE}");
                let rows = client.query(&explain, &[&20_000i64]).await?;
                Ok(rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>())
            })
            .unwrap();
        let scans_the_table = plan.iter().any(|line| line.contains("Seq Scan") || line.contains("Gather"));
        assert!(!scans_the_table && buffers_read(&plan) <= 10, "{}", plan.join("\n"));
    }

    #[test]
    fn a_claim_reads_as_much_of_a_long_queue_as_of_a_short_one() {
        let (short, first) = claim_buffers(10);
        let (long, first_of_many) = claim_buffers(20_000);
        assert_eq!((first.as_str(), first_of_many.as_str()), ("q000000", "q000000"), "not the oldest run");
        // Scanning the whole table read all of its pages (1,367 buffers here).
        assert!(long <= 2 * short + 10, "a claim read {long} buffers from 20,000 queued runs, {short} from 10");
    }

    fn run_record(run_id: &str) -> RunRecord {
        RunRecord::starting(run_id, "s", "s.json", "{}".into(), &serde_json::json!({}), 1)
    }

    fn step(db: &PostgresBackend, counter: &str, key: &str, result: Option<&str>, event: Event) -> StepCommit {
        StepCommit {
            txn: counting(db, counter, key),
            result: result.map(|k| (k.to_string(), serde_json::json!(key).to_string())),
            pending: Vec::new(),
            events: vec![event],
        }
    }

    fn seeded(tag: &str) -> (server::Schema, PostgresBackend) {
        let schema = server::Schema::new(tag);
        let db = PostgresBackend::open(&schema.url).unwrap();
        let seed = State::from_json(&serde_json::json!({ "pools": { "p": { "allocated": 0 } } })).unwrap();
        assert!(db.seed_if_new(&seed).unwrap());
        (schema, db)
    }

    #[test]
    fn a_group_writes_each_step_on_its_own_and_refuses_only_the_bad_ones() {
        let (schema, db) = seeded("group");
        db.commit(&Txn::new(db.snapshot(), WriteQuota::default()), Some(("cached", &serde_json::json!("first"))), &[])
            .unwrap();
        for run in ["r", "s", "t", "u", "v", "w", "x"] {
            db.register_run(&run_record(run)).unwrap();
        }
        db.record(&[event("r", 0, EventKind::SagaStarted)]).unwrap();
        server::execute(&format!("UPDATE {}.runs SET owner = 'elsewhere/1/a' WHERE run_id = 'x'", schema.name));
        let mut both = step(&db, "q", "shared", None, event("w", 0, EventKind::StepCompleted));
        both.txn.put("marks", "a", "{\"again\":true}").unwrap();
        let steps = vec![
            step(&db, "p", "a", Some("ka"), event("r", 1, EventKind::StepCompleted)),
            // Read the counter before `a` wrote it, in the same transaction: a conflict.
            step(&db, "p", "stale", None, event("s", 0, EventKind::StepCompleted)),
            // Another delivery of a call that committed before, and of one earlier in the group.
            step(&db, "q", "again", Some("cached"), event("t", 0, EventKind::StepCompleted)),
            step(&db, "q", "twice", Some("ka"), event("t", 0, EventKind::StepCompleted)),
            // A journal record that is already there.
            step(&db, "q", "dup", None, event("r", 0, EventKind::StepCompleted)),
            // A run another process took over.
            step(&db, "q", "fenced", None, event("x", 0, EventKind::StepCompleted)),
            // Held-back records go before the step's own.
            StepCommit {
                pending: vec![event("v", 0, EventKind::StepStarted)],
                ..step(&db, "v", "b", None, event("v", 1, EventKind::StepCompleted))
            },
            // The same document as `a`, written again later in the group (one row each).
            both,
            StepCommit {
                events: vec![event("r", 2, EventKind::SagaFinished).data(serde_json::json!({ "status": "failed" }))],
                ..step(&db, "u", "c", None, event("r", 2, EventKind::SagaFinished))
            },
        ];
        let outcomes = db.write_group(steps);
        assert_eq!(outcomes[0].as_ref().ok().map(Vec::len), Some(2));
        assert!(matches!(&outcomes[1], Err(CommitError::Conflict(c)) if c.key == "p"), "{:?}", outcomes[1]);
        assert!(matches!(&outcomes[2], Err(CommitError::AlreadyCommitted(v)) if v == "first"));
        assert!(matches!(&outcomes[3], Err(CommitError::AlreadyCommitted(v)) if v == "a"), "{:?}", outcomes[3]);
        assert!(matches!(&outcomes[4], Err(CommitError::Backend(m)) if m.contains("seq 0")), "{:?}", outcomes[4]);
        assert!(matches!(&outcomes[5], Err(CommitError::TakenOver { run_id, .. }) if run_id == "x"));
        assert!(outcomes[6..].iter().all(Result::is_ok), "{:?}", &outcomes[6..]);
        assert_eq!(db.transactions(), 1);

        // What the refused steps would have written is not there; the others are, for a new
        // handle as for this one.
        let again = PostgresBackend::open(&schema.url).unwrap();
        let state = again.current_state().unwrap();
        assert_eq!(state.digest(), db.snapshot().digest());
        let marks: Vec<String> = state.namespace("marks").unwrap().iter().map(|(k, _)| k.to_string()).collect();
        assert_eq!(marks, ["a", "b", "c", "shared"]);
        assert_eq!(&*state.get("marks", "a").unwrap().text, "{\"again\":true}");
        assert_eq!(again.cached("ka"), Some(serde_json::json!("a")));
        let kinds = |run: &str| again.events(run).unwrap().into_iter().map(|e| (e.seq, e.event)).collect::<Vec<_>>();
        use EventKind::*;
        assert_eq!(kinds("r"), [(0, SagaStarted), (1, StepCompleted), (2, SagaFinished)]);
        assert_eq!(kinds("v"), [(0, StepStarted), (1, StepCompleted)]);
        assert!(kinds("s").is_empty() && kinds("t").is_empty() && kinds("x").is_empty());
        let status = |run: &str| again.runs().unwrap().into_iter().find(|r| r.run_id == run).unwrap().status;
        assert_eq!((status("r"), status("v")), ("failed".to_string(), "running".to_string()));
    }

    #[test]
    fn a_group_tried_again_after_its_commit_went_through_writes_nothing_twice() {
        let (schema, db) = seeded("retried");
        let steps = vec![
            step(&db, "p", "a", Some("ka"), event("r", 0, EventKind::StepCompleted)),
            step(&db, "p", "stale", None, event("s", 0, EventKind::StepCompleted)),
        ];
        let mut tried = vec![None; steps.len()];
        let mut try_once =
            || db.block_on(db.with_retry(async |client, _| db.try_group(client, &steps, &mut tried).await));
        let first = try_once().unwrap();
        // As when the first try's COMMIT got no answer: the same group is tried again.
        let again = try_once().unwrap();
        assert_eq!(again[0].as_ref().ok(), first[0].as_ref().ok(), "{again:?}");
        assert!(matches!(&again[1], Err(CommitError::Conflict(_))), "{again:?}");
        let state = PostgresBackend::open(&schema.url).unwrap().current_state().unwrap();
        assert_eq!(&*state.get("pools", "p").unwrap().text, r#"{"allocated":1}"#, "the step was applied twice");
        assert_eq!(db.events("r").unwrap().len(), 1);
    }

    #[test]
    fn concurrent_commits_share_transactions_and_every_acknowledged_one_is_durable() {
        let (schema, db) = seeded("grouped");
        let db = std::sync::Arc::new(db);
        let total = commit_at_once(db.clone(), 8, 40);
        let transactions = db.transactions();
        assert_every_commit_there(&PostgresBackend::open(&schema.url).unwrap(), 8, 40);
        assert!(transactions < total, "{transactions} transactions for {total} commits: none were grouped");
    }

    #[test]
    fn a_pipelined_transaction_dropped_before_its_commit_leaves_its_connection_outside_it() {
        let schema = server::Schema::new("pipelined");
        let backend = PostgresBackend::open(&schema.url).unwrap();
        backend
            .read(async |client, _| {
                {
                    let tx = Pipelined::on(client);
                    futures::try_join!(tx.begin(), tx.batch_execute("INSERT INTO meta VALUES ('inside', 1)"))?;
                }
                // On the same connection, after the drop: committed at once if no transaction is open.
                client.batch_execute("INSERT INTO meta VALUES ('after', 1)").await?;
                Ok(())
            })
            .unwrap();
        let names = PostgresBackend::open(&schema.url)
            .unwrap()
            .read(async |client, _| {
                let rows = client.query("SELECT name FROM meta WHERE name IN ('inside', 'after')", &[]).await?;
                Ok(rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>())
            })
            .unwrap();
        assert_eq!(names, ["after"], "the dropped transaction committed, or stayed open on its connection");
    }

    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(redact("postgres://u:secret@h:5432/db"), "postgres://u:***@h:5432/db");
        assert_eq!(redact("postgresql://u:p@ss@h/db?x=1"), "postgresql://u:***@h/db?x=1");
        assert_eq!(redact("postgres://u@h/db?password=secret&x=1"), "postgres://u@h/db?password=***&x=1");
        assert_eq!(redact("postgres://h/db"), "postgres://h/db");
    }
}
