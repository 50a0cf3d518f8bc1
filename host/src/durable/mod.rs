//! Durable runs across processes: who holds a run (its owner and lease), finishing a run
//! another process left unfinished, and [`worker`]s that take queued and abandoned runs.
//!
//! Every process that holds runs in a database renews their leases while it lives
//! ([`Heartbeat`]). A run whose holder died is free again: at once when the holder was on
//! this machine (its pid is gone), otherwise when its lease runs out.

pub mod worker;

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

pub use crate::backend::DEFAULT_LEASE;
use crate::backend::{Backend, DbError, RunRecord, this_host};
use crate::runtime::Runtime;
use crate::saga::session::{self, SESSION_SOURCE};
use crate::saga::{self, RunOptions, RunReport, Saga};

pub use crate::ids::now_ms;

/// Whether the process holding `run` may still be running it at `now_ms`.
pub fn holder_alive(run: &RunRecord, now_ms: u64) -> bool {
    let leased = run.lease_until_ms.is_some_and(|until| until >= now_ms);
    match run.owner_host() {
        // On this machine, a gone pid says it at once (and a reused one is caught by the lease).
        Some(host) if host == this_host() => alive(run.pid) && leased,
        Some(_) => leased,
        // A database from before leases: its runs were started on this machine.
        None => alive(run.pid),
    }
}

/// Whether process `pid` is alive on this machine.
fn alive(pid: u32) -> bool {
    #[cfg(unix)]
    {
        // 0 and negative pids name process groups or every process for kill(2): never a run's.
        let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
        if pid <= 0 || pid as u32 == std::process::id() {
            return false;
        }
        // SAFETY: signal 0 only checks that the process exists.
        let found = unsafe { libc::kill(pid, 0) } == 0;
        // EPERM: it exists, under another user.
        found || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        false
    }
}

/// Renews this process's leases in a database until dropped.
pub struct Heartbeat {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Heartbeat {
    /// Starts renewing, every third of `lease`, the leases this process holds in `backend`.
    pub fn start(backend: Arc<dyn Backend>, lease: Duration) -> Heartbeat {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("sagabox-lease".into())
            .spawn(move || {
                // A thread of its own: a busy async runtime never delays a renewal.
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(lease / 3) {
                    if let Err(e) = backend.renew_leases(now_ms() + lease.as_millis() as u64) {
                        tracing::warn!("cannot renew the leases of this process's runs: {e}");
                    }
                }
            })
            .ok();
        Heartbeat { stop: Some(stop), thread }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What finishing an unfinished run takes.
pub enum Work {
    /// An agent's session: its client cannot come back, so its effects are undone.
    Session,
    /// A saga, rebuilt from the definition the run recorded.
    Saga(Box<Saga>),
}

impl Work {
    /// What finishing `run` takes; an error when its saga no longer validates against the
    /// loaded plugins.
    pub fn of(runtime: &Runtime, run: &RunRecord) -> Result<Work, String> {
        if run.saga_path == SESSION_SOURCE {
            return Ok(Work::Session);
        }
        Saga::from_text(&run.definition, std::path::Path::new(&run.saga_path), runtime)
            .map(|saga| Work::Saga(Box::new(saga)))
            .map_err(|e| format!("cannot rebuild run {}: {e}", run.run_id))
    }

    /// Runs `run` to its end, from where its journal stops (from the start if it has none);
    /// this process must hold it.
    pub async fn finish(
        &self,
        runtime: &Runtime,
        backend: &dyn Backend,
        run: &RunRecord,
    ) -> Result<RunReport, DbError> {
        let mut options = RunOptions::new(run.run_id.clone(), run.input.clone());
        options.seed = run.seed;
        options.resume = backend.events(&run.run_id)?;
        Ok(match self {
            Work::Session => session::abort_interrupted(runtime, backend, &run.saga, options).await,
            Work::Saga(saga) => saga::run(runtime, saga, backend, options).await,
        })
    }

    /// Whether the run succeeded: a saga completed, or a session was wholly undone.
    pub fn succeeded(&self, report: &RunReport) -> bool {
        match self {
            Work::Session => report.compensation_failures.is_empty(),
            Work::Saga(_) => report.status == saga::Status::Completed,
        }
    }
}
