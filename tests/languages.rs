//! Plugins in JavaScript, Python and Rust, built with their authors' pinned toolchains
//! (installed by the tests on first use, see support/toolchains.rs), loaded and verified
//! through the `sagabox` binary; `sagabox new` writes those very projects; the host's
//! `wasi:http`, which a default componentize-js build imports, reaches only granted hosts.
//!
//! The build and load times each test measures are printed on stderr
//! (`cargo test --release --test end_to_end -- languages:: --nocapture`).

use crate::support;
use crate::support::toolchains;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use sagabox::runtime::{CallContext, CallError, CallOptions, Operator, Runtime, RuntimeOptions};
use sagabox::store::{MemoryStore, State};
use serde_json::{Value, json};
use support::artifact;
use toolchains::Lang;

/// A one-request-per-connection HTTP server on 127.0.0.1 that answers every request with
/// `body`, recording each request line it saw. Returns its port.
fn http_server(body: &'static str) -> (u16, std::sync::mpsc::Receiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (seen, requests) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            let head = String::from_utf8_lossy(&head).into_owned();
            let _ = seen.send(head.lines().next().unwrap_or_default().to_string());
            let response = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes());
        }
    });
    (port, requests)
}

/// `http_fetch` (a Rust guest that imports `wasi:http`) in a directory of its own, loaded
/// under the operator's `ceiling`.
async fn http_runtime(ceiling: &str) -> (tempfile::TempDir, Runtime) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(artifact("http_fetch"), dir.path().join("http_fetch.wasm")).unwrap();
    let policy = "[wasi]\nnetwork = true\n";
    std::fs::write(dir.path().join("http_fetch.policy.toml"), policy).unwrap();
    let operator = Operator::parse(ceiling, dir.path()).expect("a valid operator file");
    let options =
        RuntimeOptions { bundled: false, plugin_dirs: vec![dir.path().to_path_buf()], operator, ..support::options() };
    let runtime = Runtime::load(options).await.expect("http_fetch loads: the host links wasi:http");
    (dir, runtime)
}

async fn fetch(runtime: &Runtime, authority: &str) -> Result<Value, CallError> {
    let options = CallOptions {
        context: CallContext { idempotency_key: "k".into(), attempt: 1, ..CallContext::default() },
        ..CallOptions::default()
    };
    let args = json!({ "scheme": "http", "authority": authority, "path": "/hello" });
    runtime.call("http_fetch.get", &args, &options, &MemoryStore::new(State::default())).await.result
}

#[tokio::test(flavor = "multi_thread")]
async fn an_http_request_reaches_a_granted_host_and_port_and_nothing_else() {
    let (port, requests) = http_server("hello from the test");
    let (other, other_requests) = http_server("not granted");
    let (_dir, runtime) = http_runtime(&format!("[plugins.http_fetch.wasi]\nnetwork = [\"127.0.0.1:{port}\"]\n")).await;

    let ok = fetch(&runtime, &format!("127.0.0.1:{port}")).await.expect("a request to the granted host");
    assert_eq!(ok, json!({ "status": 200, "body": "hello from the test" }));
    assert_eq!(requests.recv_timeout(Duration::from_secs(10)).unwrap(), "GET /hello HTTP/1.1");

    // The same host on another port, and another host: the call stops, nothing is sent.
    for authority in [format!("127.0.0.1:{other}"), "example.invalid".to_string()] {
        let e = fetch(&runtime, &authority).await.unwrap_err();
        let CallError::AccessDenied { what, .. } = &e else { panic!("{authority}: {e:?}") };
        let shown = if authority.contains(':') { authority.clone() } else { format!("{authority}:80") };
        assert!(what.contains(&format!("an HTTP request to '{shown}' is not granted")), "{what}");
        assert!(what.contains(&format!("granted: 127.0.0.1:{port}")), "{what}");
    }
    assert!(other_requests.try_recv().is_err(), "a port that is not granted was reached");
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_network_grant_every_http_request_is_refused() {
    let (port, requests) = http_server("never");
    let (_dir, runtime) = http_runtime("").await;
    let e = fetch(&runtime, &format!("127.0.0.1:{port}")).await.unwrap_err();
    let CallError::AccessDenied { what, .. } = &e else { panic!("{e:?}") };
    assert!(what.contains(&format!("'127.0.0.1:{port}' is not granted (granted: none)")), "{what}");
    assert!(requests.try_recv().is_err(), "the request went out");
}

/// Runs the `sagabox` binary with `cache` as its compile cache.
fn sagabox(args: &[&str], cache: &Path) -> support::python::Finished {
    let mut command = Command::new(env!("CARGO_BIN_EXE_sagabox"));
    command.args(args).env("SAGABOX_CACHE_DIR", cache).env_remove("SAGABOX_LOG");
    support::python::run(&mut command, Duration::from_secs(900))
}

/// The imports of the component at `wasm` that name `wasi:http`.
fn http_imports(wasm: &Path) -> Vec<String> {
    let bytes = std::fs::read(wasm).unwrap();
    let mut imports = Vec::new();
    for payload in wasmparser::Parser::new(0).parse_all(&bytes) {
        if let Ok(wasmparser::Payload::ComponentImportSection(section)) = payload {
            for import in section.into_iter().flatten() {
                if import.name.name.starts_with("wasi:http/") {
                    imports.push(import.name.name.to_string());
                }
            }
        }
    }
    imports
}

/// Builds the project in `dir` (plugin `name`), loads it through the CLI with an empty
/// compile cache and again from the cache, and verifies its saga: every case passes.
/// Returns stderr of the first (compiling) load.
fn build_and_verify(lang: Lang, dir: &Path, name: &str) -> String {
    let build = toolchains::build(lang, dir, name);
    let wasm = dir.join(format!("{name}.wasm"));
    let size = std::fs::metadata(&wasm).unwrap().len();
    let cache = tempfile::tempdir().unwrap();
    let plugins = dir.to_str().unwrap();
    let started = Instant::now();
    let first = sagabox(&["--no-bundled", "--plugins", plugins, "plugins"], cache.path());
    let first_load = started.elapsed();
    let started = Instant::now();
    let cached = sagabox(&["--no-bundled", "--plugins", plugins, "plugins"], cache.path());
    let cached_load = started.elapsed();
    assert!(first.stdout.contains(&format!("{name}.spend")), "{}", first.stdout);
    assert!(!cached.stderr.contains("compiling"), "a cached load compiled again:\n{}", cached.stderr);
    eprintln!(
        "{lang:?} plugin {name}: build {build:.1?}, component {:.1} MB, first load (compiles) {first_load:.1?}, \
         cached load {cached_load:.2?}",
        size as f64 / 1e6
    );

    let saga = dir.join(format!("sagas/{name}.json"));
    let report = dir.join("report.json");
    let verified = sagabox(
        &["--no-bundled", "--plugins", plugins, "verify", saga.to_str().unwrap(), "--report", report.to_str().unwrap()],
        cache.path(),
    );
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let cases = report["sagas"][0]["cases"].as_array().map_or(0, Vec::len);
    assert!(cases > 10, "a campaign of a few cases only:\n{}", verified.stdout);
    eprintln!("{lang:?} plugin {name}: verify passed {cases} cases");
    readme_commands_work(dir, cache.path());
    first.stderr
}

/// Runs every `sagabox` line of the project's README in `dir`, as a shell runs what an
/// author pastes, with this build's `sagabox` first on the PATH: each must succeed (`run`
/// panics with the line's output otherwise), and a `call` must print its JSON result.
fn readme_commands_work(dir: &Path, cache: &Path) {
    let readme = std::fs::read_to_string(dir.join("README.md")).unwrap();
    let lines: Vec<&str> = readme.lines().filter(|l| l.starts_with("sagabox ")).collect();
    assert!(lines.iter().any(|l| l.contains(" call ")), "the README shows no call:\n{readme}");
    let bin = Path::new(env!("CARGO_BIN_EXE_sagabox")).parent().unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    for line in lines {
        let mut command = Command::new("sh");
        command.args(["-c", line]).current_dir(dir).env("PATH", &path).env("SAGABOX_CACHE_DIR", cache);
        let done = support::python::run(command.env_remove("SAGABOX_LOG"), Duration::from_secs(300));
        if line.contains(" call ") {
            let printed: Result<Value, _> = serde_json::from_str(&done.stdout);
            assert!(
                printed.is_ok_and(|v| v.is_object()),
                "README line `{line}` printed no JSON result:\n{}",
                done.stdout
            );
        }
    }
}

/// A copy of the example of `lang` under `target/`, to build without touching the sources.
fn example_copy(lang: Lang) -> PathBuf {
    let dir = toolchains::rust_target_dir().with_file_name(format!("lang-example-{}", lang.flag()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).unwrap();
    }
    toolchains::copy_project(&lang.example_dir(), &dir);
    dir
}

#[test]
fn the_javascript_example_built_the_default_way_imports_wasi_http_and_verifies() {
    let dir = example_copy(Lang::Js);
    let stderr = build_and_verify(Lang::Js, &dir, "example_js");
    let imports = http_imports(&dir.join("example_js.wasm"));
    assert!(
        imports.iter().any(|i| i.starts_with("wasi:http/types@0.2.") && !i.ends_with("0.2.12")),
        "the default build is expected to import an older wasi:http 0.2 than the host's 0.2.12: {imports:?}"
    );
    // Long first compiles show progress, naming the plugin.
    assert!(stderr.contains("compiling the plugin") && stderr.contains("example_js.wasm"), "{stderr}");
}

#[test]
fn the_python_example_builds_and_verifies() {
    let dir = example_copy(Lang::Python);
    build_and_verify(Lang::Python, &dir, "example_py");
}

#[test]
fn the_rust_example_builds_and_verifies() {
    let dir = example_copy(Lang::Rust);
    build_and_verify(Lang::Rust, &dir, "example_rust");
}

/// `sagabox new NAME --lang LANG --dir DIR`, which must succeed.
fn new_project(lang: Lang, name: &str, dir: &Path) {
    let cache = support::shared_cache();
    let out = sagabox(&["new", name, "--lang", lang.flag(), "--dir", dir.to_str().unwrap()], &cache);
    assert!(out.stdout.contains(&format!("sagas/{name}.json")), "{}", out.stdout);
}

/// Every file under `dir`, relative, sorted.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(next) = stack.pop() {
        for entry in std::fs::read_dir(&next).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                found.push(path.strip_prefix(dir).unwrap().to_path_buf());
            }
        }
    }
    found.sort();
    found
}

#[test]
fn new_writes_exactly_the_examples_against_the_hosts_wit() {
    let wit = std::fs::read_to_string(support::python::workspace().join("wit/plugin.wit")).unwrap();
    for lang in Lang::ALL {
        let dir = tempfile::tempdir().unwrap();
        let project = dir.path().join("p");
        new_project(lang, lang.example_name(), &project);
        let example = lang.example_dir();
        let (written, shipped) = (files(&project), files(&example));
        assert_eq!(written, shipped, "{lang:?}: `new` and {} differ in their files", example.display());
        for file in written {
            let (a, b) = (std::fs::read(project.join(&file)).unwrap(), std::fs::read(example.join(&file)).unwrap());
            assert!(a == b, "{lang:?}: {} differs from the example's", file.display());
        }
        assert_eq!(std::fs::read_to_string(project.join("wit/plugin.wit")).unwrap(), wit);
        // A directory that holds anything is refused.
        let again = Command::new(env!("CARGO_BIN_EXE_sagabox"))
            .args(["new", "x", "--lang", lang.flag(), "--dir", project.to_str().unwrap()])
            .output()
            .unwrap();
        assert_eq!(again.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&again.stderr).contains("is not empty"));
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_sagabox")).args(["new", "Bad.Name", "--lang", "js"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("'Bad.Name' is not a valid plugin name"));
}

#[test]
fn a_project_from_new_builds_and_verifies_in_every_language() {
    for lang in Lang::ALL {
        let dir = tempfile::tempdir().unwrap();
        let name = format!("budget-{}", lang.flag());
        let project = dir.path().join(&name);
        new_project(lang, &name, &project);
        build_and_verify(lang, &project, &name);
    }
}
