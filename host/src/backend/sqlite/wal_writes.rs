//! A VFS that writes a transaction's WAL frames to the file in one system call.
//!
//! SQLite appends each frame with two `pwrite`s, its 24-byte header and its page, and a
//! frame of 4,120 bytes straddles two of the file's pages. A durable step's commit appends
//! five or six frames, and one `pwrite` cost about 5 µs on the machine that measured it, so
//! those writes were over half of the single writer's commits (BENCHMARKS item 30).
//!
//! This VFS is the platform's default one with one change: a WAL file gathers appended
//! frames in memory and writes them out at once. What SQLite relies on still holds:
//! - **Readers see only written frames.** A transaction becomes visible when its writer
//!   publishes a new WAL-index header, after appending its frames, the last of which is its
//!   commit frame (the only kind whose header carries the database's size). The gathered
//!   frames are written as soon as the commit frame's page is, so nothing is held when the
//!   header is published, and a failed write fails the commit.
//! - **Order.** Anything else done with the file (a read, a write elsewhere, a sync, its
//!   size, a truncation, a file control, closing it) first writes what is gathered.
//! - **Crashes.** Frames still gathered belong to a transaction that has not committed; a
//!   crash loses them as it would lose frames SQLite had not yet written.
//!
//! Other files (the database, its shared memory) are the default VFS's own.

use std::ffi::{CStr, c_int, c_void};
use std::mem::size_of;
use std::ptr;
use std::sync::OnceLock;

use rusqlite::ffi;

/// The VFS's name, for [`rusqlite::Connection::open_with_flags_and_vfs`].
pub(super) const NAME: &CStr = c"sagabox-wal";

/// A WAL frame's header.
const FRAME_HEADER: usize = 24;

/// Most bytes gathered before they are written anyway (a bound on memory, not a commit).
const MAX_GATHERED: usize = 4 << 20;

/// Most bytes the default VFS writes in one call: it cuts a longer write to 17 bits of length
/// and reports the rest as a full disk.
const MAX_WRITE: usize = 0x1_f000;

/// Registers the VFS once per process; later calls return the first outcome.
pub(super) fn register() -> Result<&'static CStr, String> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    // SAFETY: see `register_once`.
    REGISTERED.get_or_init(|| unsafe { register_once() }).clone().map(|()| NAME)
}

/// The default VFS, which every call is passed on to.
static BASE: OnceLock<Base> = OnceLock::new();

/// The default VFS and its WAL files' methods, with ours beside them.
struct Base {
    vfs: *mut ffi::sqlite3_vfs,
    file_methods: ffi::sqlite3_io_methods,
}

// SAFETY: SQLite's VFS objects are meant to be shared by every thread: the default VFS lives
// as long as the process and is never changed once registered.
unsafe impl Send for Base {}
unsafe impl Sync for Base {}

/// A WAL file: SQLite's handle first (its methods are ours), then the default VFS's handle.
#[repr(C)]
struct WalFile {
    handle: ffi::sqlite3_file,
    /// The default VFS's file, in the bytes that follow this struct.
    inner: *mut ffi::sqlite3_file,
    /// Bytes appended but not yet written, and where they start in the file.
    gathered: Vec<u8>,
    start: i64,
    /// Where the last write ended: a write that starts there continues an append.
    last_end: i64,
    /// Whether the last frame header written marks a commit: its page ends a transaction.
    in_commit_frame: bool,
}

/// # Safety
/// Called once, before any connection uses the VFS; SQLite initializes itself in
/// `sqlite3_vfs_find`.
unsafe fn register_once() -> Result<(), String> {
    // SAFETY: a null name asks for the default VFS, which SQLite keeps for the process.
    let base = unsafe { ffi::sqlite3_vfs_find(ptr::null()) };
    if base.is_null() {
        return Err("SQLite has no default VFS".into());
    }
    // SAFETY: `base` is a live, registered VFS.
    let mut vfs = unsafe { *base };
    let Ok(size) = c_int::try_from(size_of::<WalFile>() + vfs.szOsFile as usize) else {
        return Err("the default VFS's file handle is too large".into());
    };
    // Everything but opening is the default VFS's own (its `pAppData` included, which its
    // methods read); only WAL files get other methods.
    vfs.szOsFile = size;
    vfs.zName = NAME.as_ptr();
    vfs.pNext = ptr::null_mut();
    vfs.xOpen = Some(open);
    // Version 1: SQLite asks a WAL file for nothing of versions 2 and 3 (shared memory is
    // its database file's, and it never maps a WAL into memory).
    let methods = ffi::sqlite3_io_methods {
        iVersion: 1,
        xClose: Some(close),
        xRead: Some(read),
        xWrite: Some(write),
        xTruncate: Some(truncate),
        xSync: Some(sync),
        xFileSize: Some(file_size),
        xLock: Some(lock),
        xUnlock: Some(unlock),
        xCheckReservedLock: Some(check_reserved_lock),
        xFileControl: Some(file_control),
        xSectorSize: Some(sector_size),
        xDeviceCharacteristics: Some(device_characteristics),
        xShmMap: None,
        xShmLock: None,
        xShmBarrier: None,
        xShmUnmap: None,
        xFetch: None,
        xUnfetch: None,
    };
    if BASE.set(Base { vfs: base, file_methods: methods }).is_err() {
        return Err("the WAL-gathering VFS was set up twice".into());
    }
    // SQLite keeps the pointer for the rest of the process (its registry links through it).
    let vfs = Box::leak(Box::new(vfs));
    // SAFETY: `vfs` is a complete VFS that lives for the rest of the process.
    match unsafe { ffi::sqlite3_vfs_register(vfs, 0) } {
        ffi::SQLITE_OK => Ok(()),
        rc => Err(format!("cannot register the WAL-gathering VFS (SQLite error {rc})")),
    }
}

unsafe extern "C" fn open(
    _vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    // Set before the VFS was registered, so always there.
    let Some(base) = BASE.get() else { return ffi::SQLITE_CANTOPEN };
    // SAFETY: the default VFS's own `xOpen` is given its own VFS and SQLite's arguments.
    let open_inner = |inner: *mut ffi::sqlite3_file| unsafe {
        match (*base.vfs).xOpen {
            Some(open) => open(base.vfs, name, inner, flags, out_flags),
            None => ffi::SQLITE_CANTOPEN,
        }
    };
    if flags & ffi::SQLITE_OPEN_WAL == 0 {
        // The default VFS's handle in place of ours: `file` has room for it.
        return open_inner(file);
    }
    // SAFETY: SQLite gives `szOsFile` bytes, 8-byte aligned: a `WalFile`, then the default
    // VFS's handle (`WalFile`'s size is a multiple of its 8-byte alignment).
    unsafe {
        let inner = file.cast::<u8>().add(size_of::<WalFile>()).cast::<ffi::sqlite3_file>();
        let rc = open_inner(inner);
        if rc != ffi::SQLITE_OK {
            // No methods: SQLite then never calls `xClose` on a handle that did not open.
            (*file).pMethods = ptr::null();
            return rc;
        }
        file.cast::<WalFile>().write(WalFile {
            handle: ffi::sqlite3_file { pMethods: &base.file_methods },
            inner,
            gathered: Vec::new(),
            start: 0,
            last_end: 0,
            in_commit_frame: false,
        });
    }
    ffi::SQLITE_OK
}

impl WalFile {
    /// # Safety
    /// `file` is a handle `open` made for a WAL file and has not closed.
    unsafe fn of<'a>(file: *mut ffi::sqlite3_file) -> &'a mut WalFile {
        // SAFETY: per the contract; SQLite uses a handle from one thread at a time.
        unsafe { &mut *file.cast::<WalFile>() }
    }

    fn inner_methods(&self) -> &ffi::sqlite3_io_methods {
        // SAFETY: the default VFS set the methods of the handle it opened; they are static.
        unsafe { &*(*self.inner).pMethods }
    }

    /// Writes what is gathered.
    fn flush(&mut self) -> c_int {
        if self.gathered.is_empty() {
            return ffi::SQLITE_OK;
        }
        let mut rc = ffi::SQLITE_OK;
        let mut offset = self.start;
        for chunk in self.gathered.chunks(MAX_WRITE) {
            rc = self.write_through(chunk.as_ptr().cast(), chunk.len() as c_int, offset);
            if rc != ffi::SQLITE_OK {
                break;
            }
            offset += chunk.len() as i64;
        }
        // Written or not, it is not written again: a failed write fails SQLite's transaction,
        // whose frames are then dropped. The buffer keeps its room for the next commit.
        self.gathered.clear();
        rc
    }

    fn write_through(&self, data: *const c_void, len: c_int, offset: i64) -> c_int {
        match self.inner_methods().xWrite {
            // SAFETY: the default VFS's write on its own handle; `data` holds `len` bytes.
            Some(write) => unsafe { write(self.inner, data, len, offset) },
            None => ffi::SQLITE_IOERR_WRITE,
        }
    }

    /// Gathers `data` if it continues an append, else writes it at once, after what is
    /// gathered (a frame overwritten within its transaction, checksums rewritten).
    fn write(&mut self, data: &[u8], offset: i64) -> c_int {
        let appends = if self.gathered.is_empty() {
            // Where the last write ended, or a new WAL's header at the start.
            offset == self.last_end || offset == 0
        } else {
            offset == self.start + self.gathered.len() as i64
        };
        if !appends {
            let rc = self.flush();
            if rc != ffi::SQLITE_OK {
                return rc;
            }
        }
        if data.len() == FRAME_HEADER {
            // Bytes 4..8 of a frame's header: the database's size after a commit, else 0.
            self.in_commit_frame = data[4..8] != [0; 4];
        }
        self.last_end = offset + data.len() as i64;
        if !appends {
            return self.write_through(data.as_ptr().cast(), data.len() as c_int, offset);
        }
        if self.gathered.is_empty() {
            self.start = offset;
        }
        self.gathered.extend_from_slice(data);
        let commit_written = self.in_commit_frame && data.len() != FRAME_HEADER;
        if commit_written || self.gathered.len() >= MAX_GATHERED { self.flush() } else { ffi::SQLITE_OK }
    }
}

/// Writes what `file` gathered, then makes `call` on the default VFS's handle.
///
/// # Safety
/// `file` is an open WAL handle of ours; `call` calls one of its inner methods.
unsafe fn flushed(
    file: *mut ffi::sqlite3_file,
    call: impl FnOnce(&ffi::sqlite3_io_methods, *mut ffi::sqlite3_file) -> Option<c_int>,
) -> c_int {
    // SAFETY: per the contract.
    let wal = unsafe { WalFile::of(file) };
    let rc = wal.flush();
    if rc != ffi::SQLITE_OK {
        return rc;
    }
    call(wal.inner_methods(), wal.inner).unwrap_or(ffi::SQLITE_IOERR)
}

/// Makes `call` on the default VFS's handle of `file`, writing nothing gathered first.
///
/// # Safety
/// As [`flushed`].
unsafe fn passed_on(
    file: *mut ffi::sqlite3_file,
    call: impl FnOnce(&ffi::sqlite3_io_methods, *mut ffi::sqlite3_file) -> Option<c_int>,
) -> c_int {
    // SAFETY: per the contract.
    let wal = unsafe { WalFile::of(file) };
    call(wal.inner_methods(), wal.inner).unwrap_or(ffi::SQLITE_IOERR)
}

unsafe extern "C" fn close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: SQLite closes a handle `open` made, once.
    unsafe {
        let written = WalFile::of(file).flush();
        let closed = passed_on(file, |m, inner| m.xClose.map(|f| f(inner)));
        ptr::drop_in_place(file.cast::<WalFile>());
        if written != ffi::SQLITE_OK { written } else { closed }
    }
}

unsafe extern "C" fn read(file: *mut ffi::sqlite3_file, buf: *mut c_void, len: c_int, offset: i64) -> c_int {
    // SAFETY: SQLite's arguments, passed on.
    unsafe { flushed(file, |m, inner| m.xRead.map(|f| f(inner, buf, len, offset))) }
}

unsafe extern "C" fn write(file: *mut ffi::sqlite3_file, buf: *const c_void, len: c_int, offset: i64) -> c_int {
    // SAFETY: SQLite passes `len` readable bytes at `buf`, and a handle `open` made.
    unsafe {
        let data = std::slice::from_raw_parts(buf.cast::<u8>(), len.max(0) as usize);
        WalFile::of(file).write(data, offset)
    }
}

unsafe extern "C" fn truncate(file: *mut ffi::sqlite3_file, size: i64) -> c_int {
    // SAFETY: as `read`.
    unsafe {
        let rc = flushed(file, |m, inner| m.xTruncate.map(|f| f(inner, size)));
        let wal = WalFile::of(file);
        wal.last_end = wal.last_end.min(size);
        rc
    }
}

unsafe extern "C" fn sync(file: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    // SAFETY: as `read`.
    unsafe { flushed(file, |m, inner| m.xSync.map(|f| f(inner, flags))) }
}

unsafe extern "C" fn file_size(file: *mut ffi::sqlite3_file, size: *mut i64) -> c_int {
    // SAFETY: as `read`.
    unsafe { flushed(file, |m, inner| m.xFileSize.map(|f| f(inner, size))) }
}

unsafe extern "C" fn lock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    // SAFETY: as `read`.
    unsafe { passed_on(file, |m, inner| m.xLock.map(|f| f(inner, level))) }
}

unsafe extern "C" fn unlock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    // SAFETY: as `read`.
    unsafe { passed_on(file, |m, inner| m.xUnlock.map(|f| f(inner, level))) }
}

unsafe extern "C" fn check_reserved_lock(file: *mut ffi::sqlite3_file, out: *mut c_int) -> c_int {
    // SAFETY: as `read`.
    unsafe { passed_on(file, |m, inner| m.xCheckReservedLock.map(|f| f(inner, out))) }
}

unsafe extern "C" fn file_control(file: *mut ffi::sqlite3_file, op: c_int, arg: *mut c_void) -> c_int {
    // SAFETY: as `read`. Unknown controls come back `SQLITE_NOTFOUND` from the default VFS.
    unsafe { flushed(file, |m, inner| m.xFileControl.map(|f| f(inner, op, arg))) }
}

unsafe extern "C" fn sector_size(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: as `read`.
    unsafe { passed_on(file, |m, inner| m.xSectorSize.map(|f| f(inner))) }
}

unsafe extern "C" fn device_characteristics(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: as `read`.
    unsafe { passed_on(file, |m, inner| m.xDeviceCharacteristics.map(|f| f(inner))) }
}

#[cfg(test)]
mod tests {
    use rusqlite::{Connection, OpenFlags, params};

    /// Write system calls this thread has made so far.
    fn writes_by_this_thread() -> u64 {
        let io = std::fs::read_to_string("/proc/thread-self/io").unwrap();
        let line = io.lines().find_map(|l| l.strip_prefix("syscw:")).unwrap();
        line.trim().parse().unwrap()
    }

    fn gathering(path: &std::path::Path) -> Connection {
        let conn = super::super::connect(path, OpenFlags::default()).unwrap();
        conn.pragma_update(None, "journal_mode", "WAL").unwrap();
        conn.pragma_update(None, "synchronous", "NORMAL").unwrap();
        conn
    }

    /// The rows as a connection of the default VFS reads them, after checking the database.
    fn read_plainly(path: &std::path::Path) -> Vec<(i64, Vec<u8>)> {
        let plain = Connection::open(path).unwrap();
        let check: String = plain.query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap();
        assert_eq!(check, "ok");
        let mut stmt = plain.prepare("SELECT n, body FROM t ORDER BY n").unwrap();
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap().map(Result::unwrap).collect()
    }

    #[test]
    fn a_commit_reaches_the_wal_in_one_write_and_other_connections_read_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        let conn = gathering(&path);
        conn.execute_batch("CREATE TABLE t (n INTEGER PRIMARY KEY, body BLOB)").unwrap();
        let body = |n: i64| (0..4000).map(|i| (i as i64 * 31 + n) as u8).collect::<Vec<u8>>();
        for round in 0..3 {
            let before = writes_by_this_thread();
            let tx = conn.unchecked_transaction().unwrap();
            for n in round * 64..(round + 1) * 64 {
                tx.execute("INSERT INTO t VALUES (?1, ?2)", params![n, body(n)]).unwrap();
            }
            tx.commit().unwrap();
            // 64 rows of 4 KB: over 64 frames, which SQLite writes with two calls each; here
            // 270 KB in calls of up to 124 KiB.
            let writes = writes_by_this_thread() - before;
            assert!(writes <= 4, "{writes} write calls for one commit of over 64 pages");
            let rows = read_plainly(&path);
            assert_eq!(rows.len() as i64, (round + 1) * 64);
            assert!(rows.iter().all(|(n, b)| *b == body(*n)), "a row read back differs");
        }
    }

    #[test]
    fn transactions_that_spill_rewrite_and_roll_back_leave_what_plain_sqlite_reads() {
        // A cache of a few pages makes a large transaction write frames before its commit,
        // overwrite them (checksums rewritten at the commit) and read them back; savepoints
        // and rollbacks drop frames already written.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        let conn = gathering(&path);
        conn.pragma_update(None, "cache_size", 4).unwrap();
        conn.execute_batch("CREATE TABLE t (n INTEGER PRIMARY KEY, body BLOB)").unwrap();
        let mut expected = std::collections::BTreeMap::new();
        for round in 0..20u8 {
            let tx = conn.unchecked_transaction().unwrap();
            for pass in 0..3u8 {
                for n in 0..40i64 {
                    let body = vec![round ^ pass ^ n as u8; 1500];
                    tx.execute("INSERT OR REPLACE INTO t VALUES (?1, ?2)", params![n + round as i64, body]).unwrap();
                }
            }
            tx.execute_batch("SAVEPOINT s").unwrap();
            tx.execute("DELETE FROM t WHERE n % 3 = 0", []).unwrap();
            tx.execute_batch("ROLLBACK TO s; RELEASE s").unwrap();
            if round % 4 == 3 {
                tx.rollback().unwrap();
            } else {
                tx.commit().unwrap();
                for n in 0..40i64 {
                    expected.insert(n + round as i64, vec![round ^ 2 ^ n as u8; 1500]);
                }
            }
            let rows = read_plainly(&path);
            assert_eq!(rows, expected.iter().map(|(n, b)| (*n, b.clone())).collect::<Vec<_>>(), "round {round}");
        }
        // After a checkpoint the WAL starts over from its beginning.
        conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)").unwrap();
        conn.execute("DELETE FROM t WHERE n < 10", []).unwrap();
        expected.retain(|n, _| *n >= 10);
        assert_eq!(read_plainly(&path), expected.into_iter().collect::<Vec<_>>());
    }
}
