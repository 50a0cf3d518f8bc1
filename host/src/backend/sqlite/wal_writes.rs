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
//! - **Nothing outlives the write lock.** A transaction that rolls back leaves the frames it
//!   wrote early (a spilled cache) past the WAL's end, where the next writer, maybe another
//!   process, appends its own. So what is gathered is written before the connection lets go
//!   of the WAL's write lock (its database file's shared-memory lock 0), or of its lock on
//!   the database file (which exclusive locking mode holds instead), as SQLite would have
//!   written it, and never after.
//! - **Order.** Anything else done with the WAL (a read, a write elsewhere, a sync, its size,
//!   a truncation, a file control, closing it) first writes what is gathered; a failure there
//!   is an I/O error, which rolls the transaction back.
//! - **Crashes.** Frames still gathered belong to a transaction that has not committed; a
//!   crash loses them as it would lose frames SQLite had not yet written.
//! - **Padding.** On a device without power-safe overwrite SQLite pads a commit to a sector
//!   and splits frames around a sync; there a WAL file gathers nothing.
//!
//! Every other file is the default VFS's own; a database file only tells its WAL when the
//! write lock is released.

use std::ffi::{CStr, c_int, c_void};
use std::mem::size_of;
use std::ptr;
use std::sync::{Mutex, OnceLock};

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

/// The WAL's write lock among a database file's shared-memory locks.
const WAL_WRITE_LOCK: c_int = 0;

/// Registers the VFS once per process; later calls return the first outcome.
pub(super) fn register() -> Result<&'static CStr, String> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    // SAFETY: see `register_once`.
    REGISTERED.get_or_init(|| unsafe { register_once() }).clone().map(|()| NAME)
}

/// The default VFS, which every call is passed on to, and our WAL files' methods.
static BASE: OnceLock<Base> = OnceLock::new();

struct Base {
    vfs: *mut ffi::sqlite3_vfs,
    wal_methods: ffi::sqlite3_io_methods,
}

// SAFETY: SQLite's VFS objects are meant to be shared by every thread: the default VFS lives
// as long as the process and is never changed once registered.
unsafe impl Send for Base {}
unsafe impl Sync for Base {}

/// What our files start with: SQLite's handle (its methods are ours), then the default
/// VFS's handle, which lives in the bytes that follow the whole struct.
#[repr(C)]
struct Wrapped {
    handle: ffi::sqlite3_file,
    inner: *mut ffi::sqlite3_file,
}

/// A WAL file.
#[repr(C)]
struct WalFile {
    wrapped: Wrapped,
    /// Its database's file, which tells it when the write lock is released (null once the
    /// database file closed).
    db: *mut DbFile,
    /// Whether it gathers at all (not on a device where SQLite pads commits).
    gathers: bool,
    /// Bytes appended but not yet written, and where they start in the file.
    gathered: Vec<u8>,
    start: i64,
    /// Where the last write ended: a write that starts there continues an append.
    last_end: i64,
    /// Whether the last frame header written marks a commit: its page ends a transaction.
    in_commit_frame: bool,
}

/// A main database file.
#[repr(C)]
struct DbFile {
    wrapped: Wrapped,
    /// Its open WAL file, if any.
    wal: *mut WalFile,
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
    let wrapper = size_of::<WalFile>().max(size_of::<DbFile>());
    let Ok(size) = c_int::try_from(wrapper + vfs.szOsFile as usize) else {
        return Err("the default VFS's file handle is too large".into());
    };
    // Everything but opening is the default VFS's own (its `pAppData` included, which its
    // methods read).
    vfs.szOsFile = size;
    vfs.zName = NAME.as_ptr();
    vfs.pNext = ptr::null_mut();
    vfs.xOpen = Some(open);
    // Version 1: SQLite asks a WAL file for nothing of versions 2 and 3 (shared memory is
    // its database file's, and it never maps a WAL into memory).
    let wal_methods = ffi::sqlite3_io_methods {
        iVersion: 1,
        xClose: Some(wal_close),
        xRead: Some(wal_read),
        xWrite: Some(wal_write),
        xTruncate: Some(wal_truncate),
        xSync: Some(wal_sync),
        xFileSize: Some(wal_file_size),
        xLock: Some(lock),
        xUnlock: Some(unlock),
        xCheckReservedLock: Some(check_reserved_lock),
        xFileControl: Some(wal_file_control),
        xSectorSize: Some(sector_size),
        xDeviceCharacteristics: Some(device_characteristics),
        xShmMap: None,
        xShmLock: None,
        xShmBarrier: None,
        xShmUnmap: None,
        xFetch: None,
        xUnfetch: None,
    };
    if BASE.set(Base { vfs: base, wal_methods }).is_err() {
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

/// Our methods for a database file whose default-VFS methods are `inner`: the same set
/// (same version, same methods present), each passed on, the write lock's release noticed.
fn db_methods(inner: &'static ffi::sqlite3_io_methods) -> &'static ffi::sqlite3_io_methods {
    let key = ptr::from_ref(inner) as usize;
    let mut tables = lock_tables();
    if let Some((_, ours)) = tables.iter().find(|(k, _)| *k == key) {
        return ours;
    }
    let ours: &'static ffi::sqlite3_io_methods = Box::leak(Box::new(ffi::sqlite3_io_methods {
        iVersion: inner.iVersion,
        xClose: inner.xClose.and(Some(db_close)),
        xRead: inner.xRead.and(Some(read)),
        xWrite: inner.xWrite.and(Some(write)),
        xTruncate: inner.xTruncate.and(Some(truncate)),
        xSync: inner.xSync.and(Some(sync)),
        xFileSize: inner.xFileSize.and(Some(file_size)),
        xLock: inner.xLock.and(Some(lock)),
        xUnlock: inner.xUnlock.and(Some(db_unlock)),
        xCheckReservedLock: inner.xCheckReservedLock.and(Some(check_reserved_lock)),
        xFileControl: inner.xFileControl.and(Some(file_control)),
        xSectorSize: inner.xSectorSize.and(Some(sector_size)),
        xDeviceCharacteristics: inner.xDeviceCharacteristics.and(Some(device_characteristics)),
        xShmMap: inner.xShmMap.and(Some(shm_map)),
        xShmLock: inner.xShmLock.and(Some(db_shm_lock)),
        xShmBarrier: inner.xShmBarrier.and(Some(shm_barrier)),
        xShmUnmap: inner.xShmUnmap.and(Some(shm_unmap)),
        xFetch: inner.xFetch.and(Some(fetch)),
        xUnfetch: inner.xUnfetch.and(Some(unfetch)),
    }));
    tables.push((key, ours));
    ours
}

/// Our database files' methods, by the default VFS's methods they pass on to: one table for
/// each of those (a handful, one per locking style).
static DB_TABLES: Mutex<Vec<(usize, &'static ffi::sqlite3_io_methods)>> = Mutex::new(Vec::new());

fn lock_tables() -> std::sync::MutexGuard<'static, Vec<(usize, &'static ffi::sqlite3_io_methods)>> {
    crate::sync::lock(&DB_TABLES)
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
    let wraps = flags & (ffi::SQLITE_OPEN_WAL | ffi::SQLITE_OPEN_MAIN_DB) != 0;
    // SAFETY: SQLite gives `szOsFile` bytes, 8-byte aligned: our struct, then the default
    // VFS's handle (our structs' sizes are multiples of their 8-byte alignment). A file we do
    // not wrap is the default VFS's handle alone, at the start.
    let inner = if wraps {
        unsafe { file.cast::<u8>().add(size_of::<WalFile>().max(size_of::<DbFile>())).cast() }
    } else {
        file
    };
    // SAFETY: the default VFS's own `xOpen`, given its own VFS and SQLite's arguments.
    let rc = match unsafe { (*base.vfs).xOpen } {
        Some(open) => unsafe { open(base.vfs, name, inner, flags, out_flags) },
        None => ffi::SQLITE_CANTOPEN,
    };
    if !wraps {
        return rc;
    }
    // SAFETY: `file` is ours to fill: SQLite calls no method of a handle whose open failed
    // and whose methods are null.
    unsafe {
        if rc != ffi::SQLITE_OK {
            (*file).pMethods = ptr::null();
            return rc;
        }
        let wrapped = |methods| Wrapped { handle: ffi::sqlite3_file { pMethods: methods }, inner };
        if flags & ffi::SQLITE_OPEN_MAIN_DB != 0 {
            let methods = db_methods(&*(*inner).pMethods);
            file.cast::<DbFile>().write(DbFile { wrapped: wrapped(methods), wal: ptr::null_mut() });
            return ffi::SQLITE_OK;
        }
        let db = database_of(name);
        let wal = file.cast::<WalFile>();
        wal.write(WalFile {
            wrapped: wrapped(&base.wal_methods),
            db,
            gathers: !db.is_null() && power_safe(inner) && power_safe((*db).wrapped.inner),
            gathered: Vec::new(),
            start: 0,
            last_end: 0,
            in_commit_frame: false,
        });
        if !db.is_null() {
            (*db).wal = wal;
        }
    }
    ffi::SQLITE_OK
}

/// The database file of the WAL named `name`, if it is ours.
///
/// # Safety
/// `name` is the name SQLite passed to `xOpen` for a WAL file.
unsafe fn database_of(name: ffi::sqlite3_filename) -> *mut DbFile {
    // SAFETY: SQLite answers this for a journal's or WAL's name during its `xOpen`.
    let db = unsafe { ffi::sqlite3_database_file_object(name) };
    // Ours only if its methods are one of our database tables (always, in practice: a WAL is
    // opened through its database's VFS).
    // SAFETY: a live file handle.
    let methods = if db.is_null() { ptr::null() } else { unsafe { (*db).pMethods } };
    let ours = lock_tables().iter().any(|(_, table)| ptr::eq(*table, methods));
    if ours { db.cast() } else { ptr::null_mut() }
}

/// Whether SQLite writes frames to `file` without padding them to a sector.
///
/// # Safety
/// `file` is an open handle of the default VFS.
unsafe fn power_safe(file: *mut ffi::sqlite3_file) -> bool {
    // SAFETY: per the contract.
    let characteristics = unsafe { (*(*file).pMethods).xDeviceCharacteristics.map_or(0, |f| f(file)) };
    characteristics & ffi::SQLITE_IOCAP_POWERSAFE_OVERWRITE != 0
}

impl Wrapped {
    /// # Safety
    /// `file` is an open handle our `open` made (a WAL or a database file).
    unsafe fn of<'a>(file: *mut ffi::sqlite3_file) -> &'a Wrapped {
        // SAFETY: per the contract: both structs start with `Wrapped`.
        unsafe { &*file.cast::<Wrapped>() }
    }

    /// Makes `call` on the default VFS's handle.
    fn pass(&self, call: impl FnOnce(&ffi::sqlite3_io_methods, *mut ffi::sqlite3_file) -> Option<c_int>) -> c_int {
        // SAFETY: the default VFS set the methods of the handle it opened; they are static.
        call(unsafe { &*(*self.inner).pMethods }, self.inner).unwrap_or(ffi::SQLITE_IOERR)
    }
}

impl WalFile {
    /// # Safety
    /// `file` is a WAL handle our `open` made, not yet closed; SQLite uses a handle (and its
    /// database's) from one thread at a time.
    unsafe fn of<'a>(file: *mut ffi::sqlite3_file) -> &'a mut WalFile {
        // SAFETY: per the contract.
        unsafe { &mut *file.cast::<WalFile>() }
    }

    /// Writes what is gathered. Written or not, it is then dropped: a failure fails the
    /// transaction those frames belong to.
    fn flush(&mut self) -> c_int {
        let mut rc = ffi::SQLITE_OK;
        let mut offset = self.start;
        for chunk in self.gathered.chunks(MAX_WRITE) {
            rc = self.write_through(chunk, offset);
            if rc != ffi::SQLITE_OK {
                break;
            }
            offset += chunk.len() as i64;
        }
        self.gathered.clear();
        // The room stays for the next commit, up to the bound.
        self.gathered.shrink_to(MAX_GATHERED);
        rc
    }

    /// [`WalFile::flush`] before another operation: any failure is an I/O error, which
    /// rolls back the transaction whose frames were lost (a full disk would roll back only
    /// a statement).
    fn flush_before(&mut self) -> c_int {
        match self.flush() {
            ffi::SQLITE_OK => ffi::SQLITE_OK,
            _ => ffi::SQLITE_IOERR_WRITE,
        }
    }

    fn write_through(&self, data: &[u8], offset: i64) -> c_int {
        // SAFETY: the default VFS's write on its own handle; `data` holds its length.
        self.wrapped
            .pass(|m, inner| m.xWrite.map(|f| unsafe { f(inner, data.as_ptr().cast(), data.len() as c_int, offset) }))
    }

    /// Gathers `data` if it continues an append, else writes it at once, after what is
    /// gathered (a frame overwritten within its transaction, checksums rewritten).
    fn write(&mut self, data: &[u8], offset: i64) -> c_int {
        if !self.gathers {
            return self.write_through(data, offset);
        }
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
            return self.write_through(data, offset);
        }
        if self.gathered.try_reserve(data.len()).is_err() {
            return ffi::SQLITE_NOMEM;
        }
        if self.gathered.is_empty() {
            self.start = offset;
        }
        self.gathered.extend_from_slice(data);
        let commit_written = self.in_commit_frame && data.len() != FRAME_HEADER;
        if commit_written || self.gathered.len() >= MAX_GATHERED { self.flush() } else { ffi::SQLITE_OK }
    }
}

/// Writes what `file` gathered, then passes the call on with `then` (one of the methods
/// below that pass calls on as they are).
///
/// # Safety
/// `file` is an open WAL handle of ours.
unsafe fn flushed(file: *mut ffi::sqlite3_file, then: impl FnOnce() -> c_int) -> c_int {
    // SAFETY: per the contract.
    match unsafe { WalFile::of(file) }.flush_before() {
        ffi::SQLITE_OK => then(),
        rc => rc,
    }
}

/// Makes `call` on the default VFS's handle of `file`, a WAL or a database file of ours.
///
/// # Safety
/// `file` is an open handle our `open` made.
unsafe fn passed(
    file: *mut ffi::sqlite3_file,
    call: impl FnOnce(&ffi::sqlite3_io_methods, *mut ffi::sqlite3_file) -> Option<c_int>,
) -> c_int {
    // SAFETY: per the contract.
    unsafe { Wrapped::of(file) }.pass(call)
}

// The WAL file's own methods.

unsafe extern "C" fn wal_close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: SQLite closes a handle `open` made, once; its database file, if still open,
    // forgets it.
    unsafe {
        let wal = WalFile::of(file);
        let written = wal.flush_before();
        if !wal.db.is_null() {
            (*wal.db).wal = ptr::null_mut();
        }
        let closed = wal.wrapped.pass(|m, inner| m.xClose.map(|f| f(inner)));
        ptr::drop_in_place(file.cast::<WalFile>());
        if written != ffi::SQLITE_OK { written } else { closed }
    }
}

unsafe extern "C" fn wal_read(file: *mut ffi::sqlite3_file, buf: *mut c_void, len: c_int, offset: i64) -> c_int {
    // SAFETY: SQLite's arguments, passed on (as in every method below).
    unsafe { flushed(file, || read(file, buf, len, offset)) }
}

unsafe extern "C" fn wal_write(file: *mut ffi::sqlite3_file, buf: *const c_void, len: c_int, offset: i64) -> c_int {
    // SAFETY: SQLite passes `len` readable bytes at `buf`.
    unsafe {
        let data = std::slice::from_raw_parts(buf.cast::<u8>(), len.max(0) as usize);
        WalFile::of(file).write(data, offset)
    }
}

unsafe extern "C" fn wal_truncate(file: *mut ffi::sqlite3_file, size: i64) -> c_int {
    unsafe {
        let rc = flushed(file, || truncate(file, size));
        let wal = WalFile::of(file);
        wal.last_end = wal.last_end.min(size);
        rc
    }
}

unsafe extern "C" fn wal_sync(file: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    unsafe { flushed(file, || sync(file, flags)) }
}

unsafe extern "C" fn wal_file_size(file: *mut ffi::sqlite3_file, size: *mut i64) -> c_int {
    unsafe { flushed(file, || file_size(file, size)) }
}

unsafe extern "C" fn wal_file_control(file: *mut ffi::sqlite3_file, op: c_int, arg: *mut c_void) -> c_int {
    unsafe { flushed(file, || file_control(file, op, arg)) }
}

// The database file's own methods.

unsafe extern "C" fn db_close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: SQLite closes a handle `open` made, once (its WAL closes first; if not, the WAL
    // forgets it).
    unsafe {
        let db = file.cast::<DbFile>();
        if !(*db).wal.is_null() {
            (*(*db).wal).db = ptr::null_mut();
        }
        passed(file, |m, inner| m.xClose.map(|f| f(inner)))
    }
}

unsafe extern "C" fn db_shm_lock(file: *mut ffi::sqlite3_file, offset: c_int, n: c_int, flags: c_int) -> c_int {
    // SAFETY: a database handle of ours; its WAL, if open, is used from this thread too.
    unsafe {
        let db = file.cast::<DbFile>();
        let releases_write_lock = offset <= WAL_WRITE_LOCK
            && WAL_WRITE_LOCK < offset + n
            && flags == ffi::SQLITE_SHM_UNLOCK | ffi::SQLITE_SHM_EXCLUSIVE;
        if releases_write_lock {
            flush_wal(db);
        }
        passed(file, |m, inner| m.xShmLock.map(|f| f(inner, offset, n, flags)))
    }
}

unsafe extern "C" fn db_unlock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    // SAFETY: as `db_shm_lock`. In exclusive locking mode SQLite keeps the WAL's write lock
    // and lets go of the database file's lock instead.
    unsafe {
        flush_wal(file.cast());
        passed(file, |m, inner| m.xUnlock.map(|f| f(inner, level)))
    }
}

/// Writes what the WAL of `db` gathered, as its connection lets go of a lock: only a
/// transaction that did not commit leaves anything (a commit writes all its frames). Written
/// now, as SQLite would have, or lost if that fails, which nothing reads; either way nothing
/// is written once another writer may append.
///
/// # Safety
/// `db` is an open database handle of ours; its WAL, if open, is used from this thread too.
unsafe fn flush_wal(db: *mut DbFile) {
    // SAFETY: per the contract.
    unsafe {
        if !(*db).wal.is_null() {
            let _ = (*(*db).wal).flush();
        }
    }
}

// Methods passed on as they are.

unsafe extern "C" fn read(file: *mut ffi::sqlite3_file, buf: *mut c_void, len: c_int, offset: i64) -> c_int {
    unsafe { passed(file, |m, inner| m.xRead.map(|f| f(inner, buf, len, offset))) }
}

unsafe extern "C" fn write(file: *mut ffi::sqlite3_file, buf: *const c_void, len: c_int, offset: i64) -> c_int {
    unsafe { passed(file, |m, inner| m.xWrite.map(|f| f(inner, buf, len, offset))) }
}

unsafe extern "C" fn truncate(file: *mut ffi::sqlite3_file, size: i64) -> c_int {
    unsafe { passed(file, |m, inner| m.xTruncate.map(|f| f(inner, size))) }
}

unsafe extern "C" fn sync(file: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    unsafe { passed(file, |m, inner| m.xSync.map(|f| f(inner, flags))) }
}

unsafe extern "C" fn file_size(file: *mut ffi::sqlite3_file, size: *mut i64) -> c_int {
    unsafe { passed(file, |m, inner| m.xFileSize.map(|f| f(inner, size))) }
}

unsafe extern "C" fn lock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    unsafe { passed(file, |m, inner| m.xLock.map(|f| f(inner, level))) }
}

unsafe extern "C" fn unlock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    unsafe { passed(file, |m, inner| m.xUnlock.map(|f| f(inner, level))) }
}

unsafe extern "C" fn check_reserved_lock(file: *mut ffi::sqlite3_file, out: *mut c_int) -> c_int {
    unsafe { passed(file, |m, inner| m.xCheckReservedLock.map(|f| f(inner, out))) }
}

unsafe extern "C" fn file_control(file: *mut ffi::sqlite3_file, op: c_int, arg: *mut c_void) -> c_int {
    unsafe { passed(file, |m, inner| m.xFileControl.map(|f| f(inner, op, arg))) }
}

unsafe extern "C" fn sector_size(file: *mut ffi::sqlite3_file) -> c_int {
    unsafe { passed(file, |m, inner| m.xSectorSize.map(|f| f(inner))) }
}

unsafe extern "C" fn device_characteristics(file: *mut ffi::sqlite3_file) -> c_int {
    unsafe { passed(file, |m, inner| m.xDeviceCharacteristics.map(|f| f(inner))) }
}

unsafe extern "C" fn shm_map(
    file: *mut ffi::sqlite3_file,
    region: c_int,
    size: c_int,
    extend: c_int,
    out: *mut *mut c_void,
) -> c_int {
    unsafe { passed(file, |m, inner| m.xShmMap.map(|f| f(inner, region, size, extend, out))) }
}

unsafe extern "C" fn shm_barrier(file: *mut ffi::sqlite3_file) {
    unsafe {
        passed(file, |m, inner| {
            m.xShmBarrier.map(|f| {
                f(inner);
                ffi::SQLITE_OK
            })
        });
    }
}

unsafe extern "C" fn shm_unmap(file: *mut ffi::sqlite3_file, delete: c_int) -> c_int {
    unsafe { passed(file, |m, inner| m.xShmUnmap.map(|f| f(inner, delete))) }
}

unsafe extern "C" fn fetch(file: *mut ffi::sqlite3_file, offset: i64, len: c_int, out: *mut *mut c_void) -> c_int {
    unsafe { passed(file, |m, inner| m.xFetch.map(|f| f(inner, offset, len, out))) }
}

unsafe extern "C" fn unfetch(file: *mut ffi::sqlite3_file, offset: i64, page: *mut c_void) -> c_int {
    unsafe { passed(file, |m, inner| m.xUnfetch.map(|f| f(inner, offset, page))) }
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
    fn frames_of_a_rolled_back_transaction_never_overwrite_another_writers_commits() {
        // A transaction that wrote frames before its commit (a 4-page cache) and then rolled
        // back leaves them past the WAL's end, where the next writer commits: here another
        // connection, as another process would.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        let spiller = gathering(&path);
        spiller.execute_batch("CREATE TABLE t (n INTEGER PRIMARY KEY, body BLOB)").unwrap();
        spiller.pragma_update(None, "cache_size", 4).unwrap();
        // The database's first page in the database file, not the WAL: a rollback then reads
        // nothing back from the WAL.
        spiller.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)").unwrap();
        let other = gathering(&path);
        let tx = spiller.unchecked_transaction().unwrap();
        // Rows of 20 KB: their overflow pages are written out and never read back.
        for n in 0..30i64 {
            tx.execute("INSERT INTO t VALUES (?1, ?2)", params![n, vec![0xAA_u8; 20_000]]).unwrap();
        }
        tx.rollback().unwrap();
        for n in 0..100i64 {
            other.execute("INSERT INTO t VALUES (?1, ?2)", params![n, vec![n as u8; 3000]]).unwrap();
        }
        // The first connection reads again (and closes): nothing it held may land now.
        let rows: i64 = spiller.query_row("SELECT count(*) FROM t", [], |r| r.get(0)).unwrap();
        assert_eq!(rows, 100);
        drop(spiller);
        let rows = read_plainly(&path);
        assert_eq!(rows.len(), 100);
        assert!(rows.iter().all(|(n, body)| *body == vec![*n as u8; 3000]), "a committed row was overwritten");
    }

    #[test]
    fn frames_rolled_back_in_exclusive_locking_mode_never_outlive_its_end() {
        // In exclusive locking mode SQLite never releases the WAL's write lock: leaving the
        // mode, it drops its lock on the database file instead.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        let spiller = gathering(&path);
        spiller.execute_batch("CREATE TABLE t (n INTEGER PRIMARY KEY, body BLOB)").unwrap();
        spiller.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)").unwrap();
        spiller.pragma_update(None, "cache_size", 4).unwrap();
        spiller.pragma_update(None, "locking_mode", "EXCLUSIVE").unwrap();
        let tx = spiller.unchecked_transaction().unwrap();
        for n in 0..30i64 {
            tx.execute("INSERT INTO t VALUES (?1, ?2)", params![n, vec![0xAA_u8; 20_000]]).unwrap();
        }
        tx.rollback().unwrap();
        spiller.pragma_update(None, "locking_mode", "NORMAL").unwrap();
        spiller.execute_batch("BEGIN IMMEDIATE; COMMIT").unwrap();
        let other = gathering(&path);
        for n in 0..100i64 {
            other.execute("INSERT INTO t VALUES (?1, ?2)", params![n, vec![n as u8; 3000]]).unwrap();
        }
        let rows: i64 = spiller.query_row("SELECT count(*) FROM t", [], |r| r.get(0)).unwrap();
        assert_eq!(rows, 100);
        drop(spiller);
        let rows = read_plainly(&path);
        assert!(rows.iter().all(|(n, body)| *body == vec![*n as u8; 3000]), "a committed row was overwritten");
    }

    #[test]
    fn a_wal_that_sqlite_pads_to_sectors_gathers_nothing() {
        // Without power-safe overwrite SQLite pads a commit to a sector and may split a frame
        // around a sync: frames are then written as SQLite writes them.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        let uri = format!("file:{}?psow=0", path.display());
        let conn = gathering(std::path::Path::new(&uri));
        conn.pragma_update(None, "synchronous", "FULL").unwrap();
        conn.execute_batch("CREATE TABLE t (n INTEGER PRIMARY KEY, body BLOB)").unwrap();
        let before = writes_by_this_thread();
        let tx = conn.unchecked_transaction().unwrap();
        for n in 0..64i64 {
            tx.execute("INSERT INTO t VALUES (?1, ?2)", params![n, vec![n as u8; 4000]]).unwrap();
        }
        tx.commit().unwrap();
        let writes = writes_by_this_thread() - before;
        assert!(writes >= 128, "{writes} write calls: frames were gathered on a padded WAL");
        assert_eq!(read_plainly(&path).len(), 64);
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
