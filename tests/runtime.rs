//! The plugin runtime through its public API: containment of hostile plugins, refusal of
//! malformed ones, limits from policies and overrides, atomic writes, the compile cache.

use crate::support;

use std::path::Path;
use std::time::{Duration, Instant};

use sagabox::runtime::{
    CallContext, CallError, CallOptions, CompileSource, LimitOverrides, Operator, Runtime, RuntimeOptions,
};
use sagabox::store::{MemoryStore, State};
use serde_json::{Value, json};
use support::*;

fn context(key: &str) -> CallOptions {
    CallOptions {
        context: CallContext { saga_id: "test".into(), step_id: "s".into(), attempt: 1, idempotency_key: key.into() },
        ..CallOptions::default()
    }
}

fn with_limits(limits: LimitOverrides) -> CallOptions {
    CallOptions { limits, ..context("k") }
}

/// Calls `hostile.<tool>` and returns its error, checking the store did not change and that
/// the runtime still serves a well-behaved call afterwards.
async fn contained(runtime: &Runtime, tool: &str, args: Value, options: CallOptions) -> CallError {
    let store = MemoryStore::new(travel_state());
    let before = store.snapshot().digest();
    let started = Instant::now();
    let outcome = runtime.call(&format!("hostile.{tool}"), &args, &options, &store).await;
    assert!(started.elapsed() < Duration::from_secs(5), "hostile.{tool} was not stopped in time");
    let error = outcome.result.expect_err(&format!("hostile.{tool} should fail"));
    assert!(outcome.changes.is_empty(), "hostile.{tool} left writes behind");
    assert_eq!(store.snapshot().digest(), before, "hostile.{tool} changed the store");
    assert!(store.snapshot().namespace("scratch").is_none());
    let next = runtime.call("airline.book", &book_args(1), &context("next"), &store).await;
    assert!(next.result.is_ok(), "the call after hostile.{tool} failed: {:?}", next.result);
    error
}

#[tokio::test(flavor = "multi_thread")]
async fn every_hostile_tool_is_contained_with_its_typed_error() {
    let runtime = runtime().await;
    let none = || with_limits(LimitOverrides::default());

    let e = contained(&runtime, "spin", json!({}), none()).await;
    assert!(matches!(&e, CallError::OutOfFuel { tool, fuel: 1_000_000_000 } if tool == "hostile.spin"), "{e}");

    let spin_long = LimitOverrides { fuel: Some(u64::MAX / 2), deadline_ms: Some(150), ..Default::default() };
    let e = contained(&runtime, "spin", json!({}), with_limits(spin_long)).await;
    assert!(matches!(e, CallError::DeadlineExceeded { deadline_ms: 150, .. }), "{e}");

    let e = contained(&runtime, "grow", json!({}), none()).await;
    assert!(matches!(e, CallError::MemoryLimit { memory_mib: 64, .. }), "{e}");

    let e = contained(&runtime, "recurse", json!({}), none()).await;
    assert!(matches!(e, CallError::StackOverflow { stack_kib: 512, .. }), "{e}");

    let e = contained(&runtime, "trap", json!({}), none()).await;
    match &e {
        CallError::Trap { message, backtrace, .. } => {
            assert!(message.contains("panicked on purpose"), "{message}");
            assert!(backtrace.contains("hostile.wasm"), "{backtrace}");
        }
        other => panic!("expected a trap, got {other}"),
    }

    let e = contained(&runtime, "flood", json!({}), none()).await;
    assert!(matches!(e, CallError::OutputTooLarge { limit: 1_048_576, .. }), "{e}");

    let e = contained(&runtime, "read_file", json!({ "path": "/etc/hostname" }), none()).await;
    assert!(matches!(&e, CallError::AccessDenied { what, .. } if what.contains("filesystem")), "{e}");

    let e = contained(&runtime, "connect", json!({ "address": "127.0.0.1:9" }), none()).await;
    assert!(matches!(&e, CallError::AccessDenied { what, .. } if what.contains("network")), "{e}");

    let e = contained(&runtime, "trespass", json!({ "namespace": "flights" }), none()).await;
    assert!(matches!(&e, CallError::AccessDenied { what, .. } if what.contains("'flights'")), "{e}");

    let sleep = LimitOverrides { deadline_ms: Some(200), ..Default::default() };
    let started = Instant::now();
    let e = contained(&runtime, "sleep", json!({ "seconds": 3600 }), with_limits(sleep)).await;
    assert!(matches!(e, CallError::DeadlineExceeded { deadline_ms: 200, .. }), "{e}");
    assert!(started.elapsed() < Duration::from_secs(3));
}

/// `store.find` from a sandbox: the host filters, sees the call's own writes, refuses a
/// condition that is not JSON with the namespace and path named, and stops a find in a
/// namespace the policy does not grant as it stops a `get` there.
#[tokio::test(flavor = "multi_thread")]
async fn a_find_filters_on_the_host_within_the_plugins_grants() {
    let runtime = runtime().await;
    let store = MemoryStore::new(travel_state());
    let snoop = |namespace: &str, path: Value, value: &str| json!({ "namespace": namespace, "conditions": [{ "path": path, "value": value }] });
    let call = |args: Value| {
        let store = &store;
        let runtime = &runtime;
        async move { runtime.call("hostile.snoop", &args, &context("k"), store).await.result }
    };
    // Every hostile call first writes scratch/<tool> = {"started": true}: a write of its own.
    assert_eq!(call(snoop("scratch", json!(["started"]), "true")).await.unwrap(), json!(["snoop"]));
    assert_eq!(call(snoop("scratch", json!(["started"]), "false")).await.unwrap(), json!([]));
    assert_eq!(call(snoop("scratch", json!(["started", "x"]), "true")).await.unwrap(), json!([]));
    let e = call(snoop("scratch", json!(["started"]), "{tru")).await.unwrap_err();
    assert!(
        matches!(&e, CallError::InvalidInput { message, .. } if message.contains("scratch") && message.contains("'started'")),
        "{e}"
    );
    let e = contained(&runtime, "snoop", snoop("flights", json!(["origin"]), r#""SFO""#), CallOptions::default()).await;
    assert!(matches!(&e, CallError::AccessDenied { what, .. } if what.contains("'flights'")), "{e}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_host_environment_never_reaches_a_plugin() {
    assert!(std::env::var("PATH").is_ok());
    let runtime = runtime().await;
    let store = MemoryStore::new(travel_state());
    let outcome = runtime.call("hostile.env", &json!({}), &context("k"), &store).await;
    let output = outcome.result.unwrap();
    assert_eq!(output["all"], json!({}), "the plugin saw host variables: {output}");
    let named = runtime.call("hostile.env", &json!({ "name": "PATH" }), &context("k2"), &store).await;
    assert!(matches!(named.result, Err(CallError::Rejected { .. })), "{:?}", named.result);
}

/// The interfaces a component imports (its instance imports, nested components' included).
fn imported_interfaces(component: &[u8]) -> Vec<String> {
    let mut names = Vec::new();
    for payload in wasmparser::Parser::new(0).parse_all(component) {
        if let wasmparser::Payload::ComponentImportSection(section) = payload.expect("a valid component") {
            for import in section {
                let import = import.unwrap();
                if matches!(import.ty, wasmparser::ComponentTypeRef::Instance(_)) {
                    names.push(import.name.name.to_string());
                }
            }
        }
    }
    names
}

/// The bundled tools need no WASI and are built without it (host/build.rs): each import is
/// linked at every call's instantiation, and a WASI build of a Rust plugin imports 19
/// functions of it it never calls. Only `hostile`, which tests what WASI lets a plugin reach,
/// keeps it.
#[tokio::test(flavor = "multi_thread")]
async fn the_bundled_tools_import_only_their_store_log_and_stderr() {
    let runtime = runtime().await;
    let allowed =
        ["sagabox:plugin/store@", "sagabox:plugin/log@", "wasi:cli/stderr@", "wasi:io/streams@", "wasi:io/error@"];
    let mut checked = 0;
    for plugin in runtime.plugins().filter(|p| p.name != "hostile") {
        let wasm = sagabox::runtime::bundled_wasm(&plugin.name).expect("a bundled plugin");
        let imports = imported_interfaces(wasm);
        assert!(imports.iter().any(|i| i.starts_with("sagabox:plugin/store@")), "{}: {imports:?}", plugin.name);
        for import in &imports {
            assert!(allowed.iter().any(|a| import.starts_with(a)), "{} imports {import}", plugin.name);
        }
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} bundled tools checked");
}

/// The `bare` fixture (built without WASI) loaded from a directory.
async fn bare_runtime(dir: &Path) -> Runtime {
    install(dir, "bare", "bare");
    runtime_with(&[dir]).await
}

/// Without WASI the standard library writes a panic's message nowhere; the toolkit writes it
/// to stderr, where the host reads it into the trap's message.
#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_built_without_wasi_still_reports_its_panic() {
    assert!(!imported_interfaces(&std::fs::read(artifact("bare")).unwrap()).iter().any(|i| i.contains("environment")));
    let dir = tempfile::tempdir().unwrap();
    let runtime = bare_runtime(dir.path()).await;
    let store = MemoryStore::new(State::default());
    let outcome = runtime.call("bare.panic", &json!({ "message": "the rug" }), &context("k"), &store).await;
    match outcome.result {
        Err(CallError::Trap { message, .. }) => assert!(message.contains("bare says: the rug"), "{message}"),
        other => panic!("expected a trap, got {other:?}"),
    }
}

/// Without WASI the call heap carves its chunks from the initial memory's free part, and the
/// system allocator grows the memory past it: 4 MB of small blocks beside a 64 KiB one take
/// both, and no block may lie on another.
#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_built_without_wasi_keeps_its_heap_and_its_grown_memory_apart() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = bare_runtime(dir.path()).await;
    let store = MemoryStore::new(State::default());
    for blocks in [0, 10, 1000] {
        let outcome = runtime.call("bare.churn", &json!({ "blocks": blocks }), &context("k"), &store).await;
        let output = outcome.result.unwrap_or_else(|e| panic!("{blocks} blocks: {e}"));
        assert_eq!(output, json!({ "blocks": blocks, "damaged": 0 }), "{blocks} blocks");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_built_without_wasi_fills_its_initial_memory_before_growing_it() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = bare_runtime(dir.path()).await;
    let store = MemoryStore::new(State::default());
    let pages = |kib: u64| {
        let (runtime, store) = (&runtime, &store);
        async move {
            let outcome = runtime.call("bare.fill", &json!({ "kib": kib }), &context("k"), store).await;
            let output = outcome.result.unwrap_or_else(|e| panic!("{kib} KiB: {e}"));
            (output["pages_before"].as_u64().unwrap(), output["pages_after"].as_u64().unwrap())
        }
    };
    // The free part is about 990 KiB (2 MiB of initial memory, less 1 MiB of stack and the
    // data). A heap that takes only whole chunks, doubling from 2 KiB, grows the memory past
    // ~510 KiB: 800 lies between.
    let (before, after) = pages(800).await;
    assert_eq!(after, before, "800 KiB of small blocks grew the memory from {before} to {after} pages");
    let (before, after) = pages(4000).await;
    assert!(after > before, "4,000 KiB must grow the memory past its {before} pages");
}

/// Puts a plugin file into a directory.
type Setup = Box<dyn Fn(&Path)>;

/// Copies a built plugin into `dir` under `name`.
fn install(dir: &Path, artifact_name: &str, name: &str) {
    std::fs::copy(artifact(artifact_name), dir.join(format!("{name}.wasm"))).unwrap();
}

async fn load_error(dir: &Path) -> String {
    let options = RuntimeOptions { bundled: false, plugin_dirs: vec![dir.to_path_buf()], ..options() };
    match Runtime::load(options).await {
        Ok(_) => panic!("{} should not load", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_plugins_are_rejected_naming_the_file_and_the_reason() {
    let component = std::fs::read(artifact("hotel")).unwrap();
    let cases: Vec<(&str, Setup, &str)> = vec![
        (
            "core",
            Box::new(|d| std::fs::write(d.join("core.wasm"), b"\0asm\x01\0\0\0").unwrap()),
            "core WebAssembly module",
        ),
        ("noise", Box::new(|d| std::fs::write(d.join("noise.wasm"), [7u8; 300]).unwrap()), "not a WebAssembly file"),
        (
            "half",
            Box::new(move |d| std::fs::write(d.join("half.wasm"), &component[..component.len() / 2]).unwrap()),
            "not a valid component",
        ),
        ("wrong_world", Box::new(|d| install(d, "wrong_world", "wrong_world")), "not a sagabox plugin"),
        ("bad_schema", Box::new(|d| install(d, "bad_schema", "bad_schema")), "not a valid JSON Schema"),
        ("bad_compensator", Box::new(|d| install(d, "bad_compensator", "bad_compensator")), "'unbook'"),
        ("dup_tools", Box::new(|d| install(d, "dup_tools", "dup_tools")), "listed twice"),
        ("Bad.Name", Box::new(|d| install(d, "hotel", "Bad.Name")), "not a valid plugin name"),
    ];
    for (name, setup, reason) in cases {
        let dir = tempfile::tempdir().unwrap();
        setup(dir.path());
        let message = load_error(dir.path()).await;
        assert!(message.contains(&format!("{name}.wasm")), "{name}: the error does not name the file: {message}");
        assert!(message.contains(reason), "{name}: expected '{reason}' in: {message}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_policies_and_name_clashes_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "hotel", "inn");
    std::fs::write(dir.path().join("inn.policy.toml"), "[limits]\nfule = 1\n").unwrap();
    let message = load_error(dir.path()).await;
    assert!(message.contains("inn.policy.toml") && message.contains("fule"), "{message}");

    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "hotel", "airline");
    let options = RuntimeOptions { plugin_dirs: vec![dir.path().to_path_buf()], ..options() };
    let message = Runtime::load(options).await.err().expect("a clash").to_string();
    assert!(message.contains("two plugins are named 'airline'"), "{message}");
}

/// A policy asking for everything: the host's root, its environment, any network, every
/// namespace, limits far above the defaults.
const GREEDY_POLICY: &str = r#"
[store]
write = ["*", "scratch"]
[limits]
fuel = 50_000_000_000
deadline_ms = 86_400_000
output_kib = 1_000_000
writes = 1_000_000_000
[wasi]
env = ["PATH", "HOME"]
network = true
dirs = [{ host = "/", guest = "/host", writable = true }, { host = "../..", guest = "/up" }]
"#;

#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_policy_alone_grants_no_host_access_and_no_more_than_the_default_limits() {
    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "hostile", "greedy");
    std::fs::write(dir.path().join("greedy.policy.toml"), GREEDY_POLICY).unwrap();
    let runtime = runtime_with(&[dir.path()]).await;
    let store = MemoryStore::new(travel_state());
    let call = |tool: &'static str, args: Value| {
        let (runtime, store) = (&runtime, &store);
        async move { runtime.call(&format!("greedy.{tool}"), &args, &context("k"), store).await.result }
    };
    for path in ["/host/etc/hostname", "/up/etc/hostname"] {
        let read = call("read_file", json!({ "path": path })).await;
        assert!(matches!(&read, Err(CallError::AccessDenied { what, .. }) if what.contains("filesystem")), "{read:?}");
    }
    assert_eq!(call("env", json!({})).await.unwrap()["all"], json!({}));
    let connect = call("connect", json!({ "address": "127.0.0.1:9" })).await;
    assert!(matches!(&connect, Err(CallError::AccessDenied { what, .. }) if what.contains("network")), "{connect:?}");
    let trespass = call("trespass", json!({ "namespace": "flights" })).await;
    assert!(
        matches!(&trespass, Err(CallError::AccessDenied { what, .. }) if what.contains("'flights'")),
        "{trespass:?}"
    );
    assert_eq!(runtime.plugin("greedy").unwrap().limits, sagabox::runtime::Limits::default());
}

/// The bundled plugins and those of `dir`, under the operator's `ceiling` (its directories
/// relative to `dir`).
async fn runtime_under(dir: &Path, ceiling: &str) -> Runtime {
    let operator = Operator::parse(ceiling, dir).expect("a valid operator file");
    Runtime::load(RuntimeOptions { plugin_dirs: vec![dir.to_path_buf()], operator, ..options() }).await.unwrap()
}

/// Whether `listener` has a connection waiting.
fn was_reached(listener: &std::net::TcpListener) -> bool {
    listener.set_nonblocking(true).unwrap();
    listener.accept().is_ok()
}

#[tokio::test(flavor = "multi_thread")]
async fn network_grants_are_host_port_allow_lists_enforced_at_lookup_and_connect() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (port, other_port) = (listener.local_addr().unwrap().port(), other.local_addr().unwrap().port());
    let dir = tempfile::tempdir().unwrap();
    for name in ["net", "netless"] {
        install(dir.path(), "hostile", name);
        let policy = format!("[store]\nwrite = [\"scratch\"]\n[wasi]\nnetwork = [\"localhost:{port}\"]\n");
        std::fs::write(dir.path().join(format!("{name}.policy.toml")), policy).unwrap();
    }
    let runtime = runtime_under(dir.path(), &format!("[plugins.net.wasi]\nnetwork = [\"localhost:{port}\"]\n")).await;
    let store = MemoryStore::new(travel_state());
    let connect = |plugin: &'static str, address: String| {
        let (runtime, store) = (&runtime, &store);
        async move {
            let args = json!({ "address": address });
            runtime.call(&format!("{plugin}.connect"), &args, &context("k"), store).await.result
        }
    };

    // Looked up by name, connected on the granted port; the listener saw it.
    let ok = connect("net", format!("localhost:{port}")).await;
    assert_eq!(ok.unwrap(), json!({ "connected": format!("localhost:{port}") }));
    assert!(was_reached(&listener));
    let ok = connect("net", format!("127.0.0.1:{port}")).await;
    assert!(ok.is_ok(), "an address the granted name resolves to: {ok:?}");

    let denied = |result: &Result<Value, CallError>, needle: &str| matches!(result, Err(CallError::AccessDenied { what, .. }) if what.contains(needle));
    let e = connect("net", format!("localhost:{other_port}")).await;
    assert!(denied(&e, &format!("127.0.0.1:{other_port} is not granted")), "{e:?}");
    assert!(!was_reached(&other), "a port that is not granted was reached");
    let e = connect("net", format!("example.invalid:{port}")).await;
    assert!(denied(&e, "'example.invalid' is not granted"), "{e:?}");
    // The same request without the operator's grant: no network at all.
    let e = connect("netless", format!("localhost:{port}")).await;
    assert!(denied(&e, "network access is not granted"), "{e:?}");
    assert!(runtime.plugin("netless").unwrap().grant.refused.iter().any(|r| r.contains(&format!("localhost:{port}"))));
}

#[tokio::test(flavor = "multi_thread")]
async fn directory_grants_are_canonical_and_confined_to_the_operators_roots() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("allowed");
    std::fs::create_dir_all(root.join("shared")).unwrap();
    std::fs::write(root.join("shared/note.txt"), "inside").unwrap();
    std::fs::create_dir(dir.path().join("secret")).unwrap();
    std::fs::write(dir.path().join("secret/key.txt"), "outside").unwrap();
    std::os::unix::fs::symlink(dir.path().join("secret"), root.join("link")).unwrap();
    install(dir.path(), "hostile", "reader");
    std::fs::write(
        dir.path().join("reader.policy.toml"),
        "[store]\nwrite = [\"scratch\"]\n[wasi]\ndirs = [{ host = \"allowed/shared\", guest = \"/shared\" }, \
         { host = \"allowed/../secret\", guest = \"/up\" }, { host = \"allowed/link\", guest = \"/link\" }, \
         { host = \"/\", guest = \"/host\" }]\n",
    )
    .unwrap();
    let runtime = runtime_under(dir.path(), "[plugins.reader.wasi]\ndirs = [{ host = \"allowed\" }]\n").await;
    let store = MemoryStore::new(travel_state());
    let read = |path: &'static str| {
        let (runtime, store) = (&runtime, &store);
        async move { runtime.call("reader.read_file", &json!({ "path": path }), &context("k"), store).await.result }
    };
    assert_eq!(read("/shared/note.txt").await.unwrap()["contents"], "inside");
    for path in ["/up/key.txt", "/link/key.txt", "/host/etc/hostname"] {
        let e = read(path).await;
        assert!(matches!(&e, Err(CallError::Rejected { .. })), "{path} was readable: {e:?}");
    }
    let reader = runtime.plugin("reader").unwrap();
    let canonical = std::fs::canonicalize(&root).unwrap();
    assert_eq!(reader.grant.policy.wasi.dirs.len(), 1);
    assert_eq!(reader.grant.policy.wasi.dirs[0].host, canonical.join("shared"));
    for asked in ["allowed/../secret", "allowed/link", "\"/\""] {
        let line = reader.grant.refused.iter().find(|r| r.contains(asked)).unwrap_or_else(|| panic!("{asked}"));
        assert!(line.contains("plugin 'reader'"), "{line}");
        assert!(line.contains(&format!("({})", canonical.display())), "the message names the allowed roots: {line}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn fuel_used_by_the_same_call_is_the_same_every_time() {
    let runtime = runtime().await;
    let mut used = Vec::new();
    for _ in 0..3 {
        let store = MemoryStore::new(travel_state());
        let outcome = runtime.call("airline.book", &book_args(1), &context("same-key"), &store).await;
        assert!(outcome.result.is_ok(), "{:?}", outcome.result);
        used.push(outcome.fuel_used);
    }
    assert!(used[0] > 0);
    assert!(used.iter().all(|u| *u == used[0]), "fuel differs between runs: {used:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn policy_limits_and_per_call_overrides_take_effect() {
    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "hostile", "tight");
    std::fs::write(
        dir.path().join("tight.policy.toml"),
        "[store]\nwrite = [\"scratch\"]\n[limits]\nfuel = 2000000\nmemory_mib = 16\nstack_kib = 128\n",
    )
    .unwrap();
    let runtime = runtime_with(&[dir.path()]).await;
    let store = MemoryStore::new(travel_state());
    let call = |tool: &'static str, limits: LimitOverrides| {
        let (runtime, store) = (&runtime, &store);
        async move { runtime.call(tool, &json!({}), &with_limits(limits), store).await.result.unwrap_err() }
    };
    let none = LimitOverrides::default;

    assert!(matches!(call("tight.spin", none()).await, CallError::OutOfFuel { fuel: 2_000_000, .. }));
    let more = LimitOverrides { fuel: Some(3_000_000), ..none() };
    assert!(matches!(call("tight.spin", more).await, CallError::OutOfFuel { fuel: 3_000_000, .. }));

    // Filling 16 MiB takes more than the policy's 2M fuel: raise it to reach the memory cap.
    let fueled = || LimitOverrides { fuel: Some(1_000_000_000), ..none() };
    assert!(matches!(call("tight.grow", fueled()).await, CallError::MemoryLimit { memory_mib: 16, .. }));
    let less = LimitOverrides { memory_mib: Some(4), ..fueled() };
    assert!(matches!(call("tight.grow", less).await, CallError::MemoryLimit { memory_mib: 4, .. }));

    assert!(matches!(call("tight.recurse", none()).await, CallError::StackOverflow { stack_kib: 128, .. }));
    let deeper = LimitOverrides { stack_kib: Some(1024), ..none() };
    assert!(matches!(call("tight.recurse", deeper).await, CallError::StackOverflow { stack_kib: 1024, .. }));

    let small = LimitOverrides { output_kib: Some(1), ..none() };
    let e = runtime.call("tight.flood", &json!({ "bytes": 2048 }), &with_limits(small), &store).await;
    assert!(matches!(e.result, Err(CallError::OutputTooLarge { limit: 1024, .. })), "{:?}", e.result);
    let fits = runtime.call("tight.flood", &json!({ "bytes": 2048 }), &context("k"), &store).await;
    assert_eq!(fits.result.unwrap().as_str().map(str::len), Some(2048));

    let impossible = LimitOverrides { memory_mib: Some(1 << 20), ..none() };
    assert!(matches!(call("tight.grow", impossible).await, CallError::InvalidInput { .. }));
}

#[tokio::test(flavor = "multi_thread")]
async fn writes_apply_atomically_and_only_on_success() {
    let runtime = runtime().await;
    let store = MemoryStore::new(travel_state());
    let initial = store.snapshot();

    let booked = runtime.call("airline.book", &book_args(2), &context("a"), &store).await;
    let output = booked.result.unwrap();
    assert_eq!(output["arrivalTime"], "2024-05-16T14:30:00");
    let touched: Vec<_> = booked.changes.iter().map(|c| format!("{}/{}", c.namespace, c.key)).collect();
    assert_eq!(
        touched,
        ["flights/HAT001".to_string(), format!("reservations/{}", output["confirmationNumber"].as_str().unwrap())]
    );

    let after_booking = store.snapshot().digest();
    let refused = runtime.call("airline.book", &book_args(1), &context("b"), &store).await;
    assert!(matches!(refused.result, Err(CallError::Rejected { .. })), "{:?}", refused.result);
    assert_eq!(store.snapshot().digest(), after_booking);

    let bad = runtime.call("airline.book", &json!({ "flight_number": 7 }), &context("c"), &store).await;
    match bad.result {
        Err(CallError::InvalidInput { message, .. }) => assert!(message.contains("schema"), "{message}"),
        other => panic!("expected invalid input, got {other:?}"),
    }

    let cancel = json!({ "confirmationNumber": output["confirmationNumber"] });
    runtime.call("airline.cancel", &cancel, &context("d"), &store).await.result.unwrap();
    assert_eq!(store.snapshot().digest(), initial.digest(), "cancel did not restore the booking's state");
    let again = runtime.call("airline.cancel", &cancel, &context("e"), &store).await.result.unwrap();
    assert_eq!(again["reason"], "nothing to undo");
}

#[tokio::test(flavor = "multi_thread")]
async fn store_access_is_limited_to_granted_namespaces() {
    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "airline", "readonly_air");
    std::fs::write(dir.path().join("readonly_air.policy.toml"), "[store]\nread = [\"flights\", \"reservations\"]\n")
        .unwrap();
    let runtime = runtime_with(&[dir.path()]).await;
    let store = MemoryStore::new(travel_state());
    let search = json!({ "origin": "SFO", "destination": "JFK", "date": "2024-05-16" });
    let found = runtime.call("readonly_air.search", &search, &context("s"), &store).await;
    assert_eq!(found.result.unwrap()["flights"][0]["flight_number"], "HAT001");
    let booked = runtime.call("readonly_air.book", &book_args(1), &context("b"), &store).await;
    assert!(
        matches!(&booked.result, Err(CallError::AccessDenied { what, .. }) if what.contains("'flights' is not granted for writing")),
        "{:?}",
        booked.result
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_calls_on_one_store_lose_no_update() {
    let runtime = std::sync::Arc::new(runtime().await);
    let store = std::sync::Arc::new(MemoryStore::new(travel_state()));
    let mut tasks = Vec::new();
    for i in 0..24 {
        let (runtime, store) = (runtime.clone(), store.clone());
        tasks.push(tokio::spawn(async move {
            let args = json!({ "pool_id": "gpu", "amount": 2 });
            runtime.call("resources.allocate", &args, &context(&format!("key-{i:02}")), &store).await
        }));
    }
    let mut granted = 0;
    for task in tasks {
        if task.await.unwrap().result.is_ok() {
            granted += 1;
        }
    }
    assert_eq!(granted, 24);
    let pool: Value = serde_json::from_str(&store.snapshot().get("pools", "gpu").unwrap().text).unwrap();
    assert_eq!(pool["allocated"], 48);
    assert_eq!(store.snapshot().namespace("allocations").unwrap().len(), 24);
}

#[tokio::test(flavor = "multi_thread")]
async fn compiled_plugins_are_cached_and_a_bad_entry_is_a_miss() {
    let cache = tempfile::tempdir().unwrap();
    let options = || RuntimeOptions { cache_dir: Some(cache.path().to_path_buf()), ..RuntimeOptions::default() };
    let first = Runtime::load(options()).await.unwrap();
    assert!(first.plugins().all(|p| p.compiled == CompileSource::Compiled));
    drop(first);
    let second = Runtime::load(options()).await.unwrap();
    assert!(second.plugins().all(|p| p.compiled == CompileSource::Cached));
    let hotel_sha = second.plugin("hotel").unwrap().sha256.clone();
    drop(second);

    let entry = std::fs::read_dir(cache.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with(&hotel_sha))
        .expect("a cache entry for hotel");
    replace_cache_entry(&entry, b"not a compiled component");
    let third = Runtime::load(options()).await.unwrap();
    assert_eq!(third.plugin("hotel").unwrap().compiled, CompileSource::Compiled);
    assert_eq!(third.plugin("airline").unwrap().compiled, CompileSource::Cached);
    let store = MemoryStore::new(sagabox::store::State::default());
    let e = third
        .call("hotel.reserve", &json!({ "hotel_id": "nowhere", "check_in": "2024-05-16" }), &context("k"), &store)
        .await;
    assert!(matches!(e.result, Err(CallError::Rejected { .. })), "{:?}", e.result);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_readme_example_plugin_loads_and_undoes_its_effect() {
    let dir = tempfile::tempdir().unwrap();
    install(dir.path(), "minimal", "notes");
    std::fs::write(dir.path().join("notes.policy.toml"), "[store]\nwrite = [\"notes\"]\n").unwrap();
    let runtime = runtime_with(&[dir.path()]).await;
    let store = MemoryStore::new(travel_state());
    let initial = store.snapshot().digest();
    let key = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let added = runtime.call("notes.add", &json!({ "text": "hi" }), &context(key), &store).await;
    assert_eq!(added.result.unwrap()["id"], "note-0123456789ab");
    assert_eq!(&*store.snapshot().get("notes", "note-0123456789ab").unwrap().text, r#"{"text":"hi"}"#);
    // As a compensator whose forward reply was lost: only the forward key is known.
    let undo = json!({ "forward": { "arguments": { "text": "hi" }, "output": null, "idempotency_key": key } });
    let removed = runtime.call("notes.remove", &undo, &context("undo"), &store).await;
    assert_eq!(removed.result.unwrap()["removed"], true);
    assert_eq!(store.snapshot().digest(), initial);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_that_writes_a_lot_to_stderr_still_succeeds() {
    // stderr is kept only for trap messages: what does not fit is dropped, never an error.
    let runtime = runtime().await;
    let store = MemoryStore::new(travel_state());
    let outcome = runtime.call("hostile.chatter", &json!({ "bytes": 256 << 10 }), &context("k"), &store).await;
    assert_eq!(outcome.result.unwrap(), json!({ "wrote": 262144 }));
}
