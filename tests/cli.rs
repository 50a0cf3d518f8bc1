//! The `sagabox` command line, run as a user runs it.

use crate::support;

use std::process::{Command, Output};

use serde_json::Value;
use support::*;

fn sagabox(args: &[&str]) -> Output {
    sagabox_with_cache(args, &shared_cache())
}

fn sagabox_with_cache(args: &[&str], cache: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sagabox"))
        .args(args)
        .env("SAGABOX_CACHE_DIR", cache)
        .env_remove("SAGABOX_LOG")
        .output()
        .expect("sagabox runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn plugins_lists_every_bundled_tool_and_a_second_run_does_not_recompile() {
    let cache = tempfile::tempdir().unwrap();
    let first = sagabox_with_cache(&["plugins", "--json"], cache.path());
    assert!(first.status.success(), "{}", stderr(&first));
    let plugins: Vec<Value> = serde_json::from_str(&stdout(&first)).unwrap();
    let names: Vec<&str> = plugins.iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "agents",
            "airline",
            "buggy_airline",
            "hostile",
            "hotel",
            "inventory",
            "payment",
            "rental",
            "resources",
            "shipping",
            "taubench_airline",
            "taubench_retail"
        ]
    );
    assert!(plugins.iter().all(|p| p["compiled"] == "compiled" && p["sha256"].as_str().unwrap().len() == 64));
    let airline = &plugins[1];
    assert_eq!(airline["name"], "airline");
    let book = airline["tools"].as_array().unwrap().iter().find(|t| t["name"] == "book").unwrap();
    assert_eq!(book["compensator"], "cancel");
    assert_eq!(book["side_effects"], true);

    let second = sagabox_with_cache(&["plugins", "--json"], cache.path());
    let plugins: Vec<Value> = serde_json::from_str(&stdout(&second)).unwrap();
    assert!(plugins.iter().all(|p| p["compiled"] == "cached"), "{}", stdout(&second));

    let table = sagabox_with_cache(&["plugins"], cache.path());
    let text = stdout(&table);
    assert!(text.contains("airline.book") && text.contains("airline.cancel") && text.contains("1000000000"), "{text}");
}

#[test]
fn call_prints_the_result_and_applies_it_to_the_state() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = dir.path().join("state.json");
    std::fs::write(&fixture, travel_state().to_canonical_json()).unwrap();
    let after = dir.path().join("after.json");
    let out = sagabox(&[
        "call",
        "airline.book",
        "--args",
        &book_args(1).to_string(),
        "--state",
        fixture.to_str().unwrap(),
        "--write-state",
        after.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let result: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(result["arrivalTime"], "2024-05-16T14:30:00");
    let state: Value = serde_json::from_str(&std::fs::read_to_string(&after).unwrap()).unwrap();
    assert_eq!(state["flights"]["HAT001"]["dates"]["2024-05-16"]["available_seats"]["economy"], 1);
    assert!(stderr(&out).contains("changed flights/HAT001"), "{}", stderr(&out));
}

#[test]
fn hostile_calls_fail_with_exit_code_1_and_a_typed_message() {
    let cases = [
        ("hostile.spin", vec![], "hostile.spin: out of fuel (limit: 1000000000 units)"),
        ("hostile.spin", vec!["--fuel", "5000"], "out of fuel (limit: 5000 units)"),
        ("hostile.grow", vec!["--memory-mib", "8"], "memory limit exceeded (limit: 8 MiB)"),
        ("hostile.recurse", vec![], "wasm stack overflow (limit: 512 KiB)"),
        ("hostile.trap", vec![], "panicked on purpose"),
        ("hostile.flood", vec![], "output too large"),
        ("hostile.read_file", vec![], "access denied: filesystem access"),
        ("hostile.connect", vec![], "access denied: network access"),
        ("hostile.trespass", vec![], "access denied: namespace 'flights'"),
        ("hostile.sleep", vec!["--deadline-ms", "100"], "deadline exceeded (limit: 100 ms)"),
    ];
    for (tool, extra, expected) in cases {
        let mut args = vec!["call", tool];
        args.extend(extra);
        let out = sagabox(&args);
        assert_eq!(out.status.code(), Some(1), "{tool}: {}", stderr(&out));
        assert!(stderr(&out).contains(expected), "{tool}: expected '{expected}' in: {}", stderr(&out));
    }
    let json = sagabox(&["call", "hostile.spin", "--fuel", "1000", "--json"]);
    let report: Value = serde_json::from_str(&stdout(&json)).unwrap();
    assert_eq!(report["ok"], false);
    assert_eq!(report["error"]["error"], "out_of_fuel");
    assert_eq!(report["error"]["fuel"], 1000);
}

#[test]
fn bad_input_gets_a_specific_error_and_exit_code() {
    let out = sagabox(&["call", "airline.book", "--args", "{not json"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--args is not valid JSON"), "{}", stderr(&out));

    let out = sagabox(&["call", "airline.fly", "--args", "{}"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("plugin 'airline' has no tool 'fly'"), "{}", stderr(&out));

    let out = sagabox(&["call", "airline.book", "--args", "{}"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("arguments do not match the tool's schema"), "{}", stderr(&out));

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("core.wasm"), b"\0asm\x01\0\0\0").unwrap();
    let out = sagabox(&["plugins", "--plugins", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("core.wasm: a core WebAssembly module, not a component"), "{}", stderr(&out));

    let out = sagabox(&["call", "airline.search", "--state", "/no/such/fixture.json"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("/no/such/fixture.json"), "{}", stderr(&out));
}

#[test]
fn help_is_available_on_every_command() {
    for args in [vec!["--help"], vec!["plugins", "--help"], vec!["call", "--help"]] {
        let out = sagabox(&args);
        assert!(out.status.success());
        assert!(stdout(&out).contains("Usage"), "{args:?}");
    }
}

/// The operator's file of the tests: `granted` may see `GREETING` and read `data/` beside it.
fn operator_file() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/operator/operator.toml")
}

/// A plugin directory with the hostile plugin as `name`, under `policy`.
fn plugin_dir(name: &str, policy: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(artifact("hostile"), dir.path().join(format!("{name}.wasm"))).unwrap();
    std::fs::write(dir.path().join(format!("{name}.policy.toml")), policy).unwrap();
    dir
}

#[test]
fn only_the_operator_can_grant_a_plugin_a_directory_and_environment_variables() {
    let data = std::fs::canonicalize(operator_file().with_file_name("data")).unwrap();
    let policy = format!(
        "[store]\nwrite = [\"scratch\"]\n[wasi]\nenv = [\"GREETING\", \"SECRET\"]\n\
         dirs = [{{ host = \"{}\", guest = \"/data\" }}]\n",
        data.display()
    );
    let dir = plugin_dir("granted", &policy);
    let run = |operator: Option<(&str, &std::path::Path)>, args: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sagabox"));
        cmd.args(["--plugins", dir.path().to_str().unwrap()])
            .args(args)
            .env("SAGABOX_CACHE_DIR", shared_cache())
            .env_remove("SAGABOX_OPERATOR")
            .env("GREETING", "hi")
            .env("SECRET", "hunter2");
        match operator {
            Some(("flag", file)) => cmd.arg("--operator").arg(file),
            Some((_, file)) => cmd.env("SAGABOX_OPERATOR", file),
            None => &mut cmd,
        };
        cmd.output().unwrap()
    };
    let file = operator_file();
    let read = ["call", "granted.read_file", "--args", r#"{"path": "/data/hello.txt"}"#];
    for how in ["flag", "env"] {
        let out = run(Some((how, &file)), &read);
        assert!(out.status.success(), "{how}: {}", stderr(&out));
        assert!(stdout(&out).contains("hello from the host"), "{how}");
    }
    let out = run(Some(("flag", &file)), &["call", "granted.env"]);
    let seen: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(seen["all"], serde_json::json!({ "GREETING": "hi" }), "only the variable the operator allows");

    // The plugin's own policy is not enough.
    let out = run(None, &read);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("access denied: filesystem access"), "{}", stderr(&out));
    let out = run(None, &["call", "granted.env"]);
    let seen: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(seen["all"], serde_json::json!({}));

    let missing = dir.path().join("no-such-operator.toml");
    let out = run(Some(("flag", &missing)), &["plugins"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("no-such-operator.toml"), "{}", stderr(&out));
}

#[test]
fn plugins_shows_what_each_plugin_requested_what_it_was_granted_and_what_was_refused() {
    let policy = "[store]\nwrite = [\"*\", \"scratch\"]\n[limits]\nfuel = 50_000_000_000\n\
                  [wasi]\nenv = [\"PATH\"]\nnetwork = [\"example.com:443\"]\n\
                  dirs = [{ host = \"../..\", guest = \"/up\" }]\n";
    let dir = plugin_dir("greedy", policy);
    let out = sagabox(&[
        "plugins",
        "--json",
        "--plugins",
        dir.path().to_str().unwrap(),
        "--operator",
        operator_file().to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plugins: Vec<Value> = serde_json::from_str(&stdout(&out)).unwrap();
    let find = |name: &str| plugins.iter().find(|p| p["name"] == name).unwrap().clone();
    let greedy = find("greedy");
    assert_eq!(greedy["requested"]["store"]["write"], serde_json::json!(["*", "scratch"]));
    assert_eq!(greedy["requested"]["wasi"]["network"], serde_json::json!(["example.com:443"]));
    assert_eq!(greedy["granted"]["store"]["write"], serde_json::json!(["scratch"]));
    assert_eq!(greedy["granted"]["wasi"], serde_json::json!({ "env": [], "dirs": [], "network": false }));
    assert_eq!(greedy["limits"]["fuel"], 500_000_000, "the operator's fuel ceiling");
    let refused: Vec<&str> = greedy["refused"].as_array().unwrap().iter().map(|r| r.as_str().unwrap()).collect();
    for part in ["store.write \"*\"", "wasi.env \"PATH\"", "example.com:443", "limits.fuel"] {
        assert!(refused.iter().any(|r| r.contains(part)), "{part} not in {refused:?}");
    }
    let up = refused.iter().find(|r| r.contains("wasi.dirs")).unwrap();
    assert!(
        up.contains("plugin 'greedy'") && up.contains("outside the directories the operator allows (none)"),
        "{up}"
    );
    let airline = find("airline");
    assert_eq!(airline["granted"]["store"], airline["requested"]["store"]);
    assert_eq!(airline["refused"], serde_json::json!([]));

    let table = sagabox(&["plugins", "--plugins", dir.path().to_str().unwrap()]);
    let text = stdout(&table);
    assert!(
        text.contains("refused") && text.contains("write: *, scratch") && text.contains("wasi.env \"PATH\""),
        "{text}"
    );
}

// ---------------------------------------------------------------------------------------
// Verify, state and fixture loopholes (issue #12, item 5)

/// `sagas/<path>` of the repository.
fn shipped(path: &str) -> std::path::PathBuf {
    sagas_dir().join(path)
}

/// A bundled plugin's shipped policy file.
fn shipped_policy(plugin: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../guest-tools/plugins/{plugin}/policy.toml"))
}

/// Writes `fixture` (`{namespace: {key: document}}`) as a directory of `<namespace>.json` files.
fn write_fixture_dir(dir: &std::path::Path, fixture: &Value) {
    std::fs::create_dir_all(dir).unwrap();
    for (ns, docs) in fixture.as_object().unwrap() {
        std::fs::write(dir.join(format!("{ns}.json")), docs.to_string()).unwrap();
    }
}

fn read_json(path: &std::path::Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The `replay:` line printed under `FAIL <saga> / <case>`.
fn printed_replay(stdout: &str, saga: &str, case: &str) -> String {
    let header = format!("FAIL {saga} / {case}:");
    let mut lines = stdout.lines().skip_while(|l| !l.starts_with(&header));
    lines
        .find_map(|l| l.trim_start().strip_prefix("replay: ").map(str::to_string))
        .unwrap_or_else(|| panic!("no replay command for {saga} / {case} in:\n{stdout}"))
}

/// Runs a printed command line through `sh`, with `sagabox` on the PATH.
fn run_in_shell(command: &str) -> Output {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_sagabox")).parent().unwrap().to_path_buf();
    let path = std::env::join_paths(
        std::iter::once(bin).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
    )
    .unwrap();
    Command::new("sh")
        .args(["-c", command])
        .env("PATH", path)
        .env("SAGABOX_CACHE_DIR", shared_cache())
        .env_remove("SAGABOX_OPERATOR")
        .env_remove("SAGABOX_LOG")
        .output()
        .unwrap()
}

/// `DIR/my plugins` (a space, so the replay must quote it) holding the buggy airline as
/// `mybuggy`, and the hotel and payment plugins, each with its policy; and `DIR/sagas/`
/// holding buggy-cancel calling `mybuggy.*`, with its fixture and input.
fn plugin_dir_saga(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let plugins = dir.join("my plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    for (artifact_name, name) in [("buggy_airline", "mybuggy"), ("hotel", "hotel"), ("payment", "payment")] {
        std::fs::copy(artifact(artifact_name), plugins.join(format!("{name}.wasm"))).unwrap();
        std::fs::copy(shipped_policy(artifact_name), plugins.join(format!("{name}.policy.toml"))).unwrap();
    }
    let sagas = dir.join("sagas");
    std::fs::create_dir_all(&sagas).unwrap();
    let text = std::fs::read_to_string(shipped("buggy-cancel/buggy-cancel.json")).unwrap();
    assert!(text.contains("buggy_airline."));
    std::fs::write(sagas.join("buggy-cancel.json"), text.replace("buggy_airline.", "mybuggy.")).unwrap();
    for suffix in ["fixture.json", "input.json"] {
        std::fs::copy(
            shipped(&format!("buggy-cancel/buggy-cancel.{suffix}")),
            sagas.join(format!("buggy-cancel.{suffix}")),
        )
        .unwrap();
    }
    (plugins, sagas.join("buggy-cancel.json"))
}

#[test]
fn the_printed_replay_command_reproduces_a_failing_case_of_a_plugin_dir_saga() {
    let dir = tempfile::tempdir().unwrap();
    let (plugins, saga) = plugin_dir_saga(dir.path());
    let operator = operator_file();
    let out = Command::new(env!("CARGO_BIN_EXE_sagabox"))
        .arg("--no-bundled")
        .arg("--plugins")
        .arg(&plugins)
        .arg("--operator")
        .arg(&operator)
        .args(["verify", saga.to_str().unwrap(), "--seed", "3", "--runs", "2", "--faults", "trap,random"])
        .env("SAGABOX_CACHE_DIR", shared_cache())
        .env_remove("SAGABOX_OPERATOR")
        .output()
        .unwrap();
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}\n{}", stderr(&out));
    assert!(text.contains("FAIL buggy-cancel / clean: the rollback did not restore"), "{text}");

    let replay = printed_replay(&text, "buggy-cancel", "clean");
    let again = run_in_shell(&replay);
    let again_text = stdout(&again);
    assert_eq!(
        again.status.code(),
        Some(1),
        "the replay command did not reproduce the failure: {replay}\nstdout: {again_text}\nstderr: {}",
        stderr(&again)
    );
    assert!(again_text.contains("FAIL buggy-cancel / clean: the rollback did not restore"), "{again_text}");
    assert!(again_text.contains("/dates/2024-05-16/available_seats/economy: 9 -> 8"), "{again_text}");
    assert!(again_text.contains("1 of 1 cases failed"), "{again_text}");
    assert_eq!(printed_replay(&again_text, "buggy-cancel", "clean"), replay, "the replay is not a fixed point");
    for part in ["--no-bundled", "--seed 3", "--case clean", &format!("'{}'", plugins.display())] {
        assert!(replay.contains(part), "'{part}' missing from the replay command: {replay}");
    }
    assert!(replay.contains(&format!("--operator {}", operator.display())), "{replay}");
}

#[test]
fn verify_state_replaces_each_sagas_own_fixture_and_the_replay_repeats_it() {
    let dir = tempfile::tempdir().unwrap();
    let help = sagabox(&["verify", "--help"]);
    assert!(stdout(&help).contains("--state <FIXTURE>"), "{}", stdout(&help));

    // ct1 without its companion fixture: the state comes from --state (a file).
    for suffix in ["json", "input.json"] {
        std::fs::copy(shipped(&format!("ct1-payment-failure.{suffix}")), dir.path().join(format!("ct1.{suffix}")))
            .unwrap();
    }
    let saga = dir.path().join("ct1.json");
    let fixture = shipped("ct1-payment-failure.fixture.json");
    let report = dir.path().join("report.json");
    let out = sagabox(&[
        "verify",
        saga.to_str().unwrap(),
        "--state",
        fixture.to_str().unwrap(),
        "--runs",
        "2",
        "--report",
        report.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}\n{}", stdout(&out), stderr(&out));
    let digest = sagabox(&["state", "--state", fixture.to_str().unwrap(), "--digest"]);
    assert_eq!(read_json(&report)["sagas"][0]["fixture_digest"], stdout(&digest).trim());

    // buggy-cancel without its companion, its fixture given as a directory: the bug shows,
    // and the replay names the fixture.
    std::fs::copy(shipped("buggy-cancel/buggy-cancel.json"), dir.path().join("buggy.json")).unwrap();
    std::fs::copy(shipped("buggy-cancel/buggy-cancel.input.json"), dir.path().join("buggy.input.json")).unwrap();
    let fixture_dir = dir.path().join("a fixture");
    write_fixture_dir(&fixture_dir, &read_json(&shipped("buggy-cancel/buggy-cancel.fixture.json")));
    let buggy = dir.path().join("buggy.json");
    let out = sagabox(&["verify", buggy.to_str().unwrap(), "--state", fixture_dir.to_str().unwrap(), "--runs", "1"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}\n{}", stderr(&out));
    assert!(text.contains("/dates/2024-05-16/available_seats/economy: 9 -> 8"), "{text}");
    let replay = printed_replay(&text, "buggy-cancel", "clean");
    assert!(replay.contains(&format!("--state '{}'", fixture_dir.display())), "{replay}");
    let again = run_in_shell(&replay);
    assert_eq!(again.status.code(), Some(1), "{replay}: {}{}", stdout(&again), stderr(&again));
    assert!(stdout(&again).contains("available_seats/economy: 9 -> 8"), "{}", stdout(&again));
}

#[test]
fn a_fixture_directory_without_json_files_is_an_error_everywhere() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("fixture");
    std::fs::create_dir(&empty).unwrap();
    std::fs::write(empty.join("notes.txt"), "not a fixture").unwrap();
    let e = empty.to_str().unwrap();
    let expected = format!("no *.json fixture files in {e}");
    let travel = shipped("travel.json");
    for args in [
        vec!["state", "--state", e],
        vec!["state", "--state", e, "--digest"],
        vec!["run", travel.to_str().unwrap(), "--state", e],
        vec![
            "call",
            "airline.search",
            "--state",
            e,
            "--args",
            r#"{"origin":"SFO","destination":"JFK","date":"2024-05-16"}"#,
        ],
        vec!["verify", travel.to_str().unwrap(), "--state", e],
        vec!["fixtures", "generate", "--base", e],
    ] {
        let out = sagabox(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?} exited {:?}: {}", out.status.code(), stdout(&out));
        assert!(stderr(&out).contains(&expected), "{args:?}: {}", stderr(&out));
        assert!(stdout(&out).is_empty(), "{args:?} printed: {}", stdout(&out));
    }
}

#[test]
fn fixtures_generate_takes_a_fixture_directory_as_base_like_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let base = read_json(&shipped("buggy-cancel/buggy-cancel.fixture.json"));
    let base_dir = dir.path().join("base");
    write_fixture_dir(&base_dir, &base);
    let (from_dir, from_file) = (dir.path().join("from-dir.json"), dir.path().join("from-file.json"));
    let file = shipped("buggy-cancel/buggy-cancel.fixture.json");
    for (base, out) in [(&base_dir, &from_dir), (&file, &from_file)] {
        let run = sagabox(&[
            "fixtures",
            "generate",
            "--scale",
            "1",
            "--base",
            base.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(run.status.success(), "--base {}: {}", base.display(), stderr(&run));
    }
    assert_eq!(std::fs::read(&from_dir).unwrap(), std::fs::read(&from_file).unwrap());
    let generated = read_json(&from_dir);
    assert_eq!(generated["flights"]["HAT001"], base["flights"]["HAT001"], "the base's documents are laid over");
    assert_eq!(generated["users"]["mia_li_3668"], base["users"]["mia_li_3668"]);
    assert!(generated["flights"].as_object().unwrap().len() > 100, "the generated flights are kept");
}

#[test]
fn a_file_of_records_is_refused_as_a_fixture_instead_of_becoming_namespaces() {
    let dir = tempfile::tempdir().unwrap();
    // tau-bench's flights.json: {flight number: flight}, one namespace's records.
    let flights = read_json(&shipped("buggy-cancel/buggy-cancel.fixture.json"))["flights"].clone();
    assert!(flights.as_object().unwrap().len() >= 2);
    let file = dir.path().join("flights.json");
    std::fs::write(&file, flights.to_string()).unwrap();
    let f = file.to_str().unwrap();
    for args in [
        vec!["fixtures", "generate", "--base", f],
        vec!["state", "--state", f],
        vec!["run", shipped("travel.json").to_str().unwrap(), "--state", f],
    ] {
        let out = sagabox(&args);
        let err = stderr(&out);
        let head: String = stdout(&out).chars().take(300).collect();
        assert_eq!(out.status.code(), Some(2), "{args:?} exited {:?}: {head}", out.status.code());
        for part in ["flights.json", "HAT001/", "{namespace: {key: document}}", "<namespace>.json"] {
            assert!(err.contains(part), "{args:?}: '{part}' missing from: {err}");
        }
    }
    // In a directory, the same file is the namespace `flights`.
    let in_dir = dir.path().join("db");
    std::fs::create_dir(&in_dir).unwrap();
    std::fs::copy(&file, in_dir.join("flights.json")).unwrap();
    let out = sagabox(&["state", "--state", in_dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let state: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(state.as_object().unwrap().keys().collect::<Vec<_>>(), ["flights"]);
    assert_eq!(state["flights"], flights);
}

/// The command line's jemalloc runs one arena per CPU (BENCHMARKS.md, item 19). jemalloc
/// ignores an options symbol it cannot find, so a misspelt one would pass every other test.
#[test]
fn the_command_lines_allocator_keeps_one_arena_per_cpu() {
    let out = Command::new(env!("CARGO_BIN_EXE_sagabox"))
        .arg("--version")
        .env("_RJEM_MALLOC_CONF", "stats_print:true")
        .output()
        .expect("sagabox runs");
    assert!(out.status.success(), "{}", stderr(&out));
    // jemalloc prints its statistics, options first, to stderr at exit.
    let stats = stderr(&out);
    assert!(stats.contains("opt.percpu_arena: \"percpu\""), "jemalloc's options: {}", &stats[..stats.len().min(2000)]);
}

/// A benchmark interrupted (Ctrl-C, SIGTERM) removes the PostgreSQL schemas and SQLite
/// databases its durable group made: they used to stay, one schema per measurement.
#[test]
fn an_interrupted_benchmark_removes_the_databases_it_made() {
    let temp = tempfile::tempdir().unwrap();
    let mut bench = durable_bench("100000", temp.path());
    let schemas = format!("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'sagabox\\_bench\\_%\\_{}'", bench.id());
    let started = std::time::Instant::now();
    // It makes two SQLite databases, then two schemas, before it measures anything.
    while postgres::query(&schemas).len() < 2 {
        assert!(started.elapsed().as_secs() < 120, "no schemas after two minutes");
        assert!(bench.try_wait().unwrap().is_none(), "the benchmark ended before it made its schemas");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let databases = || -> Vec<String> {
        let entries = std::fs::read_dir(temp.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap());
        entries.filter(|name| name.starts_with("sagabox-bench-")).collect()
    };
    assert_eq!(databases().len(), 2, "its two SQLite databases");
    // SAFETY: a signal to the child this test started and has not yet waited for.
    assert_eq!(unsafe { libc::kill(bench.id() as i32, libc::SIGINT) }, 0);
    let out = bench.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", stderr(&out));
    assert_eq!(postgres::query(&schemas), Vec::<String>::new(), "schemas left behind");
    assert_eq!(databases(), Vec::<String>::new(), "SQLite databases left behind");
}

/// A benchmark sent SIGTERM on its own (not its process group) stops the worker processes
/// it started before it removes their databases: they used to run on until their schema
/// was gone and then fail. The workers are frozen (SIGSTOP) first, so that none can end by
/// itself, on its dropped schema, before the benchmark does: a benchmark that left them
/// would leave them frozen, or wait for the locks a frozen one holds.
#[test]
fn an_interrupted_benchmark_stops_its_worker_processes() {
    let temp = tempfile::tempdir().unwrap();
    let mut bench = durable_bench("400", temp.path());
    let started = std::time::Instant::now();
    // The worker groups come after the one-process measurements.
    let workers = loop {
        let workers = worker_children(bench.id());
        if !workers.is_empty() {
            break Frozen::new(workers);
        }
        assert!(started.elapsed().as_secs() < 600, "no worker process after ten minutes");
        assert!(bench.try_wait().unwrap().is_none(), "the benchmark ended before it started a worker");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let schemas = format!("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'sagabox\\_bench\\_%\\_{}'", bench.id());
    // SAFETY: a signal to the child this test started and has not yet waited for.
    assert_eq!(unsafe { libc::kill(bench.id() as i32, libc::SIGTERM) }, 0);
    let interrupted = std::time::Instant::now();
    while bench.try_wait().unwrap().is_none() {
        if interrupted.elapsed().as_secs() >= 120 {
            let _ = bench.kill();
            panic!(
                "the benchmark did not exit within two minutes of SIGTERM: {}",
                stderr(&bench.wait_with_output().unwrap())
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = bench.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", stderr(&out));
    let alive: Vec<u32> = workers.0.iter().copied().filter(|pid| is_worker(*pid)).collect();
    assert_eq!(alive, Vec::<u32>::new(), "worker processes outlived the benchmark");
    assert_eq!(postgres::query(&schemas), Vec::<String>::new(), "schemas left behind");
}

/// Every CT1 run the durable benchmark times, in one process or queued for workers, on
/// SQLite and PostgreSQL, books a flight and a hotel, is declined at the payment and cancels
/// both. On the shipped fixture's few seats and rooms, runs in flight at once were refused
/// at their first step (5,519 of 6,000 in one worker's drain): the benchmark timed one-call
/// runs and called them CT1 (2.3 KB of journal each, against 12 KB for a whole run). It now
/// checks every run's journal and fails otherwise; from outside, a run at 64 in flight
/// writes as much journal as a run alone.
#[test]
fn the_durable_benchmark_times_whole_ct1_runs() {
    let temp = tempfile::tempdir().unwrap();
    let out = durable_bench("256", temp.path()).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the benchmark prints JSON");
    let journal_bytes = |row: &str| -> u64 {
        let rates = report["rates"].as_array().expect("rates");
        let name = rates.iter().filter_map(|r| r["name"].as_str()).find(|n| n.contains(row));
        let name = name.unwrap_or_else(|| panic!("no row '{row}' in {report}"));
        let bytes = name.rsplit("journal ").next().and_then(|t| t.split(' ').next()?.parse().ok());
        bytes.unwrap_or_else(|| panic!("no journal bytes in '{name}'"))
    };
    let alone = journal_bytes("one at a time, SQLite synchronous=Normal");
    let in_flight = journal_bytes("64 in flight, one process, SQLite synchronous=Normal");
    assert!(in_flight * 10 >= alone * 9, "{in_flight} journal bytes per run at 64 in flight, {alone} alone");
}

/// The memory group's peak is the whole process's (`VmHWM`), so it must run before the
/// groups that would leave memory resident. Run after the runtime group, its row read a
/// peak of 162 MiB where alone it read 140: "was 123 MiB before" it started, against 38.
#[test]
fn the_memory_benchmark_is_not_swollen_by_the_groups_run_with_it() {
    let peak_before_memory = |groups: &str| -> f64 {
        let out = Command::new(env!("CARGO_BIN_EXE_sagabox"))
            .args(["bench", "--only", groups, "--calls", "200", "--json", "--sagas-dir"])
            .arg(sagas_dir())
            .env("SAGABOX_CACHE_DIR", shared_cache())
            .output()
            .expect("sagabox runs");
        assert!(out.status.success(), "{}", stderr(&out));
        let report: Value = serde_json::from_slice(&out.stdout).expect("the benchmark prints JSON");
        let rows = report["measurements"].as_array().expect("measurements");
        let name = rows.iter().filter_map(|r| r["name"].as_str()).find(|n| n.contains("1,000 concurrent CT1 sagas"));
        let name = name.unwrap_or_else(|| panic!("no memory row in {report}"));
        let before = name.split("(was ").nth(1).and_then(|t| t.split(" MiB").next()?.parse().ok());
        before.unwrap_or_else(|| panic!("no peak before the group in '{name}'"))
    };
    let alone = peak_before_memory("memory");
    let with_runtime = peak_before_memory("runtime,memory");
    assert!(
        with_runtime <= alone + 5.0,
        "peak before the memory group: {with_runtime} MiB after the runtime group, {alone} alone"
    );
}

#[test]
fn the_benchmark_says_when_slots_are_reset_the_slower_way_for_swap() {
    let out = Command::new(env!("CARGO_BIN_EXE_sagabox"))
        .args(["bench", "--only", "runtime", "--calls", "20", "--sagas-dir"])
        .arg(sagas_dir())
        .env("SAGABOX_CACHE_DIR", shared_cache())
        .output()
        .expect("sagabox runs");
    assert!(out.status.success(), "{}", stderr(&out));
    let noted = stderr(&out).contains("pooled slots are reset without PAGEMAP_SCAN");
    assert_eq!(noted, sagabox::runtime::swap_is_on(), "{}", stderr(&out));
}

/// Worker processes frozen with SIGSTOP; killed when dropped, if still there.
struct Frozen(Vec<u32>);

impl Frozen {
    fn new(pids: Vec<u32>) -> Frozen {
        for pid in &pids {
            // SAFETY: a signal to a process this test found as a worker the benchmark started.
            assert_eq!(unsafe { libc::kill(*pid as i32, libc::SIGSTOP) }, 0, "cannot freeze worker {pid}");
        }
        Frozen(pids)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        for pid in self.0.iter().copied().filter(|pid| is_worker(*pid)) {
            // SAFETY: as above; a worker left frozen would otherwise stay forever.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

/// `bench --only durable --json --sagas SAGAS` against the real server, its SQLite databases
/// in `temp`.
fn durable_bench(sagas: &str, temp: &std::path::Path) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_sagabox"))
        .args(["bench", "--only", "durable", "--json", "--sagas", sagas, "--sagas-dir"])
        .arg(sagas_dir())
        .args(["--pg-url", &postgres::server_url()])
        .env("SAGABOX_CACHE_DIR", shared_cache())
        .env("TMPDIR", temp)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("sagabox runs")
}

/// The `sagabox worker` processes whose parent is `parent`.
fn worker_children(parent: u32) -> Vec<u32> {
    let pids = std::fs::read_dir("/proc").unwrap().filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok());
    pids.filter(|pid| parent_of(*pid) == Some(parent) && is_worker(*pid)).collect()
}

/// The parent of process `pid`, from `/proc/PID/stat` (its fourth field, after the
/// parenthesized command name).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.split(' ').nth(1)?.parse().ok()
}

/// Whether `pid` is a live (not zombie) `sagabox worker` process.
fn is_worker(pid: u32) -> bool {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok();
    let zombie = state.as_deref().and_then(|s| s.rsplit_once(") ")).is_some_and(|(_, rest)| rest.starts_with('Z'));
    !zombie && cmdline.split(|b| *b == 0).any(|arg| arg == b"worker")
}

/// A busy worker claims queued runs in batches (an eighth of its slots at a time), not
/// each slot as it frees up: every claim is a write transaction, and one per run cost a
/// SQLite worker half its throughput (BENCHMARKS item 24).
#[test]
fn a_busy_worker_claims_runs_in_batches() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("queue.db");
    let db = db.to_str().unwrap();
    let saga = sagas_dir().join("ct1-payment-failure.json");
    let submitted = sagabox(&["submit", "--db", db, "--count", "256", saga.to_str().unwrap()]);
    assert!(submitted.status.success(), "{}", stderr(&submitted));
    let out = sagabox(&["worker", "--db", db, "--until-done", "--concurrency", "64"]);
    let log = stderr(&out);
    // CT1's payment is declined: every run rolls back, and the worker exits 1.
    assert!(log.contains("worker done: 256 failed; 0 could not run"), "{log}");
    // Its last line: "worker done: …; N claims".
    let claims: u64 = log
        .lines()
        .find_map(|line| line.strip_prefix("worker done: ")?.rsplit("; ").next()?.strip_suffix(" claims")?.parse().ok())
        .unwrap_or_else(|| panic!("no claim count: {log}"));
    // 27 here: one of 64, 24 of 8, one that finds the queue short, one once nothing is in
    // flight; each poll (every 200 ms) may add one. Claiming each slot as it freed up made 257.
    assert!(claims <= 64, "{claims} claims for 256 runs: {log}");
}
