//! Python for the tests that drive `sagabox serve` with real MCP clients (tests/serve.rs).
//!
//! `venv()` builds `target/py-venv` from `tests/mcp/requirements.lock` (every package pinned)
//! the first time a machine needs it, and builds it again whenever the lock file or the
//! Python changes (a stamp file keeps the lock's SHA-256 and `python3 --version`). Test
//! binaries that need it at once wait for each other on a file lock. Any failure panics with
//! the output of the command that failed. `SAGABOX_PYTHON` names another interpreter than
//! `python3`. `run` runs a script with a deadline.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// The workspace's root directory.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the host crate is in the workspace").to_path_buf()
}

fn target_dir() -> PathBuf {
    // An absolute CARGO_TARGET_DIR replaces the workspace path in `join`; a relative one is
    // relative to the workspace, as cargo takes it when run from there.
    workspace().join(std::env::var_os("CARGO_TARGET_DIR").unwrap_or_else(|| "target".into()))
}

/// The interpreter of the venv for the MCP scenarios (`mcp==2.3.0`, tests/mcp/).
pub fn venv() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| ensure_venv("py-venv", &workspace().join("tests/mcp/requirements.lock"), PIP_CHECK)).clone()
}

/// The interpreter of the LangGraph example's venv (examples/langgraph/): a venv of its own,
/// since langchain-mcp-adapters needs `mcp<2`.
pub fn langgraph_venv() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            ensure_venv("py-venv-langgraph", &workspace().join("examples/langgraph/requirements.lock"), PIP_CHECK)
        })
        .clone()
}

/// The check that a venv is complete when its lock pins every dependency: `pip check`.
pub const PIP_CHECK: &[&str] = &["-m", "pip", "check"];

/// `target/NAME` holding a venv with exactly the packages of `lock` (installed with
/// `--no-deps`), then `python CHECK...` run to prove that nothing is missing; returns its python.
/// Built again when the lock or the Python changes.
pub fn ensure_venv(name: &str, lock: &Path, check: &[&str]) -> PathBuf {
    let base = std::env::var("SAGABOX_PYTHON").unwrap_or_else(|_| "python3".into());
    let requirements = std::fs::read(lock).unwrap_or_else(|e| panic!("cannot read {}: {e}", lock.display()));
    let version = run(Command::new(&base).arg("--version"), Duration::from_secs(60));
    let stamp = format!("{}\n{}", hex::encode(Sha256::digest(&requirements)), version.stdout.trim());

    let target = target_dir();
    std::fs::create_dir_all(&target).unwrap_or_else(|e| panic!("cannot create {}: {e}", target.display()));
    let guard = File::create(target.join(format!("{name}.lock"))).expect("the venv's lock file");
    guard.lock().expect("locking the venv's lock file");

    let dir = target.join(name);
    let python = dir.join("bin/python");
    let stamp_path = dir.join("sagabox-stamp");
    if python.exists() && std::fs::read_to_string(&stamp_path).is_ok_and(|s| s == stamp) {
        return python;
    }
    let started = Instant::now();
    if dir.exists() {
        std::fs::remove_dir_all(&dir).unwrap_or_else(|e| panic!("cannot remove {}: {e}", dir.display()));
    }
    let pip_timeout = Duration::from_secs(900);
    run(Command::new(&base).args(["-m", "venv"]).arg(&dir), Duration::from_secs(120));
    let pip = |args: &[&str]| {
        let mut command = Command::new(&python);
        command.args(["-m", "pip", "--disable-pip-version-check", "--no-input"]).args(args);
        command
    };
    // --no-deps: the lock pins every package, and the check proves that none is missing.
    run(pip(&["install", "--no-deps", "--requirement"]).arg(lock), pip_timeout);
    run(Command::new(&python).args(check).env("PYTHONDONTWRITEBYTECODE", "1"), pip_timeout);
    std::fs::write(&stamp_path, stamp).expect("the venv's stamp");
    eprintln!("created {} from {} in {:.0?}", dir.display(), lock.display(), started.elapsed());
    python
}

/// A finished process: its status and what it printed.
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    /// Stdout as JSON (the scenario scripts print one JSON summary).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!("the script's stdout is not JSON ({e}):\n{}\n--- stderr ---\n{}", self.stdout, self.stderr)
        })
    }
}

/// `python script` run from the workspace, without bytecode files in the repository, with
/// unbuffered output and the tests' compile cache for any `sagabox` it starts.
pub fn script(python: &Path, script: &Path) -> Command {
    let mut command = Command::new(python);
    command
        .arg(script)
        .current_dir(workspace())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PYTHONUNBUFFERED", "1")
        .env("SAGABOX_CACHE_DIR", super::shared_cache())
        .env_remove("SAGABOX_LOG");
    command
}

/// Runs `command` to its end; panics with its stdout and stderr when it fails or is still
/// running after `timeout` (then it and every process it started are killed).
pub fn run(command: &mut Command, timeout: Duration) -> Finished {
    let (finished, timed_out) = run_with_deadline(command, timeout);
    if timed_out || !finished.status.success() {
        let what = if timed_out {
            format!("still running after {timeout:?}, or a process it started kept its output open")
        } else {
            finished.status.to_string()
        };
        panic!(
            "{command:?}: {what}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            finished.stdout.trim_end(),
            finished.stderr.trim_end()
        );
    }
    finished
}

/// Runs `command` in a process group of its own, which is killed at the deadline.
fn run_with_deadline(command: &mut Command, timeout: Duration) -> (Finished, bool) {
    use std::os::unix::process::CommandExt;
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {command:?}: {e}"));
    let group = child.id() as libc::pid_t;
    // SAFETY: kill(2) with the negated id of the process group this function created.
    let kill_group = || unsafe {
        libc::kill(-group, libc::SIGKILL);
    };
    let stdout = drain(child.stdout.take().unwrap());
    let stderr = drain(child.stderr.take().unwrap());
    let deadline = Instant::now() + timeout;
    let mut timed_out = false;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the child") {
            break status;
        }
        if Instant::now() >= deadline {
            timed_out = true;
            kill_group();
            break child.wait().expect("waiting for the killed child");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // A process the child started may still hold its pipes: wait for them a little, then kill.
    let mut collect = |pipe: &Receiver<String>| {
        pipe.recv_timeout(Duration::from_secs(10)).unwrap_or_else(|_| {
            timed_out = true;
            kill_group();
            pipe.recv().unwrap_or_default()
        })
    };
    let (stdout, stderr) = (collect(&stdout), collect(&stderr));
    (Finished { status, stdout, stderr }, timed_out)
}

fn drain(mut pipe: impl Read + Send + 'static) -> Receiver<String> {
    let (send, receive) = channel();
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        let _ = send.send(String::from_utf8_lossy(&bytes).into_owned());
    });
    receive
}
