//! Shared helpers for the end-to-end tests.
#![allow(dead_code)]

pub mod postgres;
pub mod python;
pub mod toolchains;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use sagabox::runtime::{Runtime, RuntimeOptions};
use sagabox::store::State;
use serde_json::{Value, json};

/// A compile cache shared by the end-to-end tests, so only the first load of a plugin compiles.
pub fn shared_cache() -> PathBuf {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp dir")).path().to_path_buf()
}

/// Replaces the compile-cache entry at `entry` with `bytes`. Entries are read-only (processes
/// map them), so it is replaced rather than written in place, as the cache itself does.
pub fn replace_cache_entry(entry: &Path, bytes: &[u8]) {
    std::fs::remove_file(entry).expect("the entry can be removed");
    std::fs::write(entry, bytes).expect("the entry can be written");
}

/// Where the build put every guest `.wasm`, the malformed test plugins included.
pub fn artifact(name: &str) -> PathBuf {
    Path::new(env!("SAGABOX_GUEST_ARTIFACTS")).join(format!("{name}.wasm"))
}

pub fn options() -> RuntimeOptions {
    RuntimeOptions { cache_dir: Some(shared_cache()), ..RuntimeOptions::default() }
}

/// The bundled plugins, plus those in `dirs`.
pub async fn runtime_with(dirs: &[&Path]) -> Runtime {
    let options = RuntimeOptions { plugin_dirs: dirs.iter().map(|d| d.to_path_buf()).collect(), ..options() };
    Runtime::load(options).await.expect("plugins load")
}

pub async fn runtime() -> Runtime {
    runtime_with(&[]).await
}

/// A small store for the bundled tools.
pub fn travel_state() -> State {
    State::from_json(&json!({
        "flights": {
            "HAT001": {
                "flight_number": "HAT001", "origin": "SFO", "destination": "JFK",
                "scheduled_departure_time_est": "06:00:00", "scheduled_arrival_time_est": "14:30:00",
                "dates": {
                    "2024-05-16": {
                        "status": "available",
                        "available_seats": { "basic_economy": 0, "economy": 2, "business": 1 },
                        "prices": { "basic_economy": 99, "economy": 180.5, "business": 900 }
                    }
                }
            }
        },
        "pools": { "gpu": { "capacity": 50, "allocated": 0 } }
    }))
    .expect("valid state")
}

pub fn book_args(passengers: u64) -> Value {
    json!({ "flight_number": "HAT001", "date": "2024-05-16", "cabin": "economy", "passengers": passengers })
}

/// `DIR/plugins` with the `slow_pool` test plugin (the resources tools after sleeping
/// `delay_ms`, recording every execution) and its policy; returns that directory.
pub fn install_slow_pool(dir: &Path) -> PathBuf {
    let plugins = dir.join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    std::fs::copy(artifact("slow_pool"), plugins.join("slow_pool.wasm")).unwrap();
    std::fs::write(
        plugins.join("slow_pool.policy.toml"),
        "[store]\nwrite = [\"pools\", \"allocations\", \"executions\"]\n",
    )
    .unwrap();
    plugins
}

/// Runs the `sagabox` binary with the tests' shared compile cache.
pub fn sagabox(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_sagabox"))
        .args(args)
        .env("SAGABOX_CACHE_DIR", shared_cache())
        .output()
        .unwrap()
}

/// The repository's `sagas/` directory.
pub fn sagas_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../sagas")
}
