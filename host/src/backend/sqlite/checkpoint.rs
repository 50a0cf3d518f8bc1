//! Checkpoints off the committing thread.
//!
//! In WAL mode a commit appends pages to the WAL; a checkpoint copies them back into the
//! database file and syncs it (and, under `synchronous=NORMAL`, syncs the WAL first). SQLite
//! checkpoints by itself in the commit that takes the WAL past 1,000 pages, on the committing
//! connection: with group commit, every run with a step in the next transaction waits for it.
//! On a disk where a sync is slow that was most of a durable run's time (one CT1 run at a time:
//! 251–279 runs/s with those checkpoints, 396–427 with none). Here the writing connection only
//! wakes a thread of its own, which checkpoints on a connection of its own (`PASSIVE`: it
//! never blocks readers or the writer).
//!
//! A WAL starts over from its beginning only when a write transaction begins after a
//! checkpoint copied every page, so a writer that never pauses would let it grow without
//! bound: past [`WRITER_CHECKPOINT_FRAMES`] the writing connection checkpoints itself, which
//! then copies only what the thread has not.

use std::ffi::c_int;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::thread::JoinHandle;

use rusqlite::hooks::Wal;
use rusqlite::wal::CheckpointMode;
use rusqlite::{Connection, ErrorCode};

use crate::backend::DbError;

/// WAL pages written between two of the thread's checkpoints (SQLite's own threshold).
const CHECKPOINT_FRAMES: c_int = 1000;

/// WAL pages at which the writing connection checkpoints itself (about 32 MB).
const WRITER_CHECKPOINT_FRAMES: c_int = 8 * CHECKPOINT_FRAMES;

/// The checkpointing thread; dropping it stops the thread and waits for it.
pub(super) struct Checkpointer {
    wake: SyncSender<()>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// Checkpoints the thread made.
    done: Arc<AtomicU64>,
    /// Pages the writer's commits appended to the WAL.
    appended: Arc<AtomicU64>,
}

impl Checkpointer {
    /// Starts a thread that checkpoints on `conn` whenever a commit on `writer` takes the WAL
    /// past [`CHECKPOINT_FRAMES`]; `db` names the database in what it logs. From then on
    /// `writer` no longer checkpoints by itself below [`WRITER_CHECKPOINT_FRAMES`].
    pub(super) fn start(conn: Connection, writer: &mut Connection, db: String) -> Result<Checkpointer, DbError> {
        let name = db.clone();
        let failed = move |error: String| DbError { db: name.clone(), error };
        // One wake-up pending at most: commits during a checkpoint ask for one more, not many.
        let (wake, woken) = std::sync::mpsc::sync_channel(1);
        let hook_wake = wake.clone();
        // The WAL's length when the thread was last woken: it is woken again once as many
        // pages more were written, not at every commit past the threshold.
        let mut woken_at = 0;
        // The WAL's length after the previous commit.
        let mut length = 0;
        let appended = Arc::new(AtomicU64::new(0));
        let pages = appended.clone();
        // Replaces SQLite's automatic checkpoints, which are this same hook.
        let hook = move |wal: &mut Wal, frames: c_int| {
            // A commit that started the WAL over wrote all of it (one that found it shorter
            // than the pages it appends is counted short: the WAL restarts only past a
            // checkpoint of 1,000 pages, and a commit writes far fewer).
            let started_over = frames < length;
            pages.fetch_add((if started_over { frames } else { frames - length }) as u64, Ordering::Relaxed);
            length = frames;
            if started_over {
                woken_at = 0;
            }
            if frames >= WRITER_CHECKPOINT_FRAMES {
                // Busy (the thread is checkpointing): the next commit tries again.
                let _ = wal.checkpoint();
            } else if frames - woken_at >= CHECKPOINT_FRAMES {
                woken_at = frames;
                match hook_wake.try_send(()) {
                    Ok(()) | Err(TrySendError::Full(())) | Err(TrySendError::Disconnected(())) => {}
                }
            }
            Ok(())
        };
        writer.wal_hook(Some(hook)).map_err(|e| failed(e.to_string()))?;
        let (done, stop) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
        let (counter, stopped) = (done.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("sagabox-checkpoint".into())
            .spawn(move || {
                while woken.recv().is_ok() && !stopped.load(Ordering::Relaxed) {
                    checkpoint(&conn, &counter, &db);
                }
            })
            .map_err(|e| failed(format!("cannot start the checkpointing thread: {e}")))?;
        Ok(Checkpointer { wake, stop, thread: Some(thread), done, appended })
    }

    /// Checkpoints the thread made so far.
    pub(super) fn checkpoints(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Pages the writer's commits appended to the WAL so far: what a commit costs in writes.
    pub(super) fn pages_appended(&self) -> u64 {
        self.appended.load(Ordering::Relaxed)
    }
}

fn checkpoint(conn: &Connection, done: &AtomicU64, db: &str) {
    match conn.wal_checkpoint_v2(Some("main"), CheckpointMode::PASSIVE) {
        Ok(_) => {
            done.fetch_add(1, Ordering::Relaxed);
        }
        // Another connection (another process's thread) is checkpointing.
        Err(e) if e.sqlite_error_code() == Some(ErrorCode::DatabaseBusy) => {}
        Err(e) => tracing::warn!("database {db}: a checkpoint failed (the next commit asks again): {e}"),
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        // The writer's hook may still hold a sender: the flag, not the channel, stops it.
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.wake.try_send(());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn the_thread_checkpoints_and_a_writer_without_pause_keeps_the_wal_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        let mut writer = Connection::open(&path).unwrap();
        writer.pragma_update(None, "journal_mode", "WAL").unwrap();
        writer.pragma_update(None, "synchronous", "OFF").unwrap();
        writer.execute_batch("CREATE TABLE t (n INTEGER PRIMARY KEY, body BLOB)").unwrap();
        let checkpointer = Checkpointer::start(Connection::open(&path).unwrap(), &mut writer, "test".into()).unwrap();
        // 40 KB a commit: about ten pages. Four times as many pages as the writer lets the
        // WAL hold, committed back to back.
        let body = vec![7u8; 40_000];
        let commits = 4 * WRITER_CHECKPOINT_FRAMES / 10;
        for n in 0..commits {
            writer.execute("INSERT INTO t VALUES (?1, ?2)", rusqlite::params![n, body]).unwrap();
        }
        let started = Instant::now();
        while checkpointer.checkpoints() == 0 && started.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(checkpointer.checkpoints() > 0, "the thread made no checkpoint");
        // A WAL is overwritten from its start, not shrunk: its length is the most it held.
        let wal = std::fs::metadata(dir.path().join("db.sqlite-wal")).unwrap().len();
        let page = 4096 + 24;
        let most = (WRITER_CHECKPOINT_FRAMES + CHECKPOINT_FRAMES) as u64 * page;
        assert!(wal <= most, "the WAL grew to {wal} bytes ({} pages)", wal / page);
        // Each commit writes its row's ten overflow pages, its leaf, and now and then more,
        // however often the WAL started over.
        let appended = checkpointer.pages_appended();
        let expected = 11 * commits as u64..=14 * commits as u64;
        assert!(expected.contains(&appended), "{appended} pages counted for {commits} commits");
        drop(checkpointer);
        let rows: i64 = writer.query_row("SELECT count(*) FROM t", [], |r| r.get(0)).unwrap();
        assert_eq!(rows, commits as i64);
    }
}
