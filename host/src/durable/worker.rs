//! A worker: takes queued runs (`sagabox submit`) and runs whose holder died from a
//! database, under leases, and finishes them, a few at once.
//!
//! Claims are atomic in the backend (PostgreSQL: `FOR UPDATE SKIP LOCKED`), so workers on
//! many machines never take the same run; a run taken over from a dead holder resumes from
//! its journal, so completed steps are not run again and each effect and compensation is
//! applied once (its idempotency key decides).

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{Heartbeat, Work, holder_alive, now_ms};
use crate::backend::{Backend, DbError, RunRecord, this_process};
use crate::runtime::Runtime;
use crate::saga::{RunReport, Status};

/// How a worker works.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// Runs in flight at once.
    pub concurrency: usize,
    /// How long its runs stay its own without a renewal.
    pub lease: Duration,
    /// How often it looks for runs when it found none.
    pub poll: Duration,
    /// Stop once the database holds no queued or unfinished run.
    pub until_done: bool,
}

impl Default for WorkerOptions {
    fn default() -> WorkerOptions {
        WorkerOptions {
            concurrency: 4,
            lease: super::DEFAULT_LEASE,
            poll: Duration::from_millis(200),
            until_done: false,
        }
    }
}

/// How one run a worker took ended.
pub enum Finished {
    /// It ran to its end; `succeeded` as [`Work::succeeded`] says.
    Ran { report: Box<RunReport>, succeeded: bool },
    /// It could not be rebuilt or read; it stays unfinished.
    Failed(String),
}

/// What a worker did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally {
    /// Runs it finished, by final status (`completed`, `failed` when rolled back, ...).
    pub by_status: std::collections::BTreeMap<String, u64>,
    /// Runs that did not succeed ([`Work::succeeded`]).
    pub unsuccessful: u64,
    /// Runs it could not finish.
    pub errors: u64,
    /// Claims it made (each a write transaction), those that found nothing included.
    pub claims: u64,
}

/// Works until `stop` is cancelled (or, with `until_done`, until nothing is left), calling
/// `on_finished` for each run it took.
pub async fn work(
    runtime: Arc<Runtime>,
    backend: Arc<dyn Backend>,
    options: &WorkerOptions,
    stop: CancellationToken,
    mut on_finished: impl FnMut(&RunRecord, &Finished),
) -> Result<Tally, DbError> {
    let _heartbeat = Heartbeat::start(Arc::clone(&backend), options.lease);
    let mut in_flight: JoinSet<(RunRecord, Finished)> = JoinSet::new();
    let mut tally = Tally::default();
    // Runs it could not finish: it keeps holding them, so no other worker loops on them.
    let mut given_up = std::collections::HashSet::new();
    // Which run each task runs, to name it if the task fails.
    let mut tasks = std::collections::HashMap::new();
    let concurrency = options.concurrency.max(1);
    // A claim is a write transaction. A busy worker claimed each slot as it freed up, and
    // again as each run ended once the queue was empty: a transaction per run, which halved
    // a SQLite worker's throughput. It now claims when an eighth of its slots are free (one,
    // below 16 slots), except after a claim that found fewer runs than it asked for; and
    // whatever the count, every poll and whenever nothing is in flight.
    let batch = (concurrency / 8).max(1);
    let mut queue_short = false;
    // On a clock of its own: runs that end do not put the next poll off.
    let mut next_poll = tokio::time::Instant::now();
    loop {
        let free = concurrency - in_flight.len();
        let mut claimed = Vec::new();
        let poll_due = tokio::time::Instant::now() >= next_poll;
        let due = poll_due || in_flight.is_empty() || (free >= batch && !queue_short);
        if free > 0 && due && !stop.is_cancelled() {
            let (claimer, lease) = (Arc::clone(&backend), options.lease.as_millis() as u64);
            // What it runs and what it gave up on: any other run of this process's is one an
            // earlier claim took whose answer was lost (a broken connection), and is taken back.
            let held: Vec<String> = tasks.values().chain(&given_up).cloned().collect();
            claimed = blocking(move || claimer.claim_runs(now_ms(), now_ms() + lease, free, &held)).await?;
            tally.claims += 1;
            queue_short = claimed.len() < free;
            if poll_due {
                next_poll = tokio::time::Instant::now() + options.poll;
            }
            if claimed.is_empty() && in_flight.is_empty() {
                claimed = adopt_orphans(&backend, options.lease, free).await?;
            }
        }
        for run in claimed {
            tracing::info!(run = %run.run_id, saga = %run.saga, "took a run");
            let (runtime, backend, run_id) = (Arc::clone(&runtime), Arc::clone(&backend), run.run_id.clone());
            let task = in_flight.spawn(async move {
                let finished = finish(&runtime, &*backend, &run).await;
                (run, finished)
            });
            tasks.insert(task.id(), run_id);
        }
        if in_flight.is_empty() {
            if stop.is_cancelled() || (options.until_done && nothing_left(&backend, &given_up).await?) {
                return Ok(tally);
            }
            tokio::select! {
                _ = tokio::time::sleep(options.poll) => {}
                _ = stop.cancelled() => {}
            }
            continue;
        }
        // Room for more: look again after a poll, or as soon as a run ends.
        let next = if in_flight.len() < concurrency && !stop.is_cancelled() {
            tokio::select! {
                done = in_flight.join_next_with_id() => done,
                _ = tokio::time::sleep_until(next_poll) => None,
            }
        } else {
            in_flight.join_next_with_id().await
        };
        match next {
            // A panic in a run's task (a bug) ends that run only; it stays this worker's.
            Some(Err(e)) => {
                let run_id = tasks.remove(&e.id()).unwrap_or_default();
                tracing::error!(run = %run_id, "a run's task failed: {e}");
                tally.errors += 1;
                given_up.insert(run_id);
            }
            Some(Ok((task, (run, finished)))) => {
                tasks.remove(&task);
                tally.count(&run, &finished, &mut given_up);
                on_finished(&run, &finished);
            }
            None => {}
        }
    }
}

impl Tally {
    fn count(&mut self, run: &RunRecord, finished: &Finished, given_up: &mut std::collections::HashSet<String>) {
        match finished {
            Finished::Ran { report, succeeded } => {
                *self.by_status.entry(report.status.as_str().to_string()).or_default() += 1;
                // A run another worker took over is that worker's to finish and count.
                self.unsuccessful += u64::from(!succeeded && report.status != Status::TakenOver);
            }
            Finished::Failed(_) => {
                self.errors += 1;
                given_up.insert(run.run_id.clone());
            }
        }
    }
}

/// Finishes one run this worker took.
async fn finish(runtime: &Runtime, backend: &dyn Backend, run: &RunRecord) -> Finished {
    let work = match Work::of(runtime, run) {
        Ok(work) => work,
        Err(e) => return Finished::Failed(e),
    };
    match work.finish(runtime, backend, run).await {
        Ok(report) => {
            let succeeded = work.succeeded(&report);
            Finished::Ran { report: Box::new(report), succeeded }
        }
        Err(e) => Finished::Failed(format!("run {}: {e}", run.run_id)),
    }
}

/// Takes over up to `limit` unfinished runs whose holder was a process of this machine that
/// is gone: at once, without waiting for their leases to run out (as `sagabox resume` does).
async fn adopt_orphans(backend: &Arc<dyn Backend>, lease: Duration, limit: usize) -> Result<Vec<RunRecord>, DbError> {
    let backend = Arc::clone(backend);
    blocking(move || {
        let now = now_ms();
        let mut adopted = Vec::new();
        let orphan = |r: &RunRecord| r.status == "running" && r.owner != this_process() && !holder_alive(r, now);
        for run in backend.unfinished_runs()?.into_iter().filter(orphan) {
            if adopted.len() == limit {
                break;
            }
            // A compare-and-swap: of two workers seeing it, one gets it.
            if backend.adopt_run(&run.run_id, &run, now + lease.as_millis() as u64)? {
                adopted.push(run);
            }
        }
        Ok(adopted)
    })
    .await
}

/// Whether the database holds no queued or unfinished run but those given up on.
async fn nothing_left(
    backend: &Arc<dyn Backend>,
    given_up: &std::collections::HashSet<String>,
) -> Result<bool, DbError> {
    let backend = Arc::clone(backend);
    let runs = blocking(move || backend.unfinished_runs()).await?;
    Ok(runs.iter().all(|r| given_up.contains(&r.run_id)))
}

/// Runs a backend call, which may block on storage, off the async workers.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("a backend call panicked")
}
