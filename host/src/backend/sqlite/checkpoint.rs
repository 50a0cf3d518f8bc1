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
//! SQLite opens a connection's WAL at the connection's first read; a checkpoint before it does
//! nothing and reports success. So the thread's connection reads once before it checkpoints
//! (before it did, the thread copied nothing, and the writer copied all 8,000 pages itself
//! each time, with every run's commit waiting).
//!
//! A WAL starts over from its beginning only when a write transaction begins after a
//! checkpoint copied every page, so a writer that never pauses would let it grow without
//! bound: past [`WRITER_CHECKPOINT_FRAMES`] each commit asks the thread again until it has
//! copied all but [`SHORT_TAIL`] pages, and the writing connection then copies that tail
//! itself when the thread is not checkpointing (the two share a lock: SQLite never waits for
//! another checkpoint). Only at [`MOST_FRAMES`] does the writer wait for the thread.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use rusqlite::hooks::Wal;
use rusqlite::wal::CheckpointMode;
use rusqlite::{Connection, ErrorCode};

use crate::backend::DbError;
use crate::sync::{lock, try_lock};

/// WAL pages written between two of the thread's checkpoints (SQLite's own threshold).
const CHECKPOINT_FRAMES: c_int = 1000;

/// WAL pages (about 32 MB) past which the WAL is made to start over: the thread is asked at
/// every commit, and the writing connection copies the last [`SHORT_TAIL`] pages itself.
const WRITER_CHECKPOINT_FRAMES: c_int = 8 * CHECKPOINT_FRAMES;

/// WAL pages the writing connection copies itself past [`WRITER_CHECKPOINT_FRAMES`] at most
/// (short of [`MOST_FRAMES`]): the thread catches up to that first, so the writer's commits
/// wait for a short checkpoint (a checkpoint of the thread's 1,000 pages took 5–30 ms).
const SHORT_TAIL: c_int = 256;

/// WAL pages at which the writing connection waits for the thread's checkpoint to end, and
/// checkpoints the rest itself: the most a WAL holds, but for a commit.
const MOST_FRAMES: c_int = 2 * WRITER_CHECKPOINT_FRAMES;

/// The checkpointing thread; dropping it stops the thread and waits for it.
pub(super) struct Checkpointer {
    wake: SyncSender<()>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
}

/// What the writer's WAL hook and the thread share.
#[derive(Default)]
struct Shared {
    /// Held by whoever of the thread and the writer checkpoints.
    gate: Mutex<()>,
    /// Frames backfilled as of the thread's last checkpoint, counted from the WAL's start.
    caught_up: AtomicU64,
    /// Checkpoints the thread made.
    checkpoints: AtomicU64,
    /// WAL frames the thread's checkpoints copied into the database.
    copied: AtomicU64,
    /// Pages the writer's commits appended to the WAL.
    appended: AtomicU64,
    /// The most WAL frames one of the writer's own checkpoints copied, below [`MOST_FRAMES`].
    most_by_writer: AtomicU64,
    /// Times the writer waited for the thread's checkpoint at [`MOST_FRAMES`].
    waits_at_bound: AtomicU64,
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
        let shared = Arc::new(Shared::default());
        open_wal(&conn).map_err(|e| failed(e.to_string()))?;
        writer.wal_hook(Some(wal_hook(shared.clone(), wake.clone()))).map_err(|e| failed(e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let (thread_shared, stopped) = (shared.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("sagabox-checkpoint".into())
            .spawn(move || checkpoint_when_asked(&conn, &db, &woken, &stopped, &thread_shared))
            .map_err(|e| failed(format!("cannot start the checkpointing thread: {e}")))?;
        Ok(Checkpointer { wake, stop, thread: Some(thread), shared })
    }

    /// Checkpoints the thread made so far.
    pub(super) fn checkpoints(&self) -> u64 {
        self.shared.checkpoints.load(Ordering::Relaxed)
    }

    /// WAL frames the thread's checkpoints copied into the database so far.
    pub(super) fn frames_copied(&self) -> u64 {
        self.shared.copied.load(Ordering::Relaxed)
    }

    /// The most WAL frames one of the writer's own checkpoints copied (below [`MOST_FRAMES`]).
    pub(super) fn most_copied_by_writer(&self) -> u64 {
        self.shared.most_by_writer.load(Ordering::Relaxed)
    }

    /// Times the writer waited for the thread's checkpoint at the WAL's bound so far.
    pub(super) fn waits_at_bound(&self) -> u64 {
        self.shared.waits_at_bound.load(Ordering::Relaxed)
    }

    /// Pages the writer's commits appended to the WAL so far: what a commit costs in writes.
    pub(super) fn pages_appended(&self) -> u64 {
        self.shared.appended.load(Ordering::Relaxed)
    }
}

/// The writer's WAL hook, which replaces SQLite's automatic checkpoints (that same hook):
/// it counts the pages each commit appended, wakes the thread every [`CHECKPOINT_FRAMES`],
/// and past [`WRITER_CHECKPOINT_FRAMES`] has the WAL start over.
fn wal_hook(shared: Arc<Shared>, thread: SyncSender<()>) -> impl FnMut(&mut Wal, c_int) -> rusqlite::Result<()> {
    // The WAL's length when the thread was last woken: it is woken again once as many pages
    // more were written, not at every commit past the threshold.
    let mut woken_at = 0;
    // The WAL's length after the previous commit.
    let mut length = 0;
    move |wal: &mut Wal, frames: c_int| {
        // A commit that started the WAL over wrote all of it (one that found it shorter than
        // the pages it appends is counted short: the WAL restarts only past a checkpoint of
        // 1,000 pages, and a commit writes far fewer).
        let started_over = frames < length;
        let appended = if started_over { frames } else { frames - length };
        shared.appended.fetch_add(appended as u64, Ordering::Relaxed);
        length = frames;
        if started_over {
            woken_at = 0;
        }
        if frames >= MOST_FRAMES {
            // The thread's checkpoint ran for as long as the WAL took to double: wait for it
            // to end (SQLite never waits for another checkpoint), then copy the rest.
            shared.waits_at_bound.fetch_add(1, Ordering::Relaxed);
            let _running = lock(&shared.gate);
            let _ = wal.checkpoint_v2(CheckpointMode::PASSIVE);
        } else if frames >= WRITER_CHECKPOINT_FRAMES {
            // More than the WAL holds: counted before it started over (then the thread has
            // copied nothing of it that the writer knows of).
            let caught_up = shared.caught_up.load(Ordering::Relaxed);
            let backfilled = if caught_up <= frames as u64 { caught_up as c_int } else { 0 };
            if frames - backfilled > SHORT_TAIL {
                // The thread catches up first, at once and again, until the tail is short.
                ask_for_checkpoint(&thread);
            } else if let Some(_running) = try_lock(&shared.gate) {
                // Copies only the tail the thread has not (busy, another process
                // checkpointing: the next commit tries again). The thread checkpointing: it
                // may well copy all, and the next commit tries again.
                if let Ok((_, now)) = wal.checkpoint_v2(CheckpointMode::PASSIVE) {
                    let copied = now.saturating_sub(backfilled) as u64;
                    shared.most_by_writer.fetch_max(copied, Ordering::Relaxed);
                }
            }
        } else if frames - woken_at >= CHECKPOINT_FRAMES {
            woken_at = frames;
            ask_for_checkpoint(&thread);
        }
        Ok(())
    }
}

/// The thread: a checkpoint each time it is asked, until `stopped` or the writer is gone.
fn checkpoint_when_asked(
    conn: &Connection,
    db: &str,
    woken: &std::sync::mpsc::Receiver<()>,
    stopped: &AtomicBool,
    shared: &Shared,
) {
    // The previous checkpoint found no WAL, and the connection read since.
    let mut read_for_wal = false;
    while woken.recv().is_ok() && !stopped.load(Ordering::Relaxed) {
        let outcome = {
            let _running = lock(&shared.gate);
            checkpoint(conn, db)
        };
        read_for_wal = match outcome {
            Checkpoint::Ran(now) => {
                // Fewer than before: the WAL started over since.
                let before = shared.caught_up.swap(now, Ordering::Relaxed);
                let new = if now >= before { now - before } else { now };
                shared.copied.fetch_add(new, Ordering::Relaxed);
                shared.checkpoints.fetch_add(1, Ordering::Relaxed);
                false
            }
            // Read (outside the lock: a read may wait for another process), and go on at the
            // next wake-up.
            Checkpoint::NoWal => {
                if read_for_wal {
                    tracing::warn!("database {db}: its WAL is not open to checkpoint, even after a read");
                }
                match open_wal(conn) {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!("database {db}: cannot read it to checkpoint its WAL: {e}");
                        false
                    }
                }
            }
            Checkpoint::NotRun => read_for_wal,
        };
    }
}

/// What a checkpoint of the thread did.
enum Checkpoint {
    /// It ran: the frames backfilled so far, counted from the WAL's start.
    Ran(u64),
    /// The connection has not opened the WAL: SQLite opens it at the connection's first
    /// read, and until then a checkpoint does nothing and reports success with −1 frames.
    NoWal,
    /// Busy (another process checkpointing) or failed (logged).
    NotRun,
}

/// Checkpoints what the WAL holds, without waiting for readers or the writer.
fn checkpoint(conn: &Connection, db: &str) -> Checkpoint {
    match conn.wal_checkpoint_v2(Some("main"), CheckpointMode::PASSIVE) {
        Ok((_, backfilled)) if backfilled >= 0 => Checkpoint::Ran(backfilled as u64),
        Ok(_) => Checkpoint::NoWal,
        Err(e) if e.sqlite_error_code() == Some(ErrorCode::DatabaseBusy) => Checkpoint::NotRun,
        Err(e) => {
            tracing::warn!("database {db}: a checkpoint failed (the next commit asks again): {e}");
            Checkpoint::NotRun
        }
    }
}

/// Asks the thread for a checkpoint (one pending at most: asked again during one, it makes
/// one more).
fn ask_for_checkpoint(thread: &SyncSender<()>) {
    match thread.try_send(()) {
        Ok(()) | Err(TrySendError::Full(())) | Err(TrySendError::Disconnected(())) => {}
    }
}

/// Makes `conn` open the database's WAL, which it does at its first read.
fn open_wal(conn: &Connection) -> rusqlite::Result<()> {
    conn.query_row("SELECT count(*) FROM sqlite_schema", [], |_| Ok(()))
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
    use std::path::Path;
    use std::time::{Duration, Instant};

    /// Size of a WAL frame: a page and its header.
    const FRAME: u64 = 4096 + 24;

    /// A WAL database of one table in `dir`, its writing connection, and a checkpointer.
    fn wal_database(dir: &Path) -> (Connection, Checkpointer) {
        let path = dir.join("db.sqlite");
        let mut writer = Connection::open(&path).unwrap();
        writer.pragma_update(None, "journal_mode", "WAL").unwrap();
        writer.pragma_update(None, "synchronous", "OFF").unwrap();
        writer.execute_batch("CREATE TABLE t (n INTEGER PRIMARY KEY, body BLOB)").unwrap();
        let checkpointer = Checkpointer::start(Connection::open(&path).unwrap(), &mut writer, "test".into()).unwrap();
        (writer, checkpointer)
    }

    /// Commits `commits` rows of 40 KB (about ten pages each), pausing `pause` after each.
    fn commit_rows(writer: &Connection, commits: c_int, pause: Option<Duration>) {
        let body = vec![7u8; 40_000];
        for n in 0..commits {
            writer.execute("INSERT INTO t VALUES (?1, ?2)", rusqlite::params![n, body]).unwrap();
            if let Some(pause) = pause {
                std::thread::sleep(pause);
            }
        }
    }

    /// The most frames the WAL in `dir` held: it is overwritten from its start, not shrunk.
    fn most_wal_frames(dir: &Path) -> u64 {
        std::fs::metadata(dir.join("db.sqlite-wal")).unwrap().len() / FRAME
    }

    fn rows(writer: &Connection) -> c_int {
        writer.query_row("SELECT count(*) FROM t", [], |r| r.get(0)).unwrap()
    }

    #[test]
    fn the_thread_checkpoints_and_a_writer_without_pause_keeps_the_wal_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let (writer, checkpointer) = wal_database(dir.path());
        // Four times as many pages as the writer lets the WAL hold, committed back to back.
        let commits = 4 * WRITER_CHECKPOINT_FRAMES / 10;
        commit_rows(&writer, commits, None);
        let started = Instant::now();
        while checkpointer.checkpoints() == 0 && started.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(checkpointer.checkpoints() > 0, "the thread made no checkpoint");
        // A checkpoint on a connection that has not yet read the database does nothing and
        // still succeeds: SQLite opens a connection's WAL at its first read.
        assert!(checkpointer.frames_copied() > 0, "the thread's checkpoints copied nothing");
        let most = most_wal_frames(dir.path());
        assert!(most <= (MOST_FRAMES + 20) as u64, "the WAL grew to {most} pages");
        // Each commit writes its row's ten overflow pages, its leaf, and now and then more,
        // however often the WAL started over.
        let appended = checkpointer.pages_appended();
        let expected = 11 * commits as u64..=14 * commits as u64;
        assert!(expected.contains(&appended), "{appended} pages counted for {commits} commits");
        drop(checkpointer);
        assert_eq!(rows(&writer), commits);
    }

    #[test]
    fn the_writers_own_checkpoints_copy_only_a_short_tail() {
        let dir = tempfile::tempdir().unwrap();
        let (writer, checkpointer) = wal_database(dir.path());
        // A pause between commits, as a real writer's work makes: three times the writer's
        // threshold.
        let commits = 3 * WRITER_CHECKPOINT_FRAMES / 10;
        commit_rows(&writer, commits, Some(Duration::from_micros(500)));
        // Every run's commit waits for a checkpoint the writer makes itself. Past its
        // threshold it makes one only once the thread caught up to a short tail (or the
        // thread restarted the WAL and it needs none); before, it checkpointed at once,
        // copying the 1,000 pages or so since the thread's last checkpoint.
        let most = checkpointer.most_copied_by_writer();
        assert!(most <= SHORT_TAIL as u64, "a checkpoint of the writer copied {most} pages");
        let most = most_wal_frames(dir.path());
        assert!(most <= (MOST_FRAMES + 20) as u64, "the WAL grew to {most} pages");
        drop(checkpointer);
        assert_eq!(rows(&writer), commits);
    }
}
