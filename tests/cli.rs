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

#[test]
fn a_policy_can_grant_a_directory_and_environment_variables() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(artifact("hostile"), dir.path().join("granted.wasm")).unwrap();
    std::fs::create_dir(dir.path().join("data")).unwrap();
    std::fs::write(dir.path().join("data/hello.txt"), "hello from the host").unwrap();
    std::fs::write(
        dir.path().join("granted.policy.toml"),
        "[store]\nwrite = [\"scratch\"]\n[wasi]\nenv = [\"GREETING\"]\ndirs = [{ host = \"data\", guest = \"/data\" }]\n",
    )
    .unwrap();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_sagabox"))
            .args(["--plugins", dir.path().to_str().unwrap()])
            .args(args)
            .env("SAGABOX_CACHE_DIR", shared_cache())
            .env("GREETING", "hi")
            .env("SECRET", "hunter2")
            .output()
            .unwrap()
    };
    let out = run(&["call", "granted.read_file", "--args", r#"{"path": "/data/hello.txt"}"#]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("hello from the host"));

    let out = run(&["call", "granted.env"]);
    let seen: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(seen["all"], serde_json::json!({ "GREETING": "hi" }), "only the granted variable is visible");

    // The same plugin without the grants sees neither.
    let out = run(&["call", "hostile.read_file", "--args", r#"{"path": "/data/hello.txt"}"#]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("access denied: filesystem access"), "{}", stderr(&out));
}
