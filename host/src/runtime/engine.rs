//! wasmtime engines, the epoch ticker that enforces deadlines, and the on-disk cache of
//! compiled plugins.
//!
//! wasmtime fixes the wasm stack size per engine, so the runtime keeps one engine per stack
//! size in use (almost always just the default one); everything else that varies per call
//! (fuel, deadline, memory, tables, instances) is set per store.

use std::collections::HashMap;
use std::hash::Hasher;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use super::policy::{MAX_INSTANCES, MAX_MEMORY_MIB, MAX_TABLE_ELEMENTS};

/// How often the epoch advances: the resolution of call deadlines.
pub const EPOCH_TICK: Duration = Duration::from_millis(1);

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
}

impl Engines {
    pub fn new(options: EngineOptions) -> Engines {
        let ticking = Arc::new(Mutex::new(Vec::new()));
        if options.epochs {
            spawn_ticker(Arc::downgrade(&ticking));
        }
        Engines { options, by_stack: Mutex::new(HashMap::new()), ticking }
    }

    pub fn options(&self) -> EngineOptions {
        self.options
    }

    /// The engine for guests with `stack_kib` of wasm stack.
    pub fn get(&self, stack_kib: u64) -> Result<Engine, String> {
        let mut engines = self.by_stack.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(engine) = engines.get(&stack_kib) {
            return Ok(engine.clone());
        }
        let engine = Engine::new(&self.config(stack_kib)).map_err(|e| format!("{e:#}"))?;
        engines.insert(stack_kib, engine.clone());
        self.ticking.lock().unwrap_or_else(|p| p.into_inner()).push(engine.clone());
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
                // Reset a returned slot by rewriting only the pages the call dirtied
                // (PAGEMAP_SCAN, Linux 6.7+; falls back to memset/madvise elsewhere) instead
                // of unmapping them, so the next call on the slot takes no page faults.
                .pagemap_scan(wasmtime::Enabled::Auto)
                .linear_memory_keep_resident(16 << 20)
                .table_keep_resident(1 << 20)
                .decommit_batch_size(32);
            config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        }
        config
    }
}

/// Advances every live engine's epoch each tick, until the engines are dropped.
fn spawn_ticker(engines: Weak<Mutex<Vec<Engine>>>) {
    let spawned = std::thread::Builder::new().name("sagabox-epoch".into()).spawn(move || {
        while let Some(engines) = engines.upgrade() {
            for engine in engines.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                engine.increment_epoch();
            }
            drop(engines);
            std::thread::sleep(EPOCH_TICK);
        }
    });
    if let Err(e) = spawned {
        tracing::error!("cannot start the epoch ticker, deadlines will not interrupt guests: {e}");
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

/// Compiled plugins on disk, keyed by the plugin's SHA-256 and the engine's configuration.
#[derive(Clone, Debug)]
pub struct CompileCache {
    dir: Option<PathBuf>,
}

impl CompileCache {
    /// A cache in `dir`, or no cache.
    pub fn new(dir: Option<PathBuf>) -> CompileCache {
        CompileCache { dir }
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

    /// The compiled form of `wasm` for `engine`, from the cache or compiled now. A cache
    /// entry that does not load (stale, truncated, another wasmtime) counts as a miss.
    pub fn load_or_compile(
        &self,
        engine: &Engine,
        wasm: &[u8],
        sha256: &str,
    ) -> wasmtime::Result<(Component, CompileSource)> {
        let Some(path) = self.dir.as_ref().map(|dir| dir.join(entry_name(engine, sha256))) else {
            return Ok((Component::new(engine, wasm)?, CompileSource::Compiled));
        };
        if path.exists() {
            // SAFETY: the file is one this cache wrote for this engine configuration (its
            // name carries the plugin's SHA-256 and the engine's compatibility hash), in a
            // directory only this user writes. wasmtime checks the header and version too.
            match unsafe { Component::deserialize_file(engine, &path) } {
                Ok(component) => return Ok((component, CompileSource::Cached)),
                Err(e) => tracing::warn!("ignoring unusable cache entry {}: {e:#}", path.display()),
            }
        }
        let component = Component::new(engine, wasm)?;
        if let Err(e) = store_entry(&path, &component.serialize()?) {
            tracing::warn!("cannot write cache entry {}: {e}", path.display());
        }
        Ok((component, CompileSource::Compiled))
    }
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
    format!("{sha256}-{}.cwasm", &hex::encode(hasher.0.finalize())[..16])
}

/// Writes atomically (temp file + rename), so a crash never leaves a half entry behind.
fn store_entry(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
    }
    let tmp =
        dir.join(format!(".{}.{}.tmp", path.file_name().unwrap_or_default().to_string_lossy(), std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}
