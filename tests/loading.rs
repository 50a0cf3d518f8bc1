//! Loading plugins from untrusted places and running untrusted guests against the store:
//! the compile cache is verified before use, a guest cannot make the host hold unbounded
//! memory through the store, loading has a budget, and one bad plugin does not stop the rest.

use crate::support;

use std::path::{Path, PathBuf};

use sagabox::runtime::{
    CallError, CallOptions, CompileSource, LimitOverrides, LoadCaps, Operator, Runtime, RuntimeOptions,
};
use sagabox::store::{MemoryStore, State, Txn, TxnError, WriteQuota};
use serde_json::{Value, json};
use support::*;

/// Copies a built plugin into `dir` as `<name>.wasm`, with `policy` beside it.
fn install(dir: &Path, artifact_name: &str, name: &str, policy: Option<&str>) {
    std::fs::copy(artifact(artifact_name), dir.join(format!("{name}.wasm"))).unwrap();
    if let Some(policy) = policy {
        std::fs::write(dir.join(format!("{name}.policy.toml")), policy).unwrap();
    }
}

/// A private directory, as the cache expects (tempdir's default mode is 0700 already).
fn private_dir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn dir_options(plugins: &Path, cache: Option<&Path>) -> RuntimeOptions {
    RuntimeOptions {
        bundled: false,
        plugin_dirs: vec![plugins.to_path_buf()],
        cache_dir: cache.map(Path::to_path_buf),
        ..RuntimeOptions::default()
    }
}

fn call_options(limits: LimitOverrides) -> CallOptions {
    CallOptions { limits, ..CallOptions::default() }
}

// ---------------------------------------------------------------------------------------
// The compile cache
// ---------------------------------------------------------------------------------------

const NOTES_POLICY: &str = "[store]\nwrite = [\"notes\"]\n";

/// A plugin directory holding only the `minimal` plugin, as `notes`.
fn notes_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "minimal", "notes", Some(NOTES_POLICY));
    dir
}

/// The cache's entries (files not starting with a dot).
fn entries(cache: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> =
        std::fs::read_dir(cache).map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect()).unwrap_or_default();
    found.retain(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'));
    found.sort();
    found
}

/// Loads `notes` and checks where it came from and that a call works.
async fn load_notes(plugins: &Path, cache: &Path) -> CompileSource {
    let runtime = Runtime::load(dir_options(plugins, Some(cache))).await.expect("notes loads");
    let compiled = runtime.plugin("notes").unwrap().compiled;
    if compiled == CompileSource::Compiled {
        add_a_note(&runtime).await;
    }
    compiled
}

/// Calls `notes.add`, which must work.
async fn add_a_note(runtime: &Runtime) {
    let store = MemoryStore::new(State::default());
    let mut options = CallOptions::default();
    options.context.idempotency_key = "0123456789abcdef".repeat(4);
    let added = runtime.call("notes.add", &json!({ "text": "hi" }), &options, &store).await;
    assert!(added.result.is_ok(), "{:?}", added.result);
}

/// One warm entry for `notes`: its path and bytes.
async fn warm_entry(plugins: &Path, cache: &Path) -> (PathBuf, Vec<u8>) {
    assert_eq!(load_notes(plugins, cache).await, CompileSource::Compiled);
    assert_eq!(load_notes(plugins, cache).await, CompileSource::Cached);
    let found = entries(cache);
    assert_eq!(found.len(), 1, "{found:?}");
    let bytes = std::fs::read(&found[0]).unwrap();
    (found[0].clone(), bytes)
}

/// The byte range of ELF section `name` in a cache entry (wherever the ELF image starts).
fn elf_section(bytes: &[u8], name: &str) -> std::ops::Range<usize> {
    let base = bytes.windows(4).position(|w| w == b"\x7fELF").expect("an ELF image");
    let elf = &bytes[base..];
    let u16_at = |o: usize| u16::from_le_bytes(elf[o..o + 2].try_into().unwrap()) as usize;
    let u32_at = |o: usize| u32::from_le_bytes(elf[o..o + 4].try_into().unwrap()) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(elf[o..o + 8].try_into().unwrap()) as usize;
    let (shoff, shentsize, shnum, shstrndx) = (u64_at(0x28), u16_at(0x3a), u16_at(0x3c), u16_at(0x3e));
    let header = |i: usize| shoff + i * shentsize;
    let strtab = u64_at(header(shstrndx) + 0x18);
    for i in 0..shnum {
        let h = header(i);
        let at = strtab + u32_at(h);
        let end = at + elf[at..].iter().position(|b| *b == 0).unwrap();
        if &elf[at..end] == name.as_bytes() {
            let (offset, size) = (u64_at(h + 0x18), u64_at(h + 0x20));
            return base + offset..base + offset + size;
        }
    }
    panic!("no section {name}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cached_plugin_runs_from_its_entry_mapped_not_copied() {
    use std::os::unix::fs::PermissionsExt;
    let (plugins, cache) = (notes_dir(), private_dir());
    let (entry, _) = warm_entry(plugins.path(), cache.path()).await;
    let runtime = Runtime::load(dir_options(plugins.path(), Some(cache.path()))).await.unwrap();
    assert_eq!(runtime.plugin("notes").unwrap().compiled, CompileSource::Cached);
    // Its machine code is the entry's own pages, so only what calls touch is resident.
    let entry = entry.canonicalize().unwrap();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let code = maps.lines().find(|l| l.ends_with(entry.to_str().unwrap()) && l.contains(" r-xp "));
    assert!(code.is_some(), "no executable mapping of {}", entry.display());
    add_a_note(&runtime).await;
    // Read-only, so that nothing writes it in place under a process running it.
    let mode = std::fs::metadata(&entry).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o400);
}

/// A cache on a `noexec` mount (a hardened `/tmp` or home) cannot be mapped executable: its
/// entries are used from a checked copy in memory, not recompiled on every load. Mounting
/// needs root, as the directory-ownership tests above do.
#[tokio::test(flavor = "multi_thread")]
async fn a_cache_on_a_noexec_mount_is_used_from_a_copy() {
    let (plugins, dir) = (notes_dir(), private_dir());
    let mount = NoexecMount::new(dir.path());
    let cache = mount.0.join("cache");
    assert_eq!(load_notes(plugins.path(), &cache).await, CompileSource::Compiled);
    let runtime = Runtime::load(dir_options(plugins.path(), Some(&cache))).await.unwrap();
    let compiled = runtime.plugin("notes").unwrap().compiled;
    assert_eq!(compiled, CompileSource::Cached, "an entry on a noexec mount was compiled again");
    add_a_note(&runtime).await;
}

/// A `noexec` tmpfs mounted at a directory, unmounted when dropped, so that a failed
/// assertion does not leave it mounted.
struct NoexecMount(PathBuf);

impl NoexecMount {
    fn new(at: &Path) -> NoexecMount {
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "noexec,mode=0700", "tmpfs"])
            .arg(at)
            .status()
            .expect("mount runs");
        assert!(mounted.success(), "this test mounts a noexec tmpfs, which needs root");
        NoexecMount(at.to_path_buf())
    }
}

impl Drop for NoexecMount {
    fn drop(&mut self) {
        let unmounted = std::process::Command::new("umount").arg(&self.0).status();
        if !unmounted.is_ok_and(|s| s.success()) && !std::thread::panicking() {
            panic!("cannot unmount {}", self.0.display());
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_entry_of_the_first_format_is_recompiled_and_rewritten() {
    use sha2::Digest;
    let (plugins, cache) = (notes_dir(), private_dir());
    let (entry, bytes) = warm_entry(plugins.path(), cache.path()).await;
    // The first format: a tag and the component's SHA-256 before it.
    let component = &bytes[..bytes.len() - 40];
    let mut first = b"sgbxc\0\0\x01".to_vec();
    first.extend_from_slice(&sha2::Sha256::digest(component));
    first.extend_from_slice(component);
    replace_cache_entry(&entry, &first);
    assert_eq!(load_notes(plugins.path(), cache.path()).await, CompileSource::Compiled);
    let rewritten = std::fs::read(&entry).unwrap();
    assert!(rewritten.ends_with(b"sgbxc\0\0\x02"), "the entry was not rewritten in the current format");
    assert_eq!(load_notes(plugins.path(), cache.path()).await, CompileSource::Cached);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cache_entry_with_zeroed_metadata_is_recompiled_not_a_panic() {
    let (plugins, cache) = (notes_dir(), private_dir());
    let (entry, bytes) = warm_entry(plugins.path(), cache.path()).await;
    let info = elf_section(&bytes, ".wasmtime.info");
    let mut damaged = 0;
    for at in [info.start, info.start + info.len() / 4, info.start + info.len() / 2, info.end.saturating_sub(64)] {
        let mut broken = bytes.clone();
        let end = (at + 64).min(info.end);
        broken[at..end].fill(0);
        if broken == bytes {
            continue; // already zeros there: nothing to damage
        }
        damaged += 1;
        replace_cache_entry(&entry, &broken);
        assert_eq!(load_notes(plugins.path(), cache.path()).await, CompileSource::Compiled, "zeroed at {at}");
    }
    assert!(damaged > 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cache_entry_with_flipped_bits_in_its_code_is_recompiled_and_runs() {
    let (plugins, cache) = (notes_dir(), private_dir());
    let (entry, bytes) = warm_entry(plugins.path(), cache.path()).await;
    let text = elf_section(&bytes, ".text");
    let mut broken = bytes.clone();
    for b in &mut broken[text.start + text.len() / 2..][..64] {
        *b ^= 0x5a;
    }
    replace_cache_entry(&entry, &broken);
    // A cached load here would run corrupted machine code at the first call.
    assert_eq!(load_notes(plugins.path(), cache.path()).await, CompileSource::Compiled);
    // The bad entry was replaced by a good one.
    assert_eq!(load_notes(plugins.path(), cache.path()).await, CompileSource::Cached);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cache_dir_others_can_write_is_not_used() {
    use std::os::unix::fs::PermissionsExt;
    let plugins = notes_dir();
    let parent = private_dir();
    let cache = parent.path().join("open");
    std::fs::create_dir(&cache).unwrap();
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o777)).unwrap();
    assert_eq!(load_notes(plugins.path(), &cache).await, CompileSource::Compiled);
    assert!(entries(&cache).is_empty(), "the cache wrote into a world-writable directory");
    assert_eq!(load_notes(plugins.path(), &cache).await, CompileSource::Compiled);
    let mode = std::fs::metadata(&cache).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o777, "the cache changed the mode of a directory it does not trust");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cache_dir_owned_by_someone_else_is_not_used() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: changing a directory's owner needs root");
        return;
    }
    let plugins = notes_dir();
    let parent = private_dir();
    let cache = parent.path().join("theirs");
    std::fs::create_dir(&cache).unwrap();
    std::os::unix::fs::chown(&cache, Some(65534), Some(65534)).unwrap();
    assert_eq!(load_notes(plugins.path(), &cache).await, CompileSource::Compiled);
    assert!(entries(&cache).is_empty(), "the cache wrote into a directory another user owns");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_symlinked_cache_entry_is_not_followed() {
    let plugins = notes_dir();
    let (warm, outside, cache) = (private_dir(), private_dir(), private_dir());
    let (entry, bytes) = warm_entry(plugins.path(), warm.path()).await;
    let name = entry.file_name().unwrap();
    let target = outside.path().join("planted.cwasm");
    std::fs::write(&target, &bytes).unwrap();
    std::os::unix::fs::symlink(&target, cache.path().join(name)).unwrap();
    assert_eq!(load_notes(plugins.path(), cache.path()).await, CompileSource::Compiled);
    assert_eq!(std::fs::read(&target).unwrap(), bytes, "the planted file was changed");
    let meta = std::fs::symlink_metadata(cache.path().join(name)).unwrap();
    assert!(meta.file_type().is_file(), "the entry is still a symlink");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_symlink_planted_at_a_temp_name_is_not_followed() {
    let plugins = notes_dir();
    let (warm, outside, cache) = (private_dir(), private_dir(), private_dir());
    let (entry, _) = warm_entry(plugins.path(), warm.path()).await;
    let name = entry.file_name().unwrap().to_string_lossy().to_string();
    let victim = outside.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    // The name the cache used to write through (predictable: the entry name and the pid).
    let predictable = cache.path().join(format!(".{name}.{}.tmp", std::process::id()));
    std::os::unix::fs::symlink(&victim, &predictable).unwrap();
    assert_eq!(load_notes(plugins.path(), cache.path()).await, CompileSource::Compiled);
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious", "the cache wrote through a planted symlink");
    assert_eq!(load_notes(plugins.path(), cache.path()).await, CompileSource::Cached);
}

// ---------------------------------------------------------------------------------------
// Host memory a guest controls, through the store
// ---------------------------------------------------------------------------------------

const GREEDY_POLICY: &str = "[store]\nwrite = [\"greedy\"]\n";

async fn greedy_runtime(dir: &Path) -> Runtime {
    install(dir, "greedy", "greedy", Some(GREEDY_POLICY));
    let options = RuntimeOptions { cache_dir: Some(shared_cache()), ..dir_options(dir, None) };
    Runtime::load(options).await.expect("greedy loads")
}

/// Generous time and fuel: these calls must end on a cap, not on a limit of the call.
fn roomy() -> CallOptions {
    call_options(LimitOverrides { fuel: Some(50_000_000_000), deadline_ms: Some(60_000), ..Default::default() })
}

/// Calls `greedy.<tool>`, expects a store refusal naming `cap`, and checks the store is
/// unchanged and the next call is served.
async fn refused_by_cap(runtime: &Runtime, store: &MemoryStore, tool: &str, args: Value, cap: &str) {
    let before = store.snapshot().digest();
    let outcome = runtime.call(&format!("greedy.{tool}"), &args, &roomy(), store).await;
    match &outcome.result {
        Err(CallError::Rejected { message, .. }) => assert!(message.contains(cap), "{tool}: {message}"),
        other => panic!("greedy.{tool}: expected a refusal naming the {cap} cap, got {other:?}"),
    }
    assert_eq!(store.snapshot().digest(), before);
    let next = runtime.call("greedy.echo", &json!({ "x": 1 }), &CallOptions::default(), store).await;
    assert_eq!(next.result.unwrap(), json!({ "x": 1 }));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_guest_reading_endless_distinct_keys_hits_the_read_set_cap() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = greedy_runtime(dir.path()).await;
    let store = MemoryStore::new(State::default());
    refused_by_cap(&runtime, &store, "read_many", json!({ "n": 200_000 }), "read set").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_guest_reading_a_huge_key_or_namespace_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = greedy_runtime(dir.path()).await;
    let store = MemoryStore::new(State::default());
    refused_by_cap(&runtime, &store, "read_many", json!({ "n": 1, "key_bytes": 4 << 20 }), "key length").await;
    let ns = "g".repeat(1 << 20);
    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "greedy", "wide", Some("[store]\nread = [\"*\"]\n"));
    let options = RuntimeOptions { cache_dir: Some(shared_cache()), ..dir_options(dir.path(), None) };
    let wide = Runtime::load(options).await.unwrap();
    let outcome = wide.call("wide.read_many", &json!({ "n": 1, "namespace": ns }), &roomy(), &store).await;
    match &outcome.result {
        Err(CallError::Rejected { message, .. }) if message.contains("namespace length") => {}
        // A policy that does not grant such a namespace stops the call first: also fine.
        Err(CallError::AccessDenied { .. }) => {}
        other => panic!("expected a refusal naming the namespace length cap, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_guest_listing_a_huge_namespace_hits_the_list_cap() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = greedy_runtime(dir.path()).await;
    let docs: serde_json::Map<String, Value> = (0..100_001).map(|i| (format!("k{i:06}"), json!({}))).collect();
    let store = MemoryStore::new(State::from_json(&json!({ "greedy": docs })).unwrap());
    refused_by_cap(&runtime, &store, "list", json!({}), "list size").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_huge_document_is_charged_before_it_is_parsed() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = greedy_runtime(dir.path()).await;
    let store = MemoryStore::new(State::default());
    // 8 MiB of unparsable JSON against a 4 MiB quota: refused on its size, never parsed.
    refused_by_cap(&runtime, &store, "put_big", json!({ "bytes": 8 << 20 }), "write quota").await;
    // Valid documents until the quota is used up: the next one is refused on its size too.
    refused_by_cap(&runtime, &store, "put_big", json!({ "bytes": 1 << 20, "times": 8, "valid": true }), "write quota")
        .await;
}

#[test]
fn a_write_over_the_quota_is_refused_before_parsing() {
    let mut txn = Txn::new(State::default(), WriteQuota { bytes: 64, writes: 10 });
    let err = txn.put("a", "b", &"[".repeat(100)).unwrap_err();
    assert!(matches!(err, TxnError::QuotaExceeded(_)), "{err}");
    let mut spent = Txn::new(State::default(), WriteQuota { bytes: 64, writes: 1 });
    spent.put("a", "b", "1").unwrap();
    let err = spent.put("a", "c", "[").unwrap_err();
    assert!(matches!(err, TxnError::QuotaExceeded(_)), "{err}");
}

// ---------------------------------------------------------------------------------------
// Loading has a budget
// ---------------------------------------------------------------------------------------

/// Loads `dir` alone (no bundled plugins) with `caps`; the load errors as one text.
async fn load_errors_with(dir: &Path, caps: LoadCaps) -> String {
    let options = RuntimeOptions { load: caps, cache_dir: Some(shared_cache()), ..dir_options(dir, None) };
    match Runtime::load(options).await {
        Ok(runtime) => panic!("{} should not load; loaded {:?}", dir.display(), names(&runtime)),
        Err(e) => e.to_string(),
    }
}

fn names(runtime: &Runtime) -> Vec<String> {
    runtime.plugins().map(|p| p.name.clone()).collect()
}

/// A component of `depth` components nested in one another.
fn nested_component(depth: usize) -> Vec<u8> {
    let mut inner = wasm_encoder::Component::new();
    for _ in 0..depth {
        let mut outer = wasm_encoder::Component::new();
        outer.section(&wasm_encoder::NestedComponentSection(&inner));
        inner = outer;
    }
    inner.finish()
}

/// A component holding one core module of `count` empty functions.
fn component_with_functions(count: u32) -> Vec<u8> {
    use wasm_encoder::{CodeSection, Function, FunctionSection, Instruction, Module, TypeSection};
    let mut types = TypeSection::new();
    types.ty().function([], []);
    let (mut functions, mut code) = (FunctionSection::new(), CodeSection::new());
    for _ in 0..count {
        functions.function(0);
        let mut body = Function::new([]);
        body.instruction(&Instruction::End);
        code.function(&body);
    }
    let mut module = Module::new();
    module.section(&types).section(&functions).section(&code);
    let mut component = wasm_encoder::Component::new();
    component.section(&wasm_encoder::ModuleSection(&module));
    component.finish()
}

#[tokio::test(flavor = "multi_thread")]
async fn deeply_nested_components_are_refused_before_translation() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("deep.wasm"), nested_component(1_000)).unwrap();
    let message = load_errors_with(dir.path(), LoadCaps::default()).await;
    assert!(message.contains("deep.wasm") && message.contains("max_nesting"), "{message}");
}

#[tokio::test(flavor = "multi_thread")]
async fn too_many_functions_are_refused_before_compilation() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("wide.wasm"), component_with_functions(2_000)).unwrap();
    let caps = LoadCaps { max_functions: 1_000, ..LoadCaps::default() };
    let message = load_errors_with(dir.path(), caps).await;
    assert!(message.contains("wide.wasm") && message.contains("max_functions"), "{message}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_file_over_the_size_cap_is_refused_without_reading_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = std::fs::File::create(dir.path().join("huge.wasm")).unwrap();
    file.set_len(2 << 20).unwrap();
    let caps = LoadCaps { max_file_bytes: 1 << 20, ..LoadCaps::default() };
    let message = load_errors_with(dir.path(), caps).await;
    assert!(message.contains("huge.wasm") && message.contains("max_file_bytes"), "{message}");
}

#[tokio::test(flavor = "multi_thread")]
async fn manifests_over_the_caps_are_refused() {
    let cases = [
        ("max_tools", LoadCaps { max_tools: 5, ..LoadCaps::default() }),
        ("max_description_bytes", LoadCaps { max_description_bytes: 8, ..LoadCaps::default() }),
        ("max_schema_bytes", LoadCaps { max_schema_bytes: 16, ..LoadCaps::default() }),
    ];
    for (cap, caps) in cases {
        let dir = tempfile::tempdir().unwrap();
        install(dir.path(), "hostile", "big", None);
        let message = load_errors_with(dir.path(), caps).await;
        assert!(message.contains("big.wasm") && message.contains(cap), "{cap}: {message}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn odd_entries_in_a_plugin_directory_are_reported_not_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join("adir.wasm")).unwrap();
    std::os::unix::fs::symlink(d.join("nowhere"), d.join("dangling.wasm")).unwrap();
    let fifo = std::ffi::CString::new(d.join("fifo.wasm").to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    std::os::unix::fs::symlink("/dev/zero", d.join("zero.wasm")).unwrap();
    install(outside.path(), "minimal", "away", None);
    std::os::unix::fs::symlink(outside.path().join("away.wasm"), d.join("away.wasm")).unwrap();
    install(d, "minimal", "notes", Some(NOTES_POLICY));
    std::os::unix::fs::symlink(d.join("notes.wasm"), d.join("alias.wasm")).unwrap();

    let message = load_errors_with(d, LoadCaps::default()).await;
    for name in ["adir.wasm", "dangling.wasm", "fifo.wasm", "zero.wasm", "away.wasm"] {
        assert!(message.contains(name), "{name} is not reported: {message}");
    }
    assert!(!message.contains("notes.wasm") && !message.contains("alias.wasm"), "{message}");

    // An operator may allow links out of the directory; a device is still no plugin.
    let caps = LoadCaps { follow_links_out: true, ..LoadCaps::default() };
    let options = RuntimeOptions { load: caps, cache_dir: Some(shared_cache()), ..dir_options(d, None) };
    let (runtime, errors) = Runtime::load_partial(options).await.unwrap();
    assert!(runtime.plugin("away").is_some() && runtime.plugin("alias").is_some(), "{:?}", names(&runtime));
    let text = errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n");
    assert!(text.contains("zero.wasm") && !text.contains("away.wasm"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_that_fails_to_load_does_not_stop_the_others() {
    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "minimal", "notes", Some(NOTES_POLICY));
    std::fs::write(dir.path().join("core.wasm"), b"\0asm\x01\0\0\0").unwrap();
    let options = RuntimeOptions { cache_dir: Some(shared_cache()), ..dir_options(dir.path(), None) };
    let (runtime, errors) = Runtime::load_partial(options).await.expect("the good plugins serve");
    assert_eq!(names(&runtime), ["notes"]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].to_string().contains("core.wasm"), "{}", errors[0]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_spinning_manifest_is_cut_at_the_load_budget_whatever_its_policy() {
    let dir = tempfile::tempdir().unwrap();
    let policy = "[limits]\nfuel = 50_000_000_000\ndeadline_ms = 20_000\n";
    install(dir.path(), "slow_manifest", "slow", Some(policy));
    install(dir.path(), "minimal", "notes", Some(NOTES_POLICY));
    let options = RuntimeOptions { cache_dir: Some(shared_cache()), ..dir_options(dir.path(), None) };
    let (runtime, errors) = Runtime::load_partial(options).await.expect("the good plugins serve");
    assert_eq!(names(&runtime), ["notes"]);
    let text = errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n");
    assert!(text.contains("slow.wasm") && text.contains("load cap manifest_"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_spinning_manifest_is_cut_at_the_load_budget_even_when_the_operator_grants_more() {
    let dir = tempfile::tempdir().unwrap();
    let limits = "fuel = 50_000_000_000\ndeadline_ms = 20_000\n";
    install(dir.path(), "slow_manifest", "slow", Some(&format!("[limits]\n{limits}")));
    let operator = Operator::parse(&format!("[plugins.slow.limits]\n{limits}"), dir.path()).unwrap();
    let options = RuntimeOptions { operator, cache_dir: Some(shared_cache()), ..dir_options(dir.path(), None) };
    let (runtime, errors) = Runtime::load_partial(options).await.expect("loads");
    assert!(runtime.plugin("slow").is_none());
    let text = errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n");
    // Cut at the load budget (1e9 fuel, 1 s), not at the 5e10 fuel / 20 s the plugin may use in a call.
    let at_budget = text.contains("(1000000000 units)") || text.contains("longer than 1000 ms");
    assert!(text.contains("slow.wasm") && at_budget, "{text}");
}

#[test]
fn names_over_the_caps_are_refused_by_the_store() {
    let mut txn = Txn::new(State::default(), WriteQuota::default());
    let long = "n".repeat(4096);
    for (ns, key) in [(long.as_str(), "k"), ("ns", long.as_str())] {
        let err = txn.put(ns, key, "1").unwrap_err();
        assert!(err.to_string().contains("length cap"), "{err}");
        assert!(txn.delete(ns, key).unwrap_err().to_string().contains("length cap"));
    }
    assert!(txn.is_read_only());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fifo_planted_at_a_cache_entry_does_not_hang_loading() {
    let plugins = notes_dir();
    let (warm, cache) = (private_dir(), private_dir());
    let (entry, _) = warm_entry(plugins.path(), warm.path()).await;
    let planted = std::ffi::CString::new(cache.path().join(entry.file_name().unwrap()).to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(planted.as_ptr(), 0o600) }, 0);
    // A generous bound: without it a regression would hang the test binary instead of failing.
    let loaded = tokio::time::timeout(std::time::Duration::from_secs(120), load_notes(plugins.path(), cache.path()));
    assert_eq!(loaded.await.expect("loading hung on a FIFO"), CompileSource::Compiled);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_policy_that_is_a_fifo_or_huge_is_reported_not_waited_on() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    install(d, "minimal", "piped", None);
    let fifo = std::ffi::CString::new(d.join("piped.policy.toml").to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    install(d, "minimal", "bloated", None);
    std::fs::write(d.join("bloated.policy.toml"), format!("# {}\n", "x".repeat(1 << 20))).unwrap();
    install(d, "minimal", "fine", None);
    let options = RuntimeOptions { cache_dir: Some(shared_cache()), ..dir_options(d, None) };
    let (runtime, errors) = Runtime::load_partial(options).await.unwrap();
    let errors: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors.iter().any(|e| e.contains("piped.policy.toml") && e.contains("not a regular file")), "{errors:?}");
    assert!(errors.iter().any(|e| e.contains("bloated.policy.toml") && e.contains("policy size")), "{errors:?}");
    assert!(runtime.plugin("fine").is_some());
}
