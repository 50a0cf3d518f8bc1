//! What a plugin sees during one call: its store transaction, a WASI context with nothing
//! granted but what its policy grants, and the limiter that caps its memory and tables.
//!
//! Host functions never panic on guest input. A violation (a namespace or capability the
//! policy does not grant) records why in [`CallState::abort`] and traps the guest, so the
//! call ends with a typed error and its writes are dropped with the transaction.

use std::sync::Arc;

use wasmtime::component::{Linker, ResourceTable};
use wasmtime::{Engine, ResourceLimiter, StoreContextMut};
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use super::bindings::sagabox::plugin::log::Level;
use super::bindings::sagabox::plugin::store::StoreError;
use super::policy::{Limits, Policy, StoreGrants};
use crate::store::{Txn, TxnError};

/// The WASI version this host implements (wasmtime-wasi 48); guests built against any
/// 0.2.x version link to it.
const WASI_VERSION: &str = "0.2.12";

/// Bytes of a guest's stderr kept for trap messages.
const STDERR_CAPTURE: usize = 4096;

/// Bytes of log messages one call may record.
const LOG_BUDGET: usize = 16 * 1024;

/// A guest's stderr: the first bytes are kept for trap messages (a Rust panic message goes
/// there), the rest dropped. Writes never fail, so a chatty plugin works like a quiet one
/// (wasmtime's `MemoryOutputPipe` traps the guest once its capacity is reached).
#[derive(Clone, Default)]
pub(crate) struct StderrHead {
    kept: Arc<std::sync::Mutex<Vec<u8>>>,
}

impl StderrHead {
    fn keep(&self, bytes: &[u8]) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let room = STDERR_CAPTURE.saturating_sub(kept.len());
        kept.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    pub fn contents(&self) -> Vec<u8> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl wasmtime_wasi::cli::IsTerminal for StderrHead {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl wasmtime_wasi::cli::StdoutStream for StderrHead {
    fn p2_stream(&self) -> Box<dyn wasmtime_wasi::p2::OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl wasmtime_wasi::p2::Pollable for StderrHead {
    async fn ready(&mut self) {}
}

#[wasmtime_wasi::async_trait]
impl wasmtime_wasi::p2::OutputStream for StderrHead {
    fn write(&mut self, bytes: bytes::Bytes) -> wasmtime_wasi::p2::StreamResult<()> {
        self.keep(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> wasmtime_wasi::p2::StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> wasmtime_wasi::p2::StreamResult<usize> {
        Ok(64 << 10)
    }
}

impl tokio::io::AsyncWrite for StderrHead {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.keep(buf);
        std::task::Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// A failure the verification harness injects into a real call, at the call's first store
/// write (or, for a call that writes nothing, when it returns).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InjectedFault {
    /// The guest traps.
    Trap,
    /// The guest runs out of fuel.
    Fuel,
    /// The guest passes its deadline.
    Deadline,
}

/// Why the host stopped a call from inside a host function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Abort {
    AccessDenied(String),
    Injected(InjectedFault),
}

/// The error a host function traps with; the runtime reads the reason from [`CallState`].
#[derive(Debug, thiserror::Error)]
#[error("call stopped by the host")]
pub(crate) struct HostStop;

/// What the runtime grants a plugin, resolved once when it is loaded.
#[derive(Debug, Default)]
pub(crate) struct Grants {
    pub store: StoreGrants,
    pub env: Vec<(String, String)>,
    pub dirs: Vec<super::policy::DirGrant>,
    pub network: bool,
}

impl Grants {
    pub fn from_policy(policy: &Policy) -> Grants {
        Grants {
            store: policy.store.clone(),
            env: policy.wasi.env.iter().filter_map(|k| std::env::var(k).ok().map(|v| (k.clone(), v))).collect(),
            dirs: policy.wasi.dirs.clone(),
            network: policy.wasi.network,
        }
    }
}

/// Caps a call's memories, tables and instances, remembering what it refused.
pub(crate) struct CallLimiter {
    memory: usize,
    table_elements: usize,
    instances: usize,
    pub refused: Option<String>,
}

impl CallLimiter {
    pub fn new(limits: &Limits) -> CallLimiter {
        CallLimiter {
            memory: limits.memory_bytes(),
            table_elements: limits.table_elements as usize,
            instances: limits.instances as usize,
            refused: None,
        }
    }
}

impl ResourceLimiter for CallLimiter {
    fn memory_growing(&mut self, current: usize, desired: usize, _max: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.memory {
            self.refused = Some(format!("a memory asked to grow from {current} to {desired} bytes"));
            return Ok(false);
        }
        Ok(true)
    }

    fn table_growing(&mut self, current: usize, desired: usize, _max: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.table_elements {
            self.refused = Some(format!("a table asked to grow from {current} to {desired} elements"));
            return Ok(false);
        }
        Ok(true)
    }

    fn instances(&self) -> usize {
        self.instances
    }

    fn tables(&self) -> usize {
        self.instances
    }

    fn memories(&self) -> usize {
        self.instances
    }
}

/// The data of one call's `Store`.
pub(crate) struct CallState {
    wasi: WasiCtx,
    table: ResourceTable,
    pub limiter: CallLimiter,
    pub txn: Txn,
    grants: Arc<Grants>,
    /// `<plugin>.<tool>`, for logs.
    tool: Arc<str>,
    /// A fault to inject at the first store write.
    pub armed: Option<InjectedFault>,
    pub abort: Option<Abort>,
    pub stderr: StderrHead,
    log_budget: usize,
}

impl WasiView for CallState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

/// Deterministic clocks and randomness for reproducible runs.
pub(crate) mod determinism {
    use sha2::{Digest, Sha256};
    use wasmtime_wasi::{Deterministic, HostMonotonicClock, HostWallClock};

    /// A clock fixed at an instant derived from the seed: 2024-01-01T00:00:00Z plus up to a day.
    pub struct FixedClock(pub u64);

    impl HostWallClock for FixedClock {
        fn resolution(&self) -> std::time::Duration {
            std::time::Duration::from_secs(1)
        }
        fn now(&self) -> std::time::Duration {
            std::time::Duration::from_secs(1_704_067_200 + self.0 % 86_400)
        }
    }

    impl HostMonotonicClock for FixedClock {
        fn resolution(&self) -> u64 {
            1
        }
        fn now(&self) -> u64 {
            self.0 % 1_000_000
        }
    }

    /// Random bytes: 256 bytes derived from the seed, repeated (made per call, so kept small).
    pub fn rng(seed: u64) -> Deterministic {
        let mut bytes = Vec::with_capacity(256);
        let mut block: [u8; 32] = Sha256::digest(seed.to_le_bytes()).into();
        while bytes.len() < 256 {
            bytes.extend_from_slice(&block);
            block = Sha256::digest(block).into();
        }
        Deterministic::new(bytes)
    }
}

impl CallState {
    /// A fresh call state: WASI with only the granted capabilities, stderr captured.
    pub fn new(
        grants: Arc<Grants>,
        tool: Arc<str>,
        limits: &Limits,
        txn: Txn,
        seed: Option<u64>,
    ) -> Result<CallState, String> {
        let stderr = StderrHead::default();
        let mut wasi = WasiCtxBuilder::new();
        wasi.stderr(stderr.clone())
            .allow_tcp(grants.network)
            .allow_udp(grants.network)
            .allow_ip_name_lookup(grants.network)
            .envs(&grants.env);
        if let Some(seed) = seed {
            wasi.wall_clock(determinism::FixedClock(seed))
                .monotonic_clock(determinism::FixedClock(seed))
                .secure_random(determinism::rng(seed))
                .insecure_random(determinism::rng(seed ^ 0x5eed))
                .insecure_random_seed(u128::from(seed));
        }
        for dir in &grants.dirs {
            let perms = if dir.writable { FsPerms::ReadWrite } else { FsPerms::ReadOnly };
            wasi.preopened_dir(&dir.host, &dir.guest, perms)
                .map_err(|e| format!("cannot open granted directory {}: {e}", dir.host.display()))?;
        }
        Ok(CallState {
            wasi: wasi.build(),
            table: ResourceTable::new(),
            limiter: CallLimiter::new(limits),
            txn,
            grants,
            tool,
            armed: None,
            abort: None,
            stderr,
            log_budget: LOG_BUDGET,
        })
    }

    /// Stops the call: records why and returns the error that traps the guest.
    fn stop(&mut self, why: Abort) -> wasmtime::Error {
        self.abort.get_or_insert(why);
        wasmtime::Error::new(HostStop)
    }

    fn check_read(&mut self, ns: &str) -> wasmtime::Result<()> {
        if self.grants.store.can_read(ns) {
            return Ok(());
        }
        Err(self.stop(Abort::AccessDenied(format!("namespace '{ns}' is not granted for reading"))))
    }

    fn check_write(&mut self, ns: &str) -> wasmtime::Result<()> {
        if self.grants.store.can_write(ns) {
            return Ok(());
        }
        Err(self.stop(Abort::AccessDenied(format!("namespace '{ns}' is not granted for writing"))))
    }
}

/// Fires an armed fault at a store write: the guest traps now, or runs out of fuel or time
/// at its next instruction or check.
fn fire_armed(cx: &mut StoreContextMut<'_, CallState>) -> wasmtime::Result<()> {
    let Some(fault) = cx.data_mut().armed.take() else { return Ok(()) };
    cx.data_mut().abort = Some(Abort::Injected(fault));
    match fault {
        InjectedFault::Trap => return Err(wasmtime::Error::new(HostStop)),
        InjectedFault::Fuel => {
            if cx.set_fuel(0).is_err() {
                return Err(wasmtime::Error::new(HostStop));
            }
        }
        InjectedFault::Deadline => cx.set_epoch_deadline(0),
    }
    Ok(())
}

fn store_error(e: TxnError) -> StoreError {
    match e {
        TxnError::InvalidDocument { .. } => StoreError::InvalidDocument(e.to_string()),
        TxnError::QuotaExceeded(_) => StoreError::QuotaExceeded(e.to_string()),
    }
}

/// A linker for a plugin with these grants: WASI, the store and log imports, and traps in
/// place of the WASI capabilities the grants withhold.
pub(crate) fn linker(engine: &Engine, grants: &Grants) -> wasmtime::Result<Linker<CallState>> {
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
    add_store(&mut linker)?;
    add_log(&mut linker)?;
    linker.allow_shadowing(true);
    if !grants.network {
        for (interface, func) in [
            ("sockets/instance-network", "instance-network"),
            ("sockets/tcp-create-socket", "create-tcp-socket"),
            ("sockets/udp-create-socket", "create-udp-socket"),
            ("sockets/ip-name-lookup", "resolve-addresses"),
        ] {
            deny(&mut linker, interface, func, "network access")?;
        }
    }
    if grants.dirs.is_empty() {
        deny(&mut linker, "filesystem/preopens", "get-directories", "filesystem access")?;
    }
    Ok(linker)
}

/// Replaces a WASI function with one that stops the call with an access-denied error.
fn deny(linker: &mut Linker<CallState>, interface: &str, func: &str, what: &'static str) -> wasmtime::Result<()> {
    linker.instance(&format!("wasi:{interface}@{WASI_VERSION}"))?.func_new(func, move |mut cx, _, _, _| {
        Err(cx.data_mut().stop(Abort::AccessDenied(format!("{what} is not granted by the plugin's policy"))))
    })
}

type StoreResult<T> = wasmtime::Result<(Result<T, StoreError>,)>;

fn add_store(linker: &mut Linker<CallState>) -> wasmtime::Result<()> {
    let mut store = linker.instance("sagabox:plugin/store@0.1.0")?;
    store.func_wrap("get", |mut cx, (ns, key): (String, String)| -> StoreResult<Option<String>> {
        let state = cx.data_mut();
        state.check_read(&ns)?;
        Ok((Ok(state.txn.get(&ns, &key).map(|t| t.to_string())),))
    })?;
    store.func_wrap("put", |mut cx, (ns, key, doc): (String, String, String)| -> StoreResult<()> {
        cx.data_mut().check_write(&ns)?;
        fire_armed(&mut cx)?;
        Ok((cx.data_mut().txn.put(&ns, &key, &doc).map_err(store_error),))
    })?;
    store.func_wrap("delete", |mut cx, (ns, key): (String, String)| -> StoreResult<bool> {
        cx.data_mut().check_write(&ns)?;
        fire_armed(&mut cx)?;
        Ok((cx.data_mut().txn.delete(&ns, &key).map_err(store_error),))
    })?;
    store.func_wrap("list", |mut cx, (ns, prefix): (String, String)| -> StoreResult<Vec<String>> {
        let state = cx.data_mut();
        state.check_read(&ns)?;
        Ok((Ok(state.txn.list(&ns, &prefix)),))
    })?;
    Ok(())
}

fn add_log(linker: &mut Linker<CallState>) -> wasmtime::Result<()> {
    linker.instance("sagabox:plugin/log@0.1.0")?.func_wrap(
        "log",
        |mut cx, (level, message): (Level, String)| -> wasmtime::Result<()> {
            let state = cx.data_mut();
            if state.log_budget == 0 {
                return Ok(());
            }
            let cut = message.len().min(state.log_budget);
            let cut = (0..=cut).rev().find(|i| message.is_char_boundary(*i)).unwrap_or(0);
            state.log_budget -= cut;
            let (tool, message) = (&*state.tool, &message[..cut]);
            match level {
                Level::Trace => tracing::trace!(target: "plugin", tool, "{message}"),
                Level::Debug => tracing::debug!(target: "plugin", tool, "{message}"),
                Level::Info => tracing::info!(target: "plugin", tool, "{message}"),
                Level::Warn => tracing::warn!(target: "plugin", tool, "{message}"),
                Level::Error => tracing::error!(target: "plugin", tool, "{message}"),
            }
            Ok(())
        },
    )
}
