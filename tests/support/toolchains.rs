//! The plugin authors' toolchains, for the tests that build plugins in JavaScript, Python and
//! Rust (tests/languages.rs), each installed on first use at the version its example pins:
//!
//! - JavaScript: `node` and `npm` (from Debian's `nodejs npm` when missing), and the
//!   example's `package-lock.json` installed with `npm ci` into `target/npm-<lang>/`, built
//!   again when the lock changes;
//! - Python: a venv from the example's `requirements.lock` ([`ensure_venv`]);
//! - Rust: this toolchain's `cargo` with the `wasm32-wasip2` target (the host's build adds it).
//!
//! Any failure panics with the output of the command that failed.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::support::python::{PIP_CHECK, ensure_venv, run, workspace};

/// A language a plugin can be written in, as `sagabox new --lang` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lang {
    Js,
    Python,
    Rust,
}

impl Lang {
    pub const ALL: [Lang; 3] = [Lang::Js, Lang::Python, Lang::Rust];

    /// The `--lang` value.
    pub fn flag(self) -> &'static str {
        match self {
            Lang::Js => "js",
            Lang::Python => "python",
            Lang::Rust => "rust",
        }
    }

    /// `guest-tools/examples/<dir>`.
    pub fn example_dir(self) -> PathBuf {
        workspace().join("guest-tools/examples").join(self.flag())
    }

    /// The example's plugin name.
    pub fn example_name(self) -> &'static str {
        match self {
            Lang::Js => "example_js",
            Lang::Python => "example_py",
            Lang::Rust => "example_rust",
        }
    }
}

fn target_dir() -> PathBuf {
    workspace().join(std::env::var_os("CARGO_TARGET_DIR").unwrap_or_else(|| "target".into()))
}

/// Holds a file lock in `target/` while the toolchain of `name` is being installed, so that
/// tests, and test processes, running at once install it once.
fn install_lock(name: &str) -> File {
    let target = target_dir();
    std::fs::create_dir_all(&target).unwrap_or_else(|e| panic!("cannot create {}: {e}", target.display()));
    let guard = File::create(target.join(format!("{name}.lock"))).expect("the install lock file");
    guard.lock().expect("locking the install lock file");
    guard
}

/// `node` and `npm`, from Debian's packages when missing.
fn ensure_node() {
    let present = |tool: &str| Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success());
    if present("node") && present("npm") {
        return;
    }
    let _guard = install_lock("apt-nodejs");
    if present("node") && present("npm") {
        return;
    }
    eprintln!("node or npm is missing: installing Debian's nodejs and npm");
    run(Command::new("apt-get").arg("update"), Duration::from_secs(600));
    run(
        Command::new("apt-get").args(["install", "-y", "--no-install-recommends", "nodejs", "npm"]),
        Duration::from_secs(1200),
    );
    assert!(present("node") && present("npm"), "apt-get installed nodejs and npm, yet `node`/`npm` do not run");
}

/// `target/npm-<name>/node_modules`: exactly the packages of the `package-lock.json` of
/// `project` (the JavaScript example, which pins the toolchain every project `new` writes
/// uses), installed with `npm ci` again when the lock changes. Returns `node_modules`.
pub fn npm_modules(name: &str, project: &Path) -> PathBuf {
    ensure_node();
    let lock = std::fs::read(project.join("package-lock.json"))
        .unwrap_or_else(|e| panic!("cannot read {}/package-lock.json: {e}", project.display()));
    let manifest = std::fs::read(project.join("package.json"))
        .unwrap_or_else(|e| panic!("cannot read {}/package.json: {e}", project.display()));
    let stamp = hex::encode(Sha256::digest([lock.as_slice(), manifest.as_slice()].concat()));
    let _guard = install_lock(&format!("npm-{name}"));
    let dir = target_dir().join(format!("npm-{name}"));
    let modules = dir.join("node_modules");
    let stamp_path = dir.join("sagabox-stamp");
    if modules.is_dir() && std::fs::read_to_string(&stamp_path).is_ok_and(|s| s == stamp) {
        return modules;
    }
    let started = Instant::now();
    if dir.exists() {
        std::fs::remove_dir_all(&dir).unwrap_or_else(|e| panic!("cannot remove {}: {e}", dir.display()));
    }
    std::fs::create_dir_all(&dir).unwrap();
    for file in ["package.json", "package-lock.json"] {
        std::fs::write(dir.join(file), std::fs::read(project.join(file)).unwrap()).unwrap();
    }
    run(Command::new("npm").args(["ci", "--no-audit", "--no-fund"]).current_dir(&dir), Duration::from_secs(1200));
    std::fs::write(&stamp_path, stamp).unwrap();
    eprintln!("installed {} with npm ci in {:.1?}", dir.display(), started.elapsed());
    modules
}

/// The venv holding the Python example's pinned componentize-py; returns its `bin/`.
pub fn componentize_py_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let lock = Lang::Python.example_dir().join("requirements.lock");
        let python = ensure_venv("py-venv-componentize", &lock, PIP_CHECK);
        python.parent().expect("the venv's bin directory").to_path_buf()
    })
    .clone()
}

/// Where plugin projects built by the tests share Rust build output.
pub fn rust_target_dir() -> PathBuf {
    target_dir().join("lang-rust")
}

/// Copies the files of `from` (not `node_modules`, `target`, `.venv` or built `.wasm`) into
/// `to`.
pub fn copy_project(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if matches!(&*name, "node_modules" | "target" | ".venv" | "__pycache__") || name.ends_with(".wasm") {
            continue;
        }
        if entry.file_type().unwrap().is_dir() {
            copy_project(&entry.path(), &to.join(&*name));
        } else {
            std::fs::copy(entry.path(), to.join(&*name)).unwrap();
        }
    }
}

/// Builds the plugin project in `dir` (written by `sagabox new` or copied from an example)
/// the way its README says, with the pinned toolchain; returns the time the build took (the
/// toolchain's installation apart). The project's `<name>.wasm` is then in `dir`.
pub fn build(lang: Lang, dir: &Path, name: &str) -> Duration {
    let timeout = Duration::from_secs(1800);
    let started;
    match lang {
        Lang::Js => {
            let modules = npm_modules("componentize-js", &Lang::Js.example_dir());
            let link = dir.join("node_modules");
            if !link.exists() {
                std::os::unix::fs::symlink(&modules, &link).unwrap();
            }
            started = Instant::now();
            run(Command::new("npm").args(["run", "build"]).current_dir(dir), timeout);
        }
        Lang::Python => {
            let bin = componentize_py_bin();
            started = Instant::now();
            let out = format!("{name}.wasm");
            run(
                Command::new(bin.join("componentize-py"))
                    .args(["-d", "wit", "-w", "plugin", "componentize", "app", "-o", &out])
                    .current_dir(dir),
                timeout,
            );
        }
        Lang::Rust => {
            // Projects share one target directory (and its `plugin.wasm`): one build at a time.
            let _guard = install_lock("lang-rust-build");
            started = Instant::now();
            let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
            cargo
                .args(["build", "--release", "--target", "wasm32-wasip2", "--target-dir"])
                .arg(rust_target_dir())
                .current_dir(dir)
                .env_remove("CARGO_TARGET_DIR")
                .env_remove("RUSTFLAGS");
            run(&mut cargo, timeout);
            let built = rust_target_dir().join("wasm32-wasip2/release/plugin.wasm");
            std::fs::copy(&built, dir.join(format!("{name}.wasm")))
                .unwrap_or_else(|e| panic!("cannot copy {}: {e}", built.display()));
            drop(_guard);
        }
    }
    let took = started.elapsed();
    assert!(dir.join(format!("{name}.wasm")).is_file(), "the {lang:?} build wrote no {name}.wasm in {}", dir.display());
    took
}
