//! The plugin loader (`Runtime::load_partial`) on untrusted bytes, in two modes chosen by the
//! first byte of the input:
//!
//! - anything but `C`: the whole input is a plugin file, `<tmp>/p.wasm`, loaded from a plugin
//!   directory (bundled plugins off, small `LoadCaps`). Never a panic or a hang: the plugin
//!   loads or the error list names it, and nothing else.
//! - `C`: the rest mutates the compile-cache entry of a valid plugin (the bundled `resources`,
//!   compiled once per process). The rest is either a whole entry (what follows the entry
//!   format's tag, `sgbxc\0\0\x02`, when the rest starts with it) or edits of the real
//!   entry, 4 bytes each: `[op, offset (24 bits, little-endian, modulo the length)]`, `op`
//!   XORed into the byte there, or `op == 0` truncating the entry at that offset. The
//!   plugin is loaded again from the mutated entry: it is served from the cache only when
//!   the entry is byte for byte the one the cache wrote (anything else is recompiled, never
//!   run), and `resources.allocate` still works.
//!
//! One tokio runtime and one private temporary directory per process (removed at the start
//! of a later process once this one is gone).
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use sagabox::runtime::{CallOptions, CompileSource, EngineOptions, LoadCaps, Runtime, RuntimeOptions, bundled_wasm};
use sagabox::store::{MemoryStore, State};
use serde_json::json;

/// The entry format's tag (`ENTRY_MAGIC` in host/src/runtime/engine.rs).
const ENTRY_MAGIC: &[u8] = b"sgbxc\0\0\x02";

/// The policy of the bundled `resources` plugin (guest-tools/plugins/resources/policy.toml).
const RESOURCES_POLICY: &str = "[store]\nwrite = [\"pools\", \"allocations\"]\n";

struct Harness {
    rt: tokio::runtime::Runtime,
    /// Holds only `p.wasm`, the input of the loader mode.
    inputs: PathBuf,
    /// The compile cache of the loader mode.
    input_cache: PathBuf,
    /// Holds `resources.wasm` and its policy.
    valid: PathBuf,
    /// The compile cache of the cache mode: one entry, `entry`.
    valid_cache: PathBuf,
    entry: PathBuf,
    /// The entry as the cache wrote it.
    entry_bytes: Vec<u8>,
}

/// Small caps, so that one input stays cheap (the seeds, ~50-150 KB components with a few
/// thousand functions, fit).
fn caps() -> LoadCaps {
    LoadCaps {
        max_file_bytes: 1 << 20,
        max_nesting: 10,
        max_functions: 20_000,
        max_tools: 32,
        max_description_bytes: 1 << 10,
        max_schema_bytes: 8 << 10,
        manifest_fuel: 50_000_000,
        manifest_deadline_ms: 500,
        follow_links_out: false,
    }
}

fn options(plugins: &Path, cache: &Path) -> RuntimeOptions {
    RuntimeOptions {
        bundled: false,
        plugin_dirs: vec![plugins.to_path_buf()],
        cache_dir: Some(cache.to_path_buf()),
        // No pooling allocator: every input builds a runtime (and so an engine) of its own,
        // and a pool of a thousand slots is reserved per engine.
        engine: EngineOptions { pooling: false, ..EngineOptions::default() },
        load: caps(),
        ..RuntimeOptions::default()
    }
}

fn private_dir(path: &Path) {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(path).expect("a private directory");
}

/// The cache's entries (files not starting with a dot).
fn entries(cache: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(cache)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    found.retain(|p| !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')));
    found.sort();
    found
}

/// Removes the directories of earlier processes of this target that are gone.
fn remove_stale(tmp: &Path, prefix: &str) {
    let Ok(dir) = std::fs::read_dir(tmp) else { return };
    for entry in dir.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().to_string();
        let Some(pid) = name.strip_prefix(prefix).and_then(|p| p.parse::<u32>().ok()) else { continue };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

static HARNESS: LazyLock<Harness> = LazyLock::new(|| {
    let tmp = std::env::temp_dir();
    let prefix = "sagabox-fuzz-plugin_loader-";
    remove_stale(&tmp, prefix);
    let root = tmp.join(format!("{prefix}{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (inputs, input_cache, valid, valid_cache) =
        (root.join("in"), root.join("in-cache"), root.join("valid"), root.join("valid-cache"));
    for dir in [&inputs, &input_cache, &valid, &valid_cache] {
        private_dir(dir);
    }
    let wasm = bundled_wasm("resources").expect("the bundled resources plugin");
    std::fs::write(valid.join("resources.wasm"), wasm).unwrap();
    std::fs::write(valid.join("resources.policy.toml"), RESOURCES_POLICY).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio");
    let mut harness =
        Harness { rt, inputs, input_cache, valid, valid_cache, entry: PathBuf::new(), entry_bytes: Vec::new() };
    assert_eq!(harness.load_valid(), CompileSource::Compiled, "a fresh cache compiles");
    let found = entries(&harness.valid_cache);
    assert_eq!(found.len(), 1, "one cache entry for resources: {found:?}");
    harness.entry = found[0].clone();
    harness.entry_bytes = std::fs::read(&harness.entry).unwrap();
    assert!(harness.entry_bytes.ends_with(ENTRY_MAGIC), "the entry format changed");
    assert_eq!(harness.load_valid(), CompileSource::Cached, "the entry just written is used");
    harness
});

impl Harness {
    /// Loads `resources` from its cache and calls `resources.allocate`, which must work.
    fn load_valid(&self) -> CompileSource {
        self.rt.block_on(async {
            let (runtime, errors) =
                Runtime::load_partial(options(&self.valid, &self.valid_cache)).await.expect("the engine");
            assert!(errors.is_empty(), "resources does not load: {errors:?}");
            let plugin = runtime.plugin("resources").expect("resources is loaded");
            let state = State::from_json(&json!({ "pools": { "p": { "capacity": 10, "allocated": 0 } } })).unwrap();
            let store = MemoryStore::new(state);
            let args = json!({ "pool_id": "p", "amount": 3 });
            let outcome = runtime.call("resources.allocate", &args, &CallOptions::default(), &store).await;
            let output = outcome.result.unwrap_or_else(|e| panic!("resources.allocate failed: {e}"));
            assert_eq!(output["remaining"], 7, "resources.allocate: {output}");
            plugin.compiled
        })
    }

    /// The loader mode.
    fn load_input(&self, wasm: &[u8]) {
        // Each compiled input leaves an entry; keep the cache small.
        if entries(&self.input_cache).len() > 64 {
            let _ = std::fs::remove_dir_all(&self.input_cache);
            private_dir(&self.input_cache);
        }
        std::fs::write(self.inputs.join("p.wasm"), wasm).unwrap();
        self.rt.block_on(async {
            let (runtime, errors) =
                Runtime::load_partial(options(&self.inputs, &self.input_cache)).await.expect("the engine");
            let loaded: Vec<_> = runtime.plugins().map(|p| p.name.clone()).collect();
            match (loaded.as_slice(), errors.as_slice()) {
                ([name], []) => assert_eq!(name, "p"),
                ([], [error]) => {
                    let text = error.to_string();
                    assert!(text.contains("p.wasm"), "the error does not name the file: {text}");
                }
                _ => panic!("one file, but plugins {loaded:?} and errors {errors:?}"),
            }
        });
    }

    /// The cache mode.
    fn load_entry(&self, rest: &[u8]) {
        let bytes = match rest.strip_prefix(ENTRY_MAGIC) {
            Some(whole) => whole.to_vec(),
            None => edited(&self.entry_bytes, rest),
        };
        // Entries are read-only (processes map them): replaced, as the cache does.
        let _ = std::fs::remove_file(&self.entry);
        std::fs::write(&self.entry, &bytes).unwrap();
        let compiled = self.load_valid();
        if bytes == self.entry_bytes {
            assert_eq!(compiled, CompileSource::Cached, "an intact entry was not used");
        } else {
            assert_eq!(compiled, CompileSource::Compiled, "a damaged entry ({} bytes) was used", bytes.len());
        }
    }
}

/// `entry` with the edits of `ops` (see the top of the file).
fn edited(entry: &[u8], ops: &[u8]) -> Vec<u8> {
    let mut bytes = entry.to_vec();
    for op in ops.chunks_exact(4) {
        if bytes.is_empty() {
            break;
        }
        let at = u32::from_le_bytes([op[1], op[2], op[3], 0]) as usize % bytes.len();
        match op[0] {
            0 => bytes.truncate(at),
            x => bytes[at] ^= x,
        }
    }
    bytes
}

fuzz_target!(init: { LazyLock::force(&HARNESS); }, |data: &[u8]| {
    match data.split_first() {
        Some((b'C', rest)) => HARNESS.load_entry(rest),
        _ => HARNESS.load_input(data),
    }
});
