//! Builds the guest plugins in `guest-tools/` for `wasm32-wasip2` (installing the target with
//! rustup when it is missing) and embeds the bundled ones in the `sagabox` binary, the way
//! wasmtime's `crates/test-programs` builds its guests.
//!
//! Output for the crate:
//! - `$OUT_DIR/bundled.rs`: `BUNDLED: &[BundledPlugin]`, every `guest-tools/plugins/<name>`
//!   as its `.wasm` bytes and `policy.toml` text;
//! - env `SAGABOX_GUEST_ARTIFACTS`: the directory holding every built `.wasm`, the malformed
//!   test plugins of `guest-tools/fixtures/` included (for tests).

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const TARGET: &str = "wasm32-wasip2";

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest_dir.parent().expect("host/ has a parent").to_path_buf();
    let guests = root.join("guest-tools");
    println!("cargo:rerun-if-changed={}", guests.join("Cargo.toml").display());
    println!("cargo:rerun-if-changed={}", guests.join("Cargo.lock").display());
    println!("cargo:rerun-if-changed={}", guests.join(".cargo").join("config.toml").display());
    for dir in ["toolkit", "plugins", "fixtures"] {
        println!("cargo:rerun-if-changed={}", guests.join(dir).display());
    }
    println!("cargo:rerun-if-changed={}", root.join("wit").display());
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");

    ensure_target();
    let target_dir = env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|d| if d.is_relative() { root.join(d) } else { d })
        .unwrap_or_else(|| root.join("target"))
        .join("guest-tools");
    build_guests(&guests, &target_dir);

    let artifacts = target_dir.join(TARGET).join("release");
    println!("cargo:rustc-env=SAGABOX_GUEST_ARTIFACTS={}", artifacts.display());
    write_bundled(&guests.join("plugins"), &artifacts);
}

/// Fails the build with a message saying what to do.
fn fail(message: &str) -> ! {
    eprintln!("\nerror: {message}\n");
    std::process::exit(1);
}

/// Adds the wasm32-wasip2 standard library with rustup when this toolchain lacks it.
fn ensure_target() {
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let sysroot = Command::new(&rustc)
        .args(["--print", "sysroot"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
        .unwrap_or_else(|| fail(&format!("cannot run `{rustc} --print sysroot`")));
    if sysroot.join("lib/rustlib").join(TARGET).exists() {
        return;
    }
    eprintln!("the {TARGET} target is missing: installing it with rustup");
    let mut rustup = Command::new("rustup");
    rustup.args(["target", "add", TARGET]);
    if let Ok(toolchain) = env::var("RUSTUP_TOOLCHAIN") {
        rustup.args(["--toolchain", &toolchain]);
    }
    match rustup.status() {
        Ok(s) if s.success() => {}
        Ok(s) => {
            fail(&format!("`rustup target add {TARGET}` failed ({s}); install the target by hand and build again"))
        }
        Err(e) => fail(&format!(
            "the {TARGET} target is missing and rustup could not be run ({e}); \
             install the target for this toolchain and build again"
        )),
    }
}

/// Runs `cargo build --release --target wasm32-wasip2` on the guest workspace, in its own
/// target directory, with none of the outer build's flags or wrappers (clippy's included),
/// so that `cargo build`, `cargo test` and `cargo clippy` all share one guest build.
fn build_guests(guests: &Path, target_dir: &Path) {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    // From guest-tools/, so that its .cargo/config.toml (the guests' link options) applies.
    cmd.current_dir(guests);
    cmd.args(["build", "--release", "--target", TARGET, "--workspace", "--manifest-path"])
        .arg(guests.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(target_dir);
    for (key, _) in env::vars_os() {
        let key = key.to_string_lossy();
        let inherited = key.starts_with("CARGO_ENCODED_")
            || key.starts_with("CARGO_PROFILE_")
            || key.starts_with("CARGO_BUILD_")
            || key.starts_with("CARGO_TARGET_")
            || key.starts_with("CARGO_CFG_")
            || key.starts_with("CARGO_FEATURE_")
            || key.starts_with("CLIPPY_")
            || matches!(&*key, "RUSTFLAGS" | "RUSTC_WRAPPER" | "RUSTC_WORKSPACE_WRAPPER" | "RUSTDOCFLAGS");
        if inherited {
            cmd.env_remove(&*key);
        }
    }
    let status = cmd.status().unwrap_or_else(|e| fail(&format!("cannot run cargo to build the guest plugins: {e}")));
    if !status.success() {
        fail("building the guest plugins in guest-tools/ failed (see the output above)");
    }
}

/// Writes `bundled.rs`, embedding every plugin of `guest-tools/plugins/`.
fn write_bundled(plugins: &Path, artifacts: &Path) {
    let mut names: Vec<String> = std::fs::read_dir(plugins)
        .unwrap_or_else(|e| fail(&format!("cannot list {}: {e}", plugins.display())))
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("Cargo.toml").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut code = String::from("pub static BUNDLED: &[BundledPlugin] = &[\n");
    for name in names {
        let wasm = artifacts.join(format!("{}.wasm", name.replace('-', "_")));
        if !wasm.exists() {
            fail(&format!("the guest build did not produce {}", wasm.display()));
        }
        let policy = plugins.join(&name).join("policy.toml");
        let policy = if policy.exists() {
            format!("Some(include_str!({:?}))", policy.display().to_string())
        } else {
            "None".to_string()
        };
        writeln!(
            code,
            "    BundledPlugin {{ name: {name:?}, wasm: include_bytes!({:?}), policy: {policy} }},",
            wasm.display().to_string()
        )
        .unwrap();
    }
    code.push_str("];\n");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("bundled.rs");
    std::fs::write(&out, code).unwrap_or_else(|e| fail(&format!("cannot write {}: {e}", out.display())));
}
