//! Errors of loading plugins and of calling tools. Each names the plugin (and tool) and says
//! which limit or rule was hit, so a user can act without reading logs.

use std::path::PathBuf;

use serde::Serialize;

/// A plugin that could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read plugin {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: not a WebAssembly file (it does not start with the \\0asm magic number)")]
    NotWasm { path: PathBuf },
    #[error(
        "{path}: a core WebAssembly module, not a component; build it for wasm32-wasip2, \
         or wrap it with `wasm-tools component new`"
    )]
    CoreModule { path: PathBuf },
    #[error("{path}: not a valid component: {reason}")]
    InvalidComponent { path: PathBuf, reason: String },
    #[error("{path}: not a sagabox plugin: {reason}")]
    WrongWorld { path: PathBuf, reason: String },
    #[error("{path}: invalid manifest: {reason}")]
    InvalidManifest { path: PathBuf, reason: String },
    #[error("{path}: invalid policy: {reason}")]
    InvalidPolicy { path: PathBuf, reason: String },
    #[error("{path}: '{name}' is not a valid plugin name (use lower-case letters, digits, '_' and '-')")]
    InvalidName { path: PathBuf, name: String },
    #[error("two plugins are named '{name}': {first} and {second}")]
    DuplicateName { name: String, first: PathBuf, second: PathBuf },
    #[error("{path}: refused: {detail} (load cap {cap}; an operator can raise it)")]
    OverCap { path: PathBuf, cap: &'static str, detail: String },
    #[error("{path}: not loaded: {reason}")]
    NotAPlugin { path: PathBuf, reason: String },
    #[error("cannot read plugin directory {path}: {error}")]
    Directory { path: PathBuf, error: std::io::Error },
    #[error("cannot set up the WebAssembly engine: {0}")]
    Engine(String),
}

/// What kind of failure a call ended in; the saga engine decides retries and compensation
/// from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// The arguments were wrong: never retried.
    InvalidInput,
    /// A business rule refused: never retried.
    Rejected,
    /// A passing failure: retried per policy.
    Transient,
    /// The host stopped the call (trap, limit, access denied): nothing was written.
    Contained,
}

/// Why a call did not return a result. `tool` is always `<plugin>.<tool>`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize)]
#[serde(tag = "error", rename_all = "snake_case")]
pub enum CallError {
    #[error("no tool named '{tool}' ({reason})")]
    UnknownTool { tool: String, reason: String },
    #[error("{tool}: invalid input: {message}")]
    InvalidInput { tool: String, message: String },
    #[error("{tool}: rejected: {message}")]
    Rejected { tool: String, message: String },
    #[error("{tool}: transient failure: {message}")]
    Transient { tool: String, message: String },
    #[error("{tool}: out of fuel (limit: {fuel} units)")]
    OutOfFuel { tool: String, fuel: u64 },
    #[error("{tool}: deadline exceeded (limit: {deadline_ms} ms)")]
    DeadlineExceeded { tool: String, deadline_ms: u64 },
    #[error("{tool}: memory limit exceeded (limit: {memory_mib} MiB): {detail}")]
    MemoryLimit { tool: String, memory_mib: u64, detail: String },
    #[error("{tool}: wasm stack overflow (limit: {stack_kib} KiB)")]
    StackOverflow { tool: String, stack_kib: u64 },
    #[error("{tool}: trapped: {message}\n{backtrace}")]
    Trap { tool: String, message: String, backtrace: String },
    #[error("{tool}: output too large ({bytes} bytes; limit: {limit} bytes)")]
    OutputTooLarge { tool: String, bytes: usize, limit: usize },
    #[error("{tool}: access denied: {what}")]
    AccessDenied { tool: String, what: String },
    #[error("{tool}: returned invalid JSON: {reason}")]
    InvalidOutput { tool: String, reason: String },
    #[error("{tool}: the host could not run the call: {reason}")]
    Host { tool: String, reason: String },
}

impl CallError {
    pub fn kind(&self) -> FailureKind {
        match self {
            CallError::UnknownTool { .. } | CallError::InvalidInput { .. } => FailureKind::InvalidInput,
            CallError::Rejected { .. } => FailureKind::Rejected,
            CallError::Transient { .. } | CallError::Host { .. } => FailureKind::Transient,
            _ => FailureKind::Contained,
        }
    }

    /// A short stable name of the variant (`out_of_fuel`, `rejected`, ...).
    pub fn code(&self) -> &'static str {
        match self {
            CallError::UnknownTool { .. } => "unknown_tool",
            CallError::InvalidInput { .. } => "invalid_input",
            CallError::Rejected { .. } => "rejected",
            CallError::Transient { .. } => "transient",
            CallError::OutOfFuel { .. } => "out_of_fuel",
            CallError::DeadlineExceeded { .. } => "deadline_exceeded",
            CallError::MemoryLimit { .. } => "memory_limit",
            CallError::StackOverflow { .. } => "stack_overflow",
            CallError::Trap { .. } => "trap",
            CallError::OutputTooLarge { .. } => "output_too_large",
            CallError::AccessDenied { .. } => "access_denied",
            CallError::InvalidOutput { .. } => "invalid_output",
            CallError::Host { .. } => "host",
        }
    }
}
