//! `sagabox bench --only durable`: durable CT1 runs and step commits on SQLite and, given a
//! server (`--pg-url` or SAGABOX_PG_URL), on PostgreSQL, with 1, 2 and 4 worker processes
//! draining one queue.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sagabox::backend::{self, Backend, Durability, RunRecord};
use sagabox::runtime::Runtime;
use sagabox::saga::journal::{Event, EventKind};
use sagabox::saga::{self, RunOptions, Saga};
use sagabox::store::{State, Txn, WriteQuota};
use sagabox::sync::lock;
use serde_json::{Value, json};

use super::bench::{Measurement, roomy, shipped_saga};

/// What the durable group measured.
#[derive(Default)]
pub struct Durable {
    pub latencies: Vec<Measurement>,
    pub rates: Vec<(String, f64)>,
}

/// A database of each kind, fresh: SQLite in a temporary directory, PostgreSQL in a schema
/// of its own (removed when dropped, or by [`remove_leftovers`] if the benchmark is
/// interrupted).
struct Fresh {
    place: Place,
    durability: Durability,
}

/// Where a fresh database is.
#[derive(Clone, PartialEq)]
enum Place {
    Dir(std::path::PathBuf),
    Schema { server: String, schema: String },
}

/// The places of the fresh databases not yet removed.
static LEFTOVERS: Mutex<Vec<Place>> = Mutex::new(Vec::new());

/// The worker processes started and not yet seen to end: an interrupted benchmark kills them
/// before it removes their databases, so that none outlives it (a signal sent to the
/// benchmark alone, not to its process group, does not reach them).
static WORKERS: Mutex<Vec<Child>> = Mutex::new(Vec::new());

/// Set once [`remove_leftovers`] has begun: the process is about to exit.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

impl Fresh {
    /// Makes a database at `place` with `make` and remembers it until dropped, both under
    /// the leftovers' lock. Made first and remembered after, a schema that an interrupt
    /// came between was left behind (CI saw it once).
    fn made(place: Place, durability: Durability, make: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<Fresh> {
        let mut leftovers = lock_unless_interrupted(&LEFTOVERS);
        make()?;
        leftovers.push(place.clone());
        Ok(Fresh { place, durability })
    }

    fn label(&self) -> String {
        match self.place {
            Place::Dir(_) => format!("SQLite synchronous={:?}", self.durability),
            Place::Schema { .. } => format!("PostgreSQL {}", synchronous_commit(self.durability)),
        }
    }

    fn url(&self) -> String {
        match &self.place {
            Place::Dir(dir) => dir.join("bench.db").display().to_string(),
            Place::Schema { server, schema } => {
                let separator = if server.contains('?') { '&' } else { '?' };
                format!("{server}{separator}options=-csearch_path%3D{schema}")
            }
        }
    }

    fn open(&self) -> anyhow::Result<Arc<dyn Backend>> {
        Ok(backend::open(&self.url(), self.durability, true)?)
    }
}

impl Drop for Fresh {
    fn drop(&mut self) {
        // Removed while still listed, under the lock: forgotten first, a database that an
        // interrupt came between stayed.
        let mut leftovers = lock(&LEFTOVERS);
        self.place.remove();
        leftovers.retain(|place| *place != self.place);
    }
}

impl Place {
    fn remove(&self) {
        let removed = match self {
            Place::Dir(dir) => std::fs::remove_dir_all(dir).map_err(anyhow::Error::from),
            Place::Schema { server, schema } => pg_execute(server, &format!("DROP SCHEMA IF EXISTS {schema} CASCADE")),
        };
        if let Err(e) = removed {
            eprintln!("warning: cannot remove the benchmark's database: {e}");
        }
    }
}

/// Kills the worker processes still running and removes every fresh database still there:
/// an interrupted benchmark (Ctrl-C, SIGTERM) exits without unwinding, so their `Drop`s
/// never run.
pub fn remove_leftovers() {
    // Before taking the workers: no worker starts after that (see `start_worker`).
    INTERRUPTED.store(true, Ordering::SeqCst);
    stop_workers();
    // Under the lock throughout: a database being made or removed meanwhile is done first.
    for place in lock(&LEFTOVERS).drain(..) {
        place.remove();
    }
}

fn fresh_sqlite(durability: Durability) -> anyhow::Result<Fresh> {
    let dir = std::env::temp_dir().join(format!("sagabox-bench-{}", sagabox::ids::new_run_id()));
    Fresh::made(Place::Dir(dir.clone()), durability, || Ok(std::fs::create_dir_all(&dir)?))
}

fn fresh_postgres(server: &str, tag: &str, durability: Durability) -> anyhow::Result<Fresh> {
    let schema = format!("sagabox_bench_{tag}_{}", std::process::id());
    let sql = format!("DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}");
    Fresh::made(Place::Schema { server: server.to_string(), schema }, durability, || pg_execute(server, &sql))
}

/// What `--durability` sets on PostgreSQL.
fn synchronous_commit(durability: Durability) -> &'static str {
    match durability {
        Durability::Normal => "synchronous_commit=off",
        Durability::Full => "synchronous_commit=on",
    }
}

/// Runs `sql` on the server, on a thread of its own (the caller may be inside a runtime).
fn pg_execute(server: &str, sql: &str) -> anyhow::Result<()> {
    let (server, sql) = (server.to_string(), sql.to_string());
    std::thread::spawn(move || -> anyhow::Result<()> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        runtime.block_on(async {
            let (client, connection) = tokio_postgres::connect(&server, tokio_postgres::NoTls)
                .await
                .map_err(|e| anyhow::anyhow!("{}: {e}", backend::postgres::redact(&server)))?;
            tokio::spawn(connection);
            client.batch_execute(&sql).await?;
            Ok(())
        })
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the PostgreSQL thread panicked"))?
}

/// Every measurement of the group; PostgreSQL's only with `pg_url`.
pub async fn run(
    runtime: &Arc<Runtime>,
    sagas_dir: &Path,
    sagas: usize,
    pg_url: Option<&str>,
) -> anyhow::Result<Durable> {
    let mut out = Durable::default();
    let mut databases = vec![fresh_sqlite(Durability::Normal)?, fresh_sqlite(Durability::Full)?];
    if let Some(server) = pg_url {
        databases.push(fresh_postgres(server, "normal", Durability::Normal)?);
        databases.push(fresh_postgres(server, "full", Durability::Full)?);
    }
    for db in &databases {
        let backend = db.open()?;
        out.latencies.push(commit_latency(&*backend, &db.label(), 2000)?);
        let (rate, bytes) = sequential_ct1(runtime, &*backend, sagas_dir, sagas).await?;
        out.rates
            .push((format!("durable ct1 sagas/s, one at a time, {} (journal {bytes} bytes/saga)", db.label()), rate));
    }
    for durability in [Durability::Normal, Durability::Full] {
        let db = fresh_sqlite(durability)?;
        let run = concurrent_ct1(runtime, &db, sagas_dir, (sagas / 4).max(640), 64).await?;
        out.rates.push((
            format!(
                "durable ct1 sagas/s, 64 in flight, one process, {} ({:.1} journal records per transaction, {:.1} WAL pages per saga, writer busy {:.0} % of the time, {} checkpoints off the commits' path copying about {:.0} % of the WAL pages, at most {} pages copied on it and {} waits for the thread, journal {} bytes/saga)",
                db.label(),
                run.records_per_transaction,
                run.wal_pages,
                run.writer_busy * 100.0,
                run.checkpoints,
                run.checkpointed * 100.0,
                run.most_on_commit_path,
                run.waits_at_bound,
                run.journal_bytes
            ),
            run.rate,
        ));
    }
    match pg_url {
        Some(server) => {
            let mut queues: Vec<(usize, Fresh)> = Vec::new();
            for workers in [1, 2, 4] {
                queues.push((workers, fresh_postgres(server, &format!("workers{workers}"), Durability::Normal)?));
            }
            queues.push((4, fresh_postgres(server, "workers4full", Durability::Full)?));
            queues.push((2, fresh_sqlite(Durability::Normal)?));
            // A fifth of `sagas` runs per group: a few thousand keep four workers busy long
            // past their start-up, and PostgreSQL drains a few hundred runs a second.
            let runs = (sagas / 5).max(400);
            for (workers, db) in queues {
                eprintln!("draining {runs} queued CT1 runs with {workers} worker process(es), {}…", db.label());
                let rate = drain_with_workers(runtime, &db, sagas_dir, runs, workers)?;
                out.rates.push((
                    format!("durable ct1 sagas/s, {workers} worker process(es) × 16 in flight, {}", db.label()),
                    rate,
                ));
            }
        }
        None => eprintln!("note: no PostgreSQL rows: give --pg-url (or SAGABOX_PG_URL)"),
    }
    Ok(out)
}

/// Most CT1 runs any durable measurement has in flight at once (64 in one process; workers
/// × 16): each has a customer of its own.
const CUSTOMERS: usize = 64;

/// The shipped CT1 saga, its fixture, and one input per customer (see [`customers`]).
fn ct1(runtime: &Runtime, sagas_dir: &Path) -> anyhow::Result<(Saga, State, Vec<Value>)> {
    let (saga, state, input) = shipped_saga(runtime, sagas_dir, "ct1-payment-failure")?;
    let (fixture, inputs) = customers(&roomy(&state.to_json()), &input, CUSTOMERS)?;
    Ok((saga, State::from_json(&fixture).map_err(anyhow::Error::msg)?, inputs))
}

/// CT1's fixture with `count` customers, each with a user, a flight and a hotel of their
/// own (copies of the input's, keyed `<key>-<n>`), and the input of each. Runs in flight
/// that all booked one flight as one user would conflict on those documents at every
/// step, and a benchmark of durable runs would time their retries.
fn customers(fixture: &Value, input: &Value, count: usize) -> anyhow::Result<(Value, Vec<Value>)> {
    let mut fixture = fixture.clone();
    let mut inputs = Vec::with_capacity(count);
    for n in 0..count {
        let mut own = input.clone();
        for OwnDoc { ns, named_at } in OWN_DOCS {
            let key = pointer(input, named_at[0])?;
            let doc = fixture[ns].get(&key).cloned();
            let doc = doc.ok_or_else(|| anyhow::anyhow!("CT1's fixture has no {ns}/{key}"))?;
            let copy = format!("{key}-{n}");
            fixture[ns][&copy] = doc;
            for path in named_at {
                set(&mut own, path, &copy)?;
            }
        }
        inputs.push(own);
    }
    Ok((fixture, inputs))
}

/// A document each customer has a copy of: its namespace, and where CT1's input names it
/// (its key is read at the first place).
struct OwnDoc {
    ns: &'static str,
    named_at: &'static [&'static [&'static str]],
}

const OWN_DOCS: [OwnDoc; 3] = [
    OwnDoc { ns: "users", named_at: &[&["flight", "user_id"], &["payment", "user_id"]] },
    OwnDoc { ns: "flights", named_at: &[&["flight", "flight_number"]] },
    OwnDoc { ns: "hotels", named_at: &[&["hotel", "hotel_id"]] },
];

/// The string at `path` in CT1's input.
fn pointer(input: &Value, path: &[&str]) -> anyhow::Result<String> {
    let found = input.pointer(&format!("/{}", path.join("/"))).and_then(Value::as_str);
    found.map(str::to_string).ok_or_else(|| anyhow::anyhow!("CT1's input has no string at {}", path.join(".")))
}

/// Sets the value at `path` in CT1's input to the string `to`.
fn set(input: &mut Value, path: &[&str], to: &str) -> anyhow::Result<()> {
    let target = input.pointer_mut(&format!("/{}", path.join("/")));
    *target.ok_or_else(|| anyhow::anyhow!("CT1's input has nothing at {}", path.join(".")))? = Value::from(to);
    Ok(())
}

/// An error unless `journal` shows CT1 run `run_id` ending as CT1 does: its payment declined,
/// then its hotel and its flight cancelled. A run refused earlier would be a cheaper run
/// than the one the benchmark claims to time.
fn check_ct1(run_id: &str, journal: &[Event]) -> anyhow::Result<()> {
    let step_is = |e: &Event, kind: EventKind, step: &str| e.event == kind && e.step.as_deref() == Some(step);
    let declined = journal.iter().any(|e| step_is(e, EventKind::StepFailed, "payment"));
    let undone = |step: &str| journal.iter().any(|e| step_is(e, EventKind::CompensationCompleted, step));
    if declined && undone("hotel") && undone("flight") {
        return Ok(());
    }
    let failure = sagabox::saga::journal::first_failure(journal).unwrap_or_else(|| "no step failed".into());
    anyhow::bail!("durable ct1 run {run_id} did not roll back from its declined payment ({failure})")
}

/// One step's commit: read a counter, write it back one higher, with one journal record.
fn commit_latency(backend: &dyn Backend, label: &str, commits: usize) -> anyhow::Result<Measurement> {
    backend.seed_if_new(&State::from_json(&json!({ "pools": { "p": { "n": 0 } } })).map_err(anyhow::Error::msg)?)?;
    let run = RunRecord::starting("latency", "latency", "latency.json", "{}".into(), &json!({}), 0);
    backend.register_run(&run)?;
    let mut samples = Vec::with_capacity(commits);
    for seq in 0..commits {
        let started = Instant::now();
        let mut txn = Txn::new(backend.snapshot(), WriteQuota::default());
        let n = txn
            .get("pools", "p")
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .map_or(0, |v| v["n"].as_u64().unwrap_or(0));
        txn.put("pools", "p", &json!({ "n": n + 1 }).to_string())?;
        let mut event = sagabox::saga::journal::Event::new(sagabox::saga::journal::EventKind::StepCompleted);
        event.run_id = "latency".into();
        event.seq = seq as u64;
        let key = format!("latency-{seq}");
        backend.commit(&txn, Some((&key, &json!({ "n": n + 1 }))), &[event])?;
        samples.push(started.elapsed());
    }
    Ok(Measurement::from_samples(
        format!("step commit (snapshot, read-modify-write, cached result, journal record), {label}"),
        samples,
    ))
}

/// CT1 sagas run one after another on `backend`; returns sagas/s and journal bytes per saga.
async fn sequential_ct1(
    runtime: &Runtime,
    backend: &dyn Backend,
    sagas_dir: &Path,
    sagas: usize,
) -> anyhow::Result<(f64, u64)> {
    let (saga, state, inputs) = ct1(runtime, sagas_dir)?;
    let input = &inputs[0];
    // The latency loop seeded a counter; CT1's documents are added beside it.
    let mut txn = Txn::new(backend.snapshot(), WriteQuota::default());
    for (ns, namespace) in state.namespaces() {
        for (key, doc) in namespace.iter() {
            txn.put(ns, key, &doc.text)?;
        }
    }
    backend.commit(&txn, None, &[])?;
    let sagas = (sagas / 10).max(100);
    let started = Instant::now();
    for i in 0..sagas {
        let run_id = format!("d{i}");
        backend.register_run(&RunRecord::starting(&run_id, &saga.name, "ct1.json", String::new(), input, 0))?;
        let report = saga::run(runtime, &saga, backend, RunOptions::new(run_id, input.clone())).await;
        check_ct1(&report.run_id, &report.events)?;
    }
    Ok((sagas as f64 / started.elapsed().as_secs_f64(), backend.journal_bytes("d0")?))
}

/// What [`concurrent_ct1`] measured.
struct Concurrent {
    rate: f64,
    records_per_transaction: f64,
    /// Pages appended to the WAL per saga: what its commits cost in writes.
    wal_pages: f64,
    /// The share of the wall time the group's writer spent writing.
    writer_busy: f64,
    checkpoints: u64,
    /// The share of the WAL pages appended that those checkpoints copied (the writer copied
    /// the rest itself, its runs' commits waiting).
    checkpointed: f64,
    /// The most pages one of the writer's own checkpoints copied.
    most_on_commit_path: u64,
    /// Times a commit waited for the thread's checkpoint at the WAL's bound.
    waits_at_bound: u64,
    /// Per saga: what says whether whole runs were timed.
    journal_bytes: u64,
}

/// CT1 sagas, `in_flight` at a time, in one process on the SQLite database `db`: concurrent
/// runs' steps share transactions (group commit).
async fn concurrent_ct1(
    runtime: &Arc<Runtime>,
    db: &Fresh,
    sagas_dir: &Path,
    sagas: usize,
    in_flight: usize,
) -> anyhow::Result<Concurrent> {
    let (saga, state, inputs) = ct1(runtime, sagas_dir)?;
    let backend = Arc::new(backend::SqliteBackend::open(Path::new(&db.url()), db.durability)?);
    backend.seed_if_new(&state)?;
    let saga = Arc::new(saga);
    let per_task = sagas.div_ceil(in_flight);
    let pages_before = backend.wal_pages_written();
    let checkpointed_before = backend.wal_pages_checkpointed();
    let started = Instant::now();
    // A set: when one run fails, the others are stopped and waited for, so that the runtime
    // never shuts down under a run still going.
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..in_flight {
        let input = inputs[t % inputs.len()].clone();
        let (runtime, saga, backend) = (runtime.clone(), saga.clone(), backend.clone());
        tasks.spawn(async move {
            for _ in 0..per_task {
                // Ids as a server's sessions get them: where runs sit in the database's
                // indexes decides how many pages each transaction writes.
                let run_id = sagabox::ids::new_run_id();
                let record = RunRecord::starting(&run_id, &saga.name, "ct1.json", String::new(), &input, 0);
                backend::blocking(&*backend, || backend.register_run(&record))?;
                let report = saga::run(&runtime, &saga, &*backend, RunOptions::new(run_id, input.clone())).await;
                check_ct1(&report.run_id, &report.events)?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(task) = tasks.join_next().await {
        if let Err(e) = task.map_err(anyhow::Error::from).and_then(|run| run) {
            tasks.shutdown().await;
            return Err(e);
        }
    }
    let elapsed = started.elapsed();
    let writer_busy = backend.writing_time().as_secs_f64() / elapsed.as_secs_f64();
    let rate = (per_task * in_flight) as f64 / elapsed.as_secs_f64();
    let runs = backend.runs()?;
    let (mut records, mut bytes) = (0, 0);
    for run in &runs {
        records += backend.events(&run.run_id)?.len();
        bytes += backend.journal_bytes(&run.run_id)?;
    }
    Ok(Concurrent {
        rate,
        records_per_transaction: records as f64 / backend.transactions().max(1) as f64,
        wal_pages: (backend.wal_pages_written() - pages_before) as f64 / runs.len().max(1) as f64,
        writer_busy,
        checkpoints: backend.checkpoints(),
        checkpointed: (backend.wal_pages_checkpointed() - checkpointed_before) as f64
            / (backend.wal_pages_written() - pages_before).max(1) as f64,
        most_on_commit_path: backend.most_wal_pages_checkpointed_by_writer(),
        waits_at_bound: backend.checkpoint_waits_at_bound(),
        journal_bytes: bytes / runs.len().max(1) as u64,
    })
}

/// Queues `runs` CT1 runs in `db` and times `workers` `sagabox worker` processes draining
/// the queue (their start-up included); returns runs/s.
fn drain_with_workers(
    runtime: &Runtime,
    db: &Fresh,
    sagas_dir: &Path,
    runs: usize,
    workers: usize,
) -> anyhow::Result<f64> {
    let (saga, state, inputs) = ct1(runtime, sagas_dir)?;
    let backend = db.open()?;
    backend.seed_if_new(&state)?;
    let definition = std::fs::read_to_string(&saga.path)?;
    let path = saga.path.display().to_string();
    // Queued in order, so that the runs in flight at once are of different customers.
    for (i, input) in (0..runs).zip(inputs.iter().cycle()) {
        let record =
            RunRecord::starting(&format!("q{i}"), &saga.name, &path, definition.clone(), input, i as u64).queued();
        backend.register_run(&record)?;
    }
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    let drained = (0..workers).try_for_each(|_| start_worker(&exe, db)).and_then(|()| wait_for_workers());
    if drained.is_err() {
        stop_workers();
    }
    drained?;
    let seconds = started.elapsed().as_secs_f64();
    let unfinished = backend.unfinished_runs()?.len();
    if unfinished > 0 {
        anyhow::bail!("{unfinished} of {runs} queued runs were left unfinished by {workers} worker(s)");
    }
    for run in backend.runs()? {
        check_ct1(&run.run_id, &backend.events(&run.run_id)?)?;
    }
    Ok(runs as f64 / seconds)
}

/// Starts a `sagabox worker` on `db`, kept in [`WORKERS`].
fn start_worker(exe: &Path, db: &Fresh) -> anyhow::Result<()> {
    let mut workers = lock_unless_interrupted(&WORKERS);
    let worker = Command::new(exe)
        .args(["worker", "--db", &db.url(), "--until-done", "--concurrency", "16"])
        .arg(format!("--durability={:?}", db.durability).to_lowercase())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    workers.push(worker);
    Ok(())
}

/// Kills the worker processes still running (the database each works on is removed next,
/// so they are not asked to stop).
fn stop_workers() {
    for mut worker in std::mem::take(&mut *lock(&WORKERS)) {
        if let Err(e) = worker.kill().and_then(|()| worker.wait().map(drop)) {
            eprintln!("warning: cannot stop worker process {}: {e}", worker.id());
        }
    }
}

/// Locks `list` to add to it: an interrupt then either finds what is added there or came
/// first, and then nothing is added (the process only waits to exit).
fn lock_unless_interrupted<T>(list: &Mutex<Vec<T>>) -> MutexGuard<'_, Vec<T>> {
    let guard = lock(list);
    if INTERRUPTED.load(Ordering::SeqCst) {
        drop(guard);
        wait_for_exit();
    }
    guard
}

/// Interrupted: the process exits once its databases are gone (`bench.rs`). Reporting an
/// error first would end it before they are.
fn wait_for_exit() -> ! {
    loop {
        std::thread::park();
    }
}

/// Waits until every worker in [`WORKERS`] has ended. They stay there, for
/// [`remove_leftovers`] to kill, so they are polled rather than waited for.
fn wait_for_workers() -> anyhow::Result<()> {
    loop {
        let mut workers = lock(&WORKERS);
        let mut failed = None;
        workers.retain_mut(|worker| match worker.try_wait() {
            Ok(None) => true,
            Ok(Some(_)) => false,
            Err(e) => {
                failed = Some(e);
                false
            }
        });
        if let Some(e) = failed {
            anyhow::bail!("cannot wait for a worker process: {e}");
        }
        if workers.is_empty() {
            break;
        }
        drop(workers);
        std::thread::sleep(Duration::from_millis(10));
    }
    if INTERRUPTED.load(Ordering::SeqCst) {
        wait_for_exit();
    }
    Ok(())
}
