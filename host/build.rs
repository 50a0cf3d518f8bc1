//! Builds the guest plugins in `guest-tools/` for `wasm32-wasip2` (installing the target with
//! rustup when it is missing) and embeds the bundled ones in the `sagabox` binary, the way
//! wasmtime's `crates/test-programs` builds its guests. Plugins whose manifest says
//! `[package.metadata.sagabox] wasi = false` (the bundled tools) are built for
//! `wasm32-unknown-unknown` too and made components here, and that build is the one bundled:
//! a component imports only what it uses, and every import is linked at each call's
//! instantiation.
//!
//! Output for the crate:
//! - `$OUT_DIR/bundled.rs`: `BUNDLED: &[BundledPlugin]`, every `guest-tools/plugins/<name>`
//!   as its `.wasm` bytes and `policy.toml` text;
//! - env `SAGABOX_GUEST_ARTIFACTS`: the directory holding every built `.wasm`, the malformed
//!   test plugins of `guest-tools/fixtures/` included (for tests); the plugins built without
//!   WASI are their components.

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const TARGET: &str = "wasm32-wasip2";
/// For plugins that need no WASI.
const BARE_TARGET: &str = "wasm32-unknown-unknown";

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

    let target_dir = env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|d| if d.is_relative() { root.join(d) } else { d })
        .unwrap_or_else(|| root.join("target"))
        .join("guest-tools");
    let mut bare = plugins_without_wasi(&guests.join("plugins"));
    bare.extend(plugins_without_wasi(&guests.join("fixtures")));
    ensure_target(TARGET);
    build_guests(&guests, &target_dir, TARGET, Packages::AllBut(&bare));
    if !bare.is_empty() {
        ensure_target(BARE_TARGET);
        build_guests(&guests, &target_dir, BARE_TARGET, Packages::Only(&bare));
    }

    // The plugins built without WASI join the others' artifacts, as components.
    let artifacts = target_dir.join(TARGET).join("release");
    for package in &bare {
        let file = artifact_file(package);
        let module = target_dir.join(BARE_TARGET).join("release").join(&file);
        write_if_changed(&artifacts.join(&file), &componentize(&module));
    }
    println!("cargo:rustc-env=SAGABOX_GUEST_ARTIFACTS={}", artifacts.display());
    write_bundled(&guests.join("plugins"), &artifacts);
}

/// The package names of the plugins in `dir` whose manifest says
/// `[package.metadata.sagabox] wasi = false`.
fn plugins_without_wasi(dir: &Path) -> Vec<String> {
    let mut names = Vec::new();
    for crate_dir in plugin_dirs(dir) {
        let path = dir.join(&crate_dir).join("Cargo.toml");
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", path.display())));
        let manifest: toml::Table = text.parse().unwrap_or_else(|e| fail(&format!("{}: {e}", path.display())));
        let package = manifest.get("package");
        let wasi = package
            .and_then(|p| p.get("metadata"))
            .and_then(|m| m.get("sagabox"))
            .and_then(|s| s.get("wasi"))
            .and_then(toml::Value::as_bool);
        if wasi == Some(false) {
            let name = package.and_then(|p| p.get("name")).and_then(toml::Value::as_str);
            names.push(name.unwrap_or_else(|| fail(&format!("{}: no package name", path.display()))).to_string());
        }
    }
    names
}

/// The component of the core module at `path`, built from the interfaces its bindings
/// embedded.
fn componentize(path: &Path) -> Vec<u8> {
    let module = std::fs::read(path).unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", path.display())));
    wit_component::ComponentEncoder::default()
        .validate(true)
        .module(&module)
        .and_then(|mut encoder| encoder.encode())
        .unwrap_or_else(|e| fail(&format!("cannot make a component of {}: {e:#}", path.display())))
}

/// Writes `bytes` to `path` unless it holds them already, through a file renamed over it: a
/// build running at the same time (`cargo test` beside `cargo clippy`) reads the old file or
/// the new one, never half of one.
fn write_if_changed(path: &Path, bytes: &[u8]) {
    if std::fs::read(path).is_ok_and(|old| old == bytes) {
        return;
    }
    let partial = path.with_extension(format!("wasm.{}.partial", std::process::id()));
    std::fs::write(&partial, bytes)
        .and_then(|()| std::fs::rename(&partial, path))
        .unwrap_or_else(|e| fail(&format!("cannot write {}: {e}", path.display())));
}

/// Fails the build with a message saying what to do.
fn fail(message: &str) -> ! {
    eprintln!("\nerror: {message}\n");
    std::process::exit(1);
}

/// Adds `target`'s standard library with rustup when this toolchain lacks it.
fn ensure_target(target: &str) {
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let sysroot = Command::new(&rustc)
        .args(["--print", "sysroot"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
        .unwrap_or_else(|| fail(&format!("cannot run `{rustc} --print sysroot`")));
    if sysroot.join("lib/rustlib").join(target).exists() {
        return;
    }
    eprintln!("the {target} target is missing: installing it with rustup");
    let mut rustup = Command::new("rustup");
    rustup.args(["target", "add", target]);
    if let Ok(toolchain) = env::var("RUSTUP_TOOLCHAIN") {
        rustup.args(["--toolchain", &toolchain]);
    }
    match rustup.status() {
        Ok(s) if s.success() => {}
        Ok(s) => {
            fail(&format!("`rustup target add {target}` failed ({s}); install the target by hand and build again"))
        }
        Err(e) => fail(&format!(
            "the {target} target is missing and rustup could not be run ({e}); \
             install the target for this toolchain and build again"
        )),
    }
}

/// Which of the guest workspace's packages a build builds.
enum Packages<'a> {
    AllBut(&'a [String]),
    Only(&'a [String]),
}

/// Runs `cargo build --release --target <target>` on `packages` of the guest workspace, in
/// its own target directory, with none of the outer build's flags or wrappers (clippy's
/// included), so that `cargo build`, `cargo test` and `cargo clippy` all share one guest
/// build.
fn build_guests(guests: &Path, target_dir: &Path, target: &str, packages: Packages<'_>) {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    // From guest-tools/, so that its .cargo/config.toml (the guests' link options) applies.
    cmd.current_dir(guests);
    cmd.args(["build", "--release", "--target", target, "--manifest-path"])
        .arg(guests.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(target_dir);
    match packages {
        Packages::AllBut(excluded) => {
            cmd.arg("--workspace");
            for package in excluded {
                cmd.args(["--exclude", package]);
            }
        }
        Packages::Only(packages) => {
            for package in packages {
                cmd.args(["--package", package]);
            }
        }
    }
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
    let names = plugin_dirs(plugins);
    let mut code = String::from("pub static BUNDLED: &[BundledPlugin] = &[\n");
    for name in names {
        let wasm = artifacts.join(artifact_file(&name));
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

/// The directories of `dir` that hold a crate, sorted.
fn plugin_dirs(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| fail(&format!("cannot list {}: {e}", dir.display())))
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("Cargo.toml").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The file cargo writes for the `cdylib` of package `name`.
fn artifact_file(name: &str) -> String {
    format!("{}.wasm", name.replace('-', "_"))
}
