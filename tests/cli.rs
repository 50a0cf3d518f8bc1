//! The `sagabox` command line, run as a user runs it.

mod support;

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
            "shipping"
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
