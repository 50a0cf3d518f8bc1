//! wasmtime engines, the epoch ticker that enforces deadlines, and the on-disk cache of
//! compiled plugins.
//!
//! wasmtime fixes the wasm stack size per engine, so the runtime keeps one engine per stack
//! size in use (almost always just the default one); everything else that varies per call
//! (fuel, deadline, memory, tables, instances) is set per store.

use std::collections::HashMap;
use std::hash::Hasher;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use super::policy::{MAX_INSTANCES, MAX_MEMORY_MIB, MAX_TABLE_ELEMENTS};
use crate::sync::lock;

/// How often the epoch advances: the resolution of call deadlines.
pub const EPOCH_TICK: Duration = Duration::from_millis(1);

/// Longest an idle ticker waits before it looks again: a call or the engines' end wakes it
/// at once, so this only bounds what a missed wake-up could cost.
const IDLE_RECHECK: Duration = Duration::from_secs(10);

/// Engine-wide switches. Production runs use the defaults; the benchmarks flip them to
/// measure what each costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EngineOptions {
    /// Count fuel (needed for fuel limits).
    pub fuel: bool,
    /// Interrupt guests at their deadline by epoch (needed to stop a guest spinning in wasm).
    pub epochs: bool,
    /// Pre-reserve instance slots (cheaper instantiation) instead of allocating per call.
    pub pooling: bool,
    /// Calls that may be in flight at once; sizes the pool.
    pub max_concurrent_calls: u32,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions { fuel: true, epochs: true, pooling: true, max_concurrent_calls: 1000 }
    }
}

/// One engine per wasm stack size, sharing an epoch ticker.
pub(crate) struct Engines {
    options: EngineOptions,
    by_stack: Mutex<HashMap<u64, Engine>>,
    ticking: Arc<Mutex<Vec<Engine>>>,
    calls: Arc<CallsInFlight>,
}

/// The stores alive now, each a call in flight: the ticker advances the epochs only while
/// there are some, and sleeps otherwise (an idle server woke 1,000 times a second).
#[derive(Default)]
struct CallsInFlight {
    count: AtomicUsize,
    /// Whether the ticker waits (or is about to) for a call: only then does a call wake it,
    /// so that a call pays no system call while the ticker runs.
    waiting: AtomicBool,
    /// The engines were dropped: the ticker ends.
    closed: AtomicBool,
    /// Held while the ticker decides to wait and while a call or the engines' end wakes it,
    /// so that the wake-up cannot fall between the two.
    idle: Mutex<()>,
    wake: Condvar,
    /// Ticks so far (for tests).
    ticks: AtomicU64,
}

/// Counts a call in flight for as long as it lives: whatever holds a store of an engine
/// with epoch interruption must hold one, or the guest gets no deadline while nothing else
/// runs.
pub(crate) struct CallTicking(Arc<CallsInFlight>);

impl Drop for CallTicking {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for Engines {
    fn drop(&mut self) {
        // An idle ticker would otherwise sleep on for up to `IDLE_RECHECK` (a fuzz target
        // makes a runtime per input).
        self.calls.closed.store(true, Ordering::SeqCst);
        let _idle = lock(&self.calls.idle);
        self.calls.wake.notify_one();
    }
}

impl Engines {
    pub fn new(options: EngineOptions) -> Engines {
        let ticking = Arc::new(Mutex::new(Vec::new()));
        let calls = Arc::new(CallsInFlight::default());
        if options.epochs {
            spawn_ticker(Arc::downgrade(&ticking), calls.clone());
        }
        Engines { options, by_stack: Mutex::new(HashMap::new()), ticking, calls }
    }

    /// Keeps the epochs advancing while the returned guard lives (see [`CallTicking`]).
    pub fn call_started(&self) -> CallTicking {
        // SeqCst here and in `wait_for_one`: either the ticker sees this count, or this
        // call sees it waiting (and wakes it).
        self.calls.count.fetch_add(1, Ordering::SeqCst);
        if self.calls.waiting.load(Ordering::SeqCst) {
            let _idle = lock(&self.calls.idle);
            self.calls.wake.notify_one();
        }
        CallTicking(self.calls.clone())
    }

    /// Epoch ticks so far.
    #[cfg(test)]
    fn ticks(&self) -> u64 {
        self.calls.ticks.load(Ordering::Relaxed)
    }

    pub fn options(&self) -> EngineOptions {
        self.options
    }

    /// The engine for guests with `stack_kib` of wasm stack.
    pub fn get(&self, stack_kib: u64) -> Result<Engine, String> {
        let mut engines = lock(&self.by_stack);
        if let Some(engine) = engines.get(&stack_kib) {
            return Ok(engine.clone());
        }
        let engine = Engine::new(&self.config(stack_kib)).map_err(|e| format!("{e:#}"))?;
        engines.insert(stack_kib, engine.clone());
        lock(&self.ticking).push(engine.clone());
        Ok(engine)
    }

    fn config(&self, stack_kib: u64) -> Config {
        let stack = (stack_kib as usize) << 10;
        let mut config = Config::new();
        config
            .wasm_component_model(true)
            .concurrency_support(false)
            .consume_fuel(self.options.fuel)
            .epoch_interruption(self.options.epochs)
            .max_wasm_stack(stack)
            // Host functions (WASI, the store) run on the same fiber stack as the guest.
            .async_stack_size(stack + (1 << 20))
            .wasm_backtrace_max_frames(std::num::NonZeroUsize::new(32));
        // `SAGABOX_PERFMAP=1` names the guests' compiled functions for `perf report`
        // (/tmp/perf-<pid>.map), so a profile shows where the time inside a plugin goes.
        if std::env::var_os("SAGABOX_PERFMAP").is_some_and(|v| v == "1") {
            config.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        if self.options.pooling {
            let slots = self.options.max_concurrent_calls;
            let mut pool = PoolingAllocationConfig::new();
            pool.total_component_instances(slots)
                .total_core_instances(slots * 8)
                .total_memories(slots * 2)
                .total_tables(slots * 4)
                .total_stacks(slots)
                .max_core_instances_per_component(MAX_INSTANCES as u32)
                .max_memories_per_component(MAX_INSTANCES as u32)
                .max_tables_per_component(MAX_INSTANCES as u32)
                .max_memory_size((MAX_MEMORY_MIB as usize) << 20)
                .table_elements(MAX_TABLE_ELEMENTS as usize)
                .max_unused_warm_slots(64)
                .decommit_batch_size(32);
            slot_reset(&mut pool, swap_is_on());
            config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        }
        config
    }
}

/// How a pooled slot is reset for its next call.
///
/// Without swap: by rewriting the pages its calls have written (its private resident pages,
/// found with PAGEMAP_SCAN, Linux 6.7+; memset/madvise elsewhere) instead of unmapping them,
/// so the next call on the slot does not fault them in again. They stay resident, so every
/// reset of a slot rewrites every page any of its calls wrote, up to this bound (1 MiB
/// measured no different on tau-bench: BENCHMARKS item 22).
///
/// With swap: wasmtime 48's scan looks only at pages in memory, so a page a call wrote that
/// the kernel swapped out before the reset is neither rewritten nor unmapped, and the slot's
/// next call reads it (test below). Slots are then reset without the scan: the first 64 KiB
/// rewritten, the rest unmapped, swapped pages included (a small call costs about 1.8 times
/// as much: BENCHMARKS item 46; 0 and 1 MiB measured no better).
fn slot_reset(pool: &mut PoolingAllocationConfig, swap: bool) {
    if swap {
        tracing::info!(
            "swap is on: pooled slots are reset without PAGEMAP_SCAN, so that no page of a call reaches the next"
        );
        pool.pagemap_scan(wasmtime::Enabled::No).linear_memory_keep_resident(64 << 10).table_keep_resident(64 << 10);
    } else {
        pool.pagemap_scan(wasmtime::Enabled::Auto).linear_memory_keep_resident(16 << 20).table_keep_resident(1 << 20);
    }
}

/// Whether this process's pages can be swapped out: `/proc/swaps` lists a device or a file,
/// and no cgroup (v2) of the process caps its swap at 0, as container runtimes often do.
/// Read when an engine is made; swap turned on later is seen by the next process.
pub fn swap_is_on() -> bool {
    let listed =
        std::fs::read_to_string("/proc/swaps").is_ok_and(|swaps| swaps.lines().skip(1).any(|l| !l.trim().is_empty()));
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    listed && !swap_capped_at_zero(Path::new("/sys/fs/cgroup"), &cgroup)
}

/// Whether `memory.swap.max` is 0 in the cgroup v2 that `proc_self_cgroup` (the text of
/// `/proc/self/cgroup`) names under `root`, or in one of its ancestors: the smallest cap on
/// the way up is the one that holds.
fn swap_capped_at_zero(root: &Path, proc_self_cgroup: &str) -> bool {
    let Some(path) = proc_self_cgroup.lines().find_map(|l| l.strip_prefix("0::")) else { return false };
    let mut dir = root.join(path.trim_start_matches('/'));
    loop {
        if std::fs::read_to_string(dir.join("memory.swap.max")).is_ok_and(|max| max.trim() == "0") {
            return true;
        }
        if dir == root || !dir.pop() {
            return false;
        }
    }
}

/// Advances every live engine's epoch each tick while calls are in flight, until the
/// engines are dropped.
fn spawn_ticker(engines: Weak<Mutex<Vec<Engine>>>, calls: Arc<CallsInFlight>) {
    let spawned = std::thread::Builder::new().name("sagabox-epoch".into()).spawn(move || {
        while !calls.closed.load(Ordering::SeqCst) {
            if !calls.wait_for_one() {
                continue;
            }
            let Some(engines) = engines.upgrade() else { break };
            for engine in lock(&engines).iter() {
                engine.increment_epoch();
            }
            drop(engines);
            calls.ticks.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(EPOCH_TICK);
        }
    });
    if let Err(e) = spawned {
        tracing::error!("cannot start the epoch ticker, deadlines will not interrupt guests: {e}");
    }
}

impl CallsInFlight {
    /// Whether a call is in flight, waiting for one up to [`IDLE_RECHECK`].
    fn wait_for_one(&self) -> bool {
        if self.count.load(Ordering::SeqCst) > 0 {
            return true;
        }
        let idle = lock(&self.idle);
        self.waiting.store(true, Ordering::SeqCst);
        if self.count.load(Ordering::SeqCst) == 0 && !self.closed.load(Ordering::SeqCst) {
            drop(self.wake.wait_timeout(idle, IDLE_RECHECK));
        }
        self.waiting.store(false, Ordering::SeqCst);
        self.count.load(Ordering::SeqCst) > 0
    }
}

/// Where a compiled plugin came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CompileSource {
    /// Compiled now (and stored in the cache, if there is one).
    Compiled,
    /// Loaded from the cache.
    Cached,
}

/// What every cache entry ends with: the SHA-256 of the serialized component before it, then
/// a format tag. At the end, so that the file from its first byte is wasmtime's own artifact,
/// which wasmtime maps rather than copies: only the code and data pages that calls touch are
/// resident, and shared with every other process using the entry. The hash catches corruption
/// (bit flips, zeroed runs, truncation), not forgery: whoever can write the directory can
/// write a matching hash, which is why the cache only uses a directory that no other user can
/// write. (Entries of the first format carried this at the start; they read as another
/// format's and are rewritten.)
const ENTRY_MAGIC: &[u8; 8] = b"sgbxc\0\0\x02";
const ENTRY_TRAILER: usize = 32 + ENTRY_MAGIC.len();

/// The largest cache entry read; anything bigger is not one this cache wrote.
const MAX_ENTRY_BYTES: u64 = 2 << 30;

/// Compiled plugins on disk, keyed by the plugin's SHA-256 and the engine's configuration.
#[derive(Clone, Debug)]
pub struct CompileCache {
    dir: Option<PathBuf>,
}

impl CompileCache {
    /// A cache in `dir`, or no cache. The directory is created (mode 0700) if missing; one
    /// that another user owns or that group or others may write is not used (with a warning
    /// once per process), since its entries run as machine code in this process.
    pub fn new(dir: Option<PathBuf>) -> CompileCache {
        CompileCache { dir: dir.and_then(trusted_dir) }
    }

    /// The directory in use, if any.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The default location: `$SAGABOX_CACHE_DIR`, else `$XDG_CACHE_HOME/sagabox`, else
    /// `~/.cache/sagabox`.
    pub fn default_dir() -> Option<PathBuf> {
        if let Some(dir) = std::env::var_os("SAGABOX_CACHE_DIR") {
            return Some(PathBuf::from(dir));
        }
        if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
            return Some(PathBuf::from(dir).join("sagabox"));
        }
        std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache").join("sagabox"))
    }

    /// The compiled form of `wasm` for `engine`, from the cache or compiled now. An entry
    /// that is absent, not a regular file, fails its integrity check or does not load (stale,
    /// another wasmtime) counts as a miss: the plugin is compiled and the entry rewritten.
    pub fn load_or_compile(
        &self,
        engine: &Engine,
        wasm: &[u8],
        sha256: &str,
    ) -> wasmtime::Result<(Component, CompileSource)> {
        let Some(path) = self.dir.as_ref().map(|dir| dir.join(entry_name(engine, sha256))) else {
            return Ok((compile(engine, wasm)?, CompileSource::Compiled));
        };
        match open_entry(&path).and_then(|entry| entry.map(|file| deserialize(engine, &file, &path)).transpose()) {
            Ok(Some(component)) => return Ok((component, CompileSource::Cached)),
            Ok(None) => {}
            Err(Unusable::OtherFormat) => {
                tracing::debug!("rewriting cache entry {} (another format)", path.display())
            }
            Err(Unusable::Broken(e)) => tracing::warn!("ignoring unusable cache entry {}: {e}", path.display()),
        }
        let component = compile(engine, wasm)?;
        if let Err(e) = store_entry(&path, &component.serialize()?) {
            tracing::warn!("cannot write cache entry {}: {e}", path.display());
        }
        Ok((component, CompileSource::Compiled))
    }
}

/// The log target of compile progress, which the CLI shows by default.
pub const COMPILE_PROGRESS: &str = "sagabox::compile";

/// How often a compile still running says so.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Compiles `wasm`, saying so (a large plugin takes tens of seconds on its first load) and,
/// while it lasts, every [`PROGRESS_EVERY`] for how long: info events of target
/// [`COMPILE_PROGRESS`], inside the caller's span (which names the plugin).
fn compile(engine: &Engine, wasm: &[u8]) -> wasmtime::Result<Component> {
    let started = std::time::Instant::now();
    let size = format!("{:.1} MB", wasm.len() as f64 / 1e6);
    tracing::info!(target: COMPILE_PROGRESS, "compiling the plugin ({size}); the result is cached for later loads");
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let (span, shown) = (tracing::Span::current(), size.clone());
    let ticker = std::thread::Builder::new().name("sagabox-compile-progress".into()).spawn(move || {
        let size = shown;
        let _entered = span.enter();
        while finished.recv_timeout(PROGRESS_EVERY) == Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
            let elapsed = started.elapsed().as_secs();
            tracing::info!(target: COMPILE_PROGRESS, "still compiling the plugin ({size}): {elapsed} s");
        }
    });
    let component = Component::new(engine, wasm);
    drop(done);
    if let Ok(ticker) = ticker {
        let _ = ticker.join();
    }
    if started.elapsed() >= PROGRESS_EVERY {
        let took = started.elapsed().as_secs_f64();
        tracing::info!(target: COMPILE_PROGRESS, "compiled the plugin ({size}) in {took:.1} s");
    }
    component
}

/// `dir` if this user may trust it as a cache (creating it if missing), else `None`.
fn trusted_dir(dir: PathBuf) -> Option<PathBuf> {
    match check_dir(&dir) {
        Ok(()) => Some(dir),
        Err(why) => {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| tracing::warn!("not using the compile cache {}: {why}", dir.display()));
            None
        }
    }
}

#[cfg(unix)]
fn check_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    if let Err(e) = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir) {
        return Err(format!("cannot create it: {e}"));
    }
    let meta = std::fs::metadata(dir).map_err(|e| format!("cannot read it: {e}"))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if !meta.is_dir() {
        return Err("it is not a directory".into());
    }
    if meta.uid() != me {
        return Err(format!("it is owned by uid {}, not by this user (uid {me})", meta.uid()));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(format!("group or others may write it (mode {:o})", meta.mode() & 0o7777));
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_dir(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create it: {e}"))
}

/// Why a cache entry was not used.
enum Unusable {
    /// Written in another format (by an older sagabox): rewritten without a warning.
    OtherFormat,
    /// Damaged, planted or not loadable.
    Broken(String),
}

/// Deserializes the verified entry open as `file` (at `path`), mapping it; where the file
/// cannot be mapped executable (a cache on a `noexec` mount), from a copy in memory, checked
/// again, instead of recompiling on every load.
fn deserialize(engine: &Engine, file: &std::fs::File, path: &Path) -> Result<Component, Unusable> {
    // wasmtime opens by path. `/proc/self/fd/N` names the very file checked, even if the
    // entry was replaced since (another process storing it; a planted link).
    let checked = checked_file_path(file).unwrap_or_else(|| path.to_path_buf());
    // SAFETY: the file passed the entry's integrity check, so it is what this cache
    // serialized for this engine configuration (the name carries the engine's compatibility
    // hash), in a directory only this user can write. Entries are replaced by rename, never
    // written in place, so the mapping sees the checked contents.
    let mapped = guarded(|| unsafe { Component::deserialize_file(engine, &checked) })?;
    if let Ok(component) = mapped {
        return Ok(component);
    }
    let copy = read_checked_copy(file)?;
    // SAFETY: as above; these bytes passed the integrity check themselves.
    guarded(|| unsafe { Component::deserialize(engine, &copy) })?.map_err(|e| Unusable::Broken(format!("{e:#}")))
}

/// Runs one of wasmtime's deserializers. They trust their input, so a panic in them (seen on
/// damaged metadata) is caught as a last line of defence and counts as a miss.
fn guarded(load: impl FnOnce() -> wasmtime::Result<Component>) -> Result<wasmtime::Result<Component>, Unusable> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(load))
        .map_err(|_| Unusable::Broken("wasmtime panicked deserializing it".into()))
}

/// The serialized component of the entry open as `file`, read into memory and checked.
fn read_checked_copy(file: &std::fs::File) -> Result<Vec<u8>, Unusable> {
    use std::io::{Read, Seek, SeekFrom};
    let broken = |e: std::io::Error| Unusable::Broken(e.to_string());
    let mut reader = file;
    reader.seek(SeekFrom::Start(0)).map_err(broken)?;
    let mut bytes = Vec::new();
    reader.take(MAX_ENTRY_BYTES).read_to_end(&mut bytes).map_err(broken)?;
    let len = bytes.len() as u64;
    verify(std::io::Cursor::new(&bytes), len)?;
    bytes.truncate(bytes.len() - ENTRY_TRAILER);
    Ok(bytes)
}

/// A path that opens the same file as `file` does, where the platform has one.
fn checked_file_path(file: &std::fs::File) -> Option<PathBuf> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        path.exists().then_some(path)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = file;
        None
    }
}

/// The entry at `path`, open and checked; `None` when there is none. Never follows a
/// symlink and never blocks on a FIFO planted there.
fn open_entry(path: &Path) -> Result<Option<std::fs::File>, Unusable> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NOFOLLOW | libc::O_NONBLOCK);
    let file = match options.open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Unusable::Broken(format!("cannot open it (a symlink?): {e}"))),
    };
    let meta = file.metadata().map_err(|e| Unusable::Broken(e.to_string()))?;
    if !meta.is_file() || meta.len() > MAX_ENTRY_BYTES {
        return Err(Unusable::Broken("not a regular file of a plausible size".into()));
    }
    verify(&file, meta.len())?;
    Ok(Some(file))
}

/// Checks the trailer of an entry (`len` bytes, read from `reader`) against what precedes it.
fn verify(mut reader: impl std::io::Read + std::io::Seek, len: u64) -> Result<(), Unusable> {
    use std::io::SeekFrom;
    let broken = |e: std::io::Error| Unusable::Broken(e.to_string());
    let Some(payload) = len.checked_sub(ENTRY_TRAILER as u64) else { return Err(Unusable::OtherFormat) };
    let mut trailer = [0u8; ENTRY_TRAILER];
    reader.seek(SeekFrom::Start(payload)).map_err(broken)?;
    reader.read_exact(&mut trailer).map_err(broken)?;
    if &trailer[32..] != ENTRY_MAGIC {
        return Err(Unusable::OtherFormat);
    }
    reader.seek(SeekFrom::Start(0)).map_err(broken)?;
    let mut hasher = Sha256::new();
    let copied = std::io::copy(&mut reader.take(payload), &mut hasher).map_err(broken)?;
    if copied != payload || hasher.finalize()[..] != trailer[..32] {
        return Err(Unusable::Broken("its integrity check failed (the file is corrupted)".into()));
    }
    Ok(())
}

/// `<plugin sha256>-<engine hash>.cwasm`.
fn entry_name(engine: &Engine, sha256: &str) -> String {
    struct ShaHasher(Sha256);
    impl Hasher for ShaHasher {
        fn write(&mut self, bytes: &[u8]) {
            self.0.update(bytes);
        }
        fn finish(&self) -> u64 {
            0
        }
    }
    let mut hasher = ShaHasher(Sha256::new());
    std::hash::Hash::hash(&engine.precompile_compatibility_hash(), &mut hasher);
    format!("{sha256}-{}.cwasm", &crate::json::lower_hex(&hasher.0.finalize())[..16])
}

/// Writes an entry atomically: bytes and trailer into a new file with a random name,
/// created exclusively without following symlinks (nobody can make us write through a
/// planted link), then renamed over the entry (rename replaces a link, never follows it).
fn store_entry(path: &Path, serialized: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = dir.join(format!(".{name}.{:016x}.tmp", rand::random::<u64>()));
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // Read-only: processes map entries, and a file written in place under a mapping
        // (a stray `cp` over it, say) would change code they run or cut it short.
        options.mode(0o400).custom_flags(libc::O_NOFOLLOW);
    }
    let mut file = options.open(&tmp)?;
    let written = (|| {
        file.write_all(serialized)?;
        file.write_all(&Sha256::digest(serialized))?;
        file.write_all(ENTRY_MAGIC)?;
        file.sync_data()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// Whether the ticker stops ticking within a few seconds: a window of 100 ms without a
    /// tick (a tick under way when the last call ended may still land).
    fn goes_quiet(engines: &Engines) -> bool {
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            let before = engines.ticks();
            std::thread::sleep(Duration::from_millis(100));
            if engines.ticks() == before {
                return true;
            }
        }
        false
    }

    /// Whether the ticker ticks within a few seconds.
    fn ticks(engines: &Engines) -> bool {
        let (before, until) = (engines.ticks(), Instant::now() + Duration::from_secs(5));
        while Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
            if engines.ticks() > before + 1 {
                return true;
            }
        }
        false
    }

    #[test]
    fn the_epochs_advance_only_while_a_call_is_in_flight() {
        let engines = Engines::new(EngineOptions { pooling: false, ..EngineOptions::default() });
        engines.get(1024).unwrap();
        let before = engines.ticks();
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(engines.ticks(), before, "the ticker ticked before any call");
        let call = engines.call_started();
        assert!(ticks(&engines), "no tick while a call was in flight");
        drop(call);
        assert!(goes_quiet(&engines), "the ticker went on after the last call ended");
        // Two calls at once: ticking goes on until both have ended.
        let (first, second) = (engines.call_started(), engines.call_started());
        drop(first);
        assert!(ticks(&engines), "no tick while the second call was in flight");
        drop(second);
        assert!(goes_quiet(&engines), "the ticker went on after both calls ended");
        // The ticker wakes again for the next call.
        let call = engines.call_started();
        assert!(ticks(&engines), "the ticker did not wake for a call after a quiet spell");
        drop(call);
    }

    #[test]
    fn a_swap_cap_of_zero_on_the_cgroup_or_an_ancestor_rules_swap_out() {
        let root = tempfile::tempdir().unwrap();
        let leaf = root.path().join("kube/pod/app");
        std::fs::create_dir_all(&leaf).unwrap();
        let cgroup = "0::/kube/pod/app\n";
        assert!(!swap_capped_at_zero(root.path(), cgroup), "no cap anywhere");
        std::fs::write(leaf.join("memory.swap.max"), "max\n").unwrap();
        assert!(!swap_capped_at_zero(root.path(), cgroup), "an unlimited cap");
        std::fs::write(root.path().join("kube/memory.swap.max"), "0\n").unwrap();
        assert!(swap_capped_at_zero(root.path(), cgroup), "an ancestor's cap of 0 holds for the leaf");
        // cgroup v1 only (no `0::` line): nothing is known, so swap is assumed possible.
        assert!(!swap_capped_at_zero(root.path(), "4:memory:/kube/pod/app\n"));
    }

    /// A core module with a 128 KiB memory (its first bytes from a data segment, so that
    /// the slot maps an image) and `store(addr, value)` / `load(addr)` of i64s.
    fn memory_module(engine: &Engine) -> wasmtime::Module {
        use wasm_encoder::*;
        let mut module = Module::new();
        let mut types = TypeSection::new();
        types.ty().function([ValType::I32, ValType::I64], []);
        types.ty().function([ValType::I32], [ValType::I64]);
        let mut functions = FunctionSection::new();
        functions.function(0);
        functions.function(1);
        let mut memories = MemorySection::new();
        memories.memory(MemoryType {
            minimum: 2,
            maximum: Some(2),
            memory64: false,
            shared: false,
            page_size_log2: None,
        });
        let mut exports = ExportSection::new();
        exports.export("store", ExportKind::Func, 0);
        exports.export("load", ExportKind::Func, 1);
        exports.export("memory", ExportKind::Memory, 0);
        let mut code = CodeSection::new();
        let arg = MemArg { offset: 0, align: 3, memory_index: 0 };
        let mut store = Function::new([]);
        store.instructions().local_get(0).local_get(1).i64_store(arg).end();
        code.function(&store);
        let mut load = Function::new([]);
        load.instructions().local_get(0).i64_load(arg).end();
        code.function(&load);
        let mut data = DataSection::new();
        data.active(0, &ConstExpr::i32_const(0), b"the image".iter().copied());
        module.section(&types).section(&functions).section(&memories).section(&exports).section(&code).section(&data);
        wasmtime::Module::new(engine, module.finish()).unwrap()
    }

    /// The host's page size.
    fn page_size() -> usize {
        // SAFETY: sysconf reads a constant of the system.
        unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
    }

    /// Whether the page at `addr` of this process is in swap (`/proc/self/pagemap`, bit 62).
    fn swapped_out(addr: usize) -> bool {
        use std::io::{Read, Seek, SeekFrom};
        let mut pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
        let mut entry = [0u8; 8];
        pagemap.seek(SeekFrom::Start((addr / page_size() * 8) as u64)).unwrap();
        pagemap.read_exact(&mut entry).unwrap();
        u64::from_le_bytes(entry) & (1 << 62) != 0
    }

    #[tokio::test]
    async fn a_page_of_a_call_swapped_out_before_its_slot_is_reset_does_not_reach_the_next_call() {
        const SECRET: i64 = 0x5ec2e7_5ec2e7;
        const AT: i32 = 96 << 10;
        let engines = Engines::new(EngineOptions { max_concurrent_calls: 4, ..EngineOptions::default() });
        let engine = engines.get(1024).unwrap();
        let module = memory_module(&engine);
        let unlimited = |store: &mut wasmtime::Store<()>| {
            store.set_fuel(u64::MAX).unwrap();
            store.set_epoch_deadline(u64::MAX);
        };
        let mut first = wasmtime::Store::new(&engine, ());
        unlimited(&mut first);
        let instance = wasmtime::Instance::new_async(&mut first, &module, &[]).await.unwrap();
        let write = instance.get_typed_func::<(i32, i64), ()>(&mut first, "store").unwrap();
        write.call_async(&mut first, (AT, SECRET)).await.unwrap();
        let memory = instance.get_memory(&mut first, "memory").unwrap();
        let page = (memory.data_ptr(&first) as usize + AT as usize) & !(page_size() - 1);
        // What memory pressure does to a page while its call runs: the kernel swaps it out.
        let swaps = std::fs::read_to_string("/proc/swaps").unwrap_or_default();
        assert!(swap_is_on(), "this test needs swap (`.ci/swap-on` turns some on, as root); /proc/swaps: {swaps:?}");
        for _ in 0..10 {
            // SAFETY: advice on a page of the instance's own, still-mapped memory.
            unsafe { libc::madvise(page as *mut libc::c_void, page_size(), libc::MADV_PAGEOUT) };
            if swapped_out(page) {
                break;
            }
        }
        assert!(swapped_out(page), "the kernel did not swap the call's page out; /proc/swaps: {swaps:?}");
        let slot = memory.data_ptr(&first) as usize;
        drop(first);

        // Later calls, until one gets that slot back (returned slots wait for a batch of
        // decommits before they are reused).
        for _ in 0..256 {
            let mut next = wasmtime::Store::new(&engine, ());
            unlimited(&mut next);
            let instance = wasmtime::Instance::new_async(&mut next, &module, &[]).await.unwrap();
            let memory = instance.get_memory(&mut next, "memory").unwrap();
            if memory.data_ptr(&next) as usize != slot {
                continue;
            }
            let load = instance.get_typed_func::<i32, i64>(&mut next, "load").unwrap();
            assert_eq!(load.call_async(&mut next, AT).await.unwrap(), 0, "a later call read the first one's data");
            assert_eq!(&memory.data(&next)[..9], b"the image", "the slot's image was not restored");
            return;
        }
        panic!("no later call got the first call's slot");
    }

    #[test]
    fn an_idle_ticker_ends_soon_after_its_engines_are_dropped() {
        let engines = Engines::new(EngineOptions { pooling: false, ..EngineOptions::default() });
        engines.get(1024).unwrap();
        assert!(goes_quiet(&engines));
        // The ticker holds the call counter until it ends.
        let counter = Arc::downgrade(&engines.calls);
        drop(engines);
        let until = Instant::now() + IDLE_RECHECK / 2;
        while counter.strong_count() > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(counter.strong_count(), 0, "the idle ticker outlived its engines");
    }
}
