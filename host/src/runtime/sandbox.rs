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

use sagabox_toolkit::StoreErrorKind;

use super::access::{Granted, Refusal};
use super::bindings::sagabox::plugin::log::Level;
use super::bindings::sagabox::plugin::store::StoreError;
use super::engine::CallTicking;
use super::policy::{Limits, Policy, StoreGrants};
use crate::store::{FieldIs, Txn};
use crate::sync::lock;

/// The WASI version this host implements (wasmtime-wasi 48); guests built against any
/// 0.2.x version link to it.
pub(super) const WASI_VERSION: &str = "0.2.12";

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
        let mut kept = lock(&self.kept);
        let room = STDERR_CAPTURE.saturating_sub(kept.len());
        kept.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    pub fn contents(&self) -> Vec<u8> {
        lock(&self.kept).clone()
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
    pub network: super::operator::NetAllow,
}

impl Grants {
    pub fn from_policy(policy: &Policy) -> Grants {
        Grants {
            store: policy.store.clone(),
            env: policy.wasi.env.iter().filter_map(|k| std::env::var(k).ok().map(|v| (k.clone(), v))).collect(),
            dirs: policy.wasi.dirs.clone(),
            network: super::operator::NetAllow::new(&policy.wasi.network),
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
    /// Built when the guest first calls a WASI function (most tool calls never do), unless
    /// the plugin is granted directories: opening those can fail, which the call reports
    /// before it starts.
    wasi: Option<WasiCtx>,
    seed: Option<u64>,
    http: wasmtime_wasi_http::WasiHttpCtx,
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
    /// Where the plugin's log messages also go (an MCP client's logging notifications).
    pub log_sink: Option<Arc<dyn LogSink>>,
    /// Keeps the epoch ticker going while the store lives (set by the runtime with its store).
    pub ticking: Option<CallTicking>,
}

/// How much a plugin's log message matters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

/// Receives plugin log messages besides the host's own log.
pub trait LogSink: Send + Sync {
    fn log(&self, level: LogLevel, tool: &str, message: &str);
}

impl WasiView for CallState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        let (grants, seed, stderr) = (&self.grants, self.seed, &self.stderr);
        let ctx = self.wasi.get_or_insert_with(|| wasi_builder(grants, seed, stderr).build());
        WasiCtxView { ctx, table: &mut self.table }
    }
}

impl wasmtime_wasi_http::WasiHttpView for CallState {
    fn http(&mut self) -> wasmtime_wasi_http::WasiHttpCtxView<'_> {
        wasmtime_wasi_http::WasiHttpCtxView {
            ctx: &mut self.http,
            table: &mut self.table,
            hooks: wasmtime_wasi_http::default_hooks(),
        }
    }
}

/// A call's WASI context but its directories: only the granted capabilities, stderr
/// captured, and for a seeded call deterministic clocks and randomness.
fn wasi_builder(grants: &Grants, seed: Option<u64>, stderr: &StderrHead) -> WasiCtxBuilder {
    let mut wasi = WasiCtxBuilder::new();
    wasi.stderr(stderr.clone()).envs(&grants.env);
    grants.network.configure(&mut wasi);
    if let Some(seed) = seed {
        wasi.wall_clock(determinism::FixedClock(seed))
            .monotonic_clock(determinism::FixedClock(seed))
            .secure_random(determinism::rng(seed))
            .insecure_random(determinism::rng(seed ^ 0x5eed))
            .insecure_random_seed(u128::from(seed));
    }
    wasi
}

/// A call's WASI context with its granted directories, which must open.
fn with_dirs(grants: &Grants, seed: Option<u64>, stderr: &StderrHead) -> Result<WasiCtx, String> {
    let mut wasi = wasi_builder(grants, seed, stderr);
    for dir in &grants.dirs {
        let perms = if dir.writable { FsPerms::ReadWrite } else { FsPerms::ReadOnly };
        wasi.preopened_dir(&dir.host, &dir.guest, perms)
            .map_err(|e| format!("cannot open granted directory {}: {e}", dir.host.display()))?;
    }
    Ok(wasi.build())
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
        let wasi = if grants.dirs.is_empty() { None } else { Some(with_dirs(&grants, seed, &stderr)?) };
        Ok(CallState {
            wasi,
            seed,
            http: wasmtime_wasi_http::WasiHttpCtx::new(),
            table: ResourceTable::new(),
            limiter: CallLimiter::new(limits),
            txn,
            grants,
            tool,
            armed: None,
            abort: None,
            stderr,
            log_budget: LOG_BUDGET,
            log_sink: None,
            ticking: None,
        })
    }

    /// Whether the guest called a WASI function (tests).
    #[cfg(test)]
    pub fn used_wasi(&self) -> bool {
        self.wasi.is_some()
    }

    /// Stops the call: records why and returns the error that traps the guest.
    fn stop(&mut self, why: Abort) -> wasmtime::Error {
        self.abort.get_or_insert(why);
        wasmtime::Error::new(HostStop)
    }

    /// Stops the call unless the network grant lists `host` (on `port`, when known): the
    /// check of name lookups and of HTTP requests.
    pub(super) fn check_endpoint(&mut self, host: &str, port: Option<u16>, what: &str) -> wasmtime::Result<()> {
        let network = &self.grants.network;
        let allowed = match port {
            Some(port) => network.allows_endpoint(host, port),
            None => network.allows_name(host),
        };
        if allowed {
            return Ok(());
        }
        let target = port.map_or_else(|| format!("'{host}'"), |port| format!("'{host}:{port}'"));
        let what = format!("{what} to {target} is not granted (granted: {})", network.describe());
        Err(self.stop(Abort::AccessDenied(what)))
    }

    fn granted(&mut self) -> Granted<'_> {
        Granted { txn: &mut self.txn, grants: &self.grants.store }
    }

    /// A refusal as the guest sees it: a denied namespace stops the call; a store error is
    /// returned to the guest.
    fn refused(&mut self, refusal: Refusal) -> wasmtime::Result<StoreError> {
        match refusal {
            Refusal::Denied(what) => Err(self.stop(Abort::AccessDenied(what))),
            Refusal::Store(StoreErrorKind::InvalidDocument, m) => Ok(StoreError::InvalidDocument(m)),
            Refusal::Store(StoreErrorKind::QuotaExceeded, m) => Ok(StoreError::QuotaExceeded(m)),
            Refusal::Store(StoreErrorKind::Unavailable, m) => Ok(StoreError::Unavailable(m)),
        }
    }

    /// The result of a store operation for the guest.
    fn answer<T>(&mut self, result: Result<T, Refusal>) -> StoreResult<T> {
        match result {
            Ok(value) => Ok((Ok(value),)),
            Err(refusal) => Ok((Err(self.refused(refusal)?),)),
        }
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

/// A linker for a plugin with these grants: WASI, the store and log imports, and traps in
/// place of the WASI capabilities the grants withhold.
pub(crate) fn linker(engine: &Engine, grants: &Grants) -> wasmtime::Result<Linker<CallState>> {
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
    super::http::add_to_linker(&mut linker)?;
    add_store(&mut linker)?;
    add_log(&mut linker)?;
    linker.allow_shadowing(true);
    // Every HTTP request is checked, granted or not: without a grant each one is refused.
    super::http::add_checks(&mut linker)?;
    if grants.network.is_granted() {
        // Outgoing TCP to the granted hosts only: no UDP, every lookup and connect checked.
        deny(&mut linker, "sockets/udp-create-socket", "create-udp-socket", "UDP")?;
        add_network_checks(&mut linker)?;
    } else {
        for (interface, func) in [
            ("sockets/instance-network", "instance-network"),
            ("sockets/tcp-create-socket", "create-tcp-socket"),
            ("sockets/udp-create-socket", "create-udp-socket"),
            ("sockets/ip-name-lookup", "resolve-addresses"),
        ] {
            deny(&mut linker, interface, func, "network access")?;
        }
    }
    // wasi-libc lists the preopens when it sets up sockets: with network granted, an empty
    // list (no directory to open) stands for the denial.
    if grants.dirs.is_empty() && !grants.network.is_granted() {
        deny(&mut linker, "filesystem/preopens", "get-directories", "filesystem access")?;
    }
    Ok(linker)
}

/// Stops a lookup of a host, or a connection to an address, that the plugin's network grant
/// does not list, with an access-denied error (WASI's own address check, which stays on,
/// would only hand the guest an error code).
fn add_network_checks(linker: &mut Linker<CallState>) -> wasmtime::Result<()> {
    use wasmtime::component::Resource;
    use wasmtime_wasi::p2::bindings::sockets::{ip_name_lookup, network, tcp};
    use wasmtime_wasi::sockets::WasiSocketsView;
    type Lookup = Result<Resource<ip_name_lookup::ResolveAddressStream>, network::ErrorCode>;
    type Connect = (Resource<tcp::TcpSocket>, Resource<network::Network>, network::IpSocketAddress);

    let lookups = format!("wasi:sockets/ip-name-lookup@{WASI_VERSION}");
    linker.instance(&lookups)?.func_wrap(
        "resolve-addresses",
        |mut cx, (net, name): (Resource<network::Network>, String)| -> wasmtime::Result<(Lookup,)> {
            let state = cx.data_mut();
            state.check_endpoint(&name, None, "network access")?;
            let mut view = state.sockets();
            match ip_name_lookup::Host::resolve_addresses(&mut view, net, name) {
                Ok(stream) => Ok((Ok(stream),)),
                Err(e) => Ok((Err(network::Host::convert_error_code(&mut view, e)?),)),
            }
        },
    )?;
    linker.instance(&format!("wasi:sockets/tcp@{WASI_VERSION}"))?.func_wrap_async(
        "[method]tcp-socket.start-connect",
        |mut cx: StoreContextMut<'_, CallState>, (socket, net, remote): Connect| {
            Box::new(async move {
                let addr = std::net::SocketAddr::from(remote);
                let allow = cx.data().grants.network.clone();
                if !allow.allows(addr).await {
                    let what = format!("network access to {addr} is not granted (granted: {})", allow.describe());
                    return Err(cx.data_mut().stop(Abort::AccessDenied(what)));
                }
                let mut view = cx.data_mut().sockets();
                let started: Result<(), network::ErrorCode> =
                    match tcp::HostTcpSocket::start_connect(&mut view, socket, net, remote) {
                        Ok(()) => Ok(()),
                        Err(e) => Err(network::Host::convert_error_code(&mut view, e)?),
                    };
                Ok((started,))
            })
        },
    )?;
    Ok(())
}

/// Replaces a WASI function with one that stops the call with an access-denied error.
fn deny(linker: &mut Linker<CallState>, interface: &str, func: &str, what: &'static str) -> wasmtime::Result<()> {
    linker.instance(&format!("wasi:{interface}@{WASI_VERSION}"))?.func_new(func, move |mut cx, _, _, _| {
        Err(cx.data_mut().stop(Abort::AccessDenied(format!("{what} is not granted by the plugin's policy"))))
    })
}

/// The WIT's `field-is`, as it crosses from the guest.
#[derive(wasmtime::component::ComponentType, wasmtime::component::Lift)]
#[component(record)]
struct WitFieldIs {
    path: Vec<String>,
    value: String,
}

type StoreResult<T> = wasmtime::Result<(Result<T, StoreError>,)>;

fn add_store(linker: &mut Linker<CallState>) -> wasmtime::Result<()> {
    let mut store = linker.instance("sagabox:plugin/store@0.1.0")?;
    // The shared text is lowered into the guest's memory as it is: no host-side copy.
    store.func_wrap("get", |mut cx, (ns, key): (String, String)| -> StoreResult<Option<Arc<str>>> {
        let state = cx.data_mut();
        let got = state.granted().get(&ns, &key);
        state.answer(got)
    })?;
    store.func_wrap("put", |mut cx, (ns, key, doc): (String, String, String)| -> StoreResult<()> {
        // A write's grant is checked before an armed fault fires at it.
        if let Err(refusal) = cx.data_mut().granted().check_write(&ns) {
            return cx.data_mut().answer(Err(refusal));
        }
        fire_armed(&mut cx)?;
        let state = cx.data_mut();
        let put = state.granted().put(&ns, &key, &doc);
        state.answer(put)
    })?;
    store.func_wrap("delete", |mut cx, (ns, key): (String, String)| -> StoreResult<bool> {
        if let Err(refusal) = cx.data_mut().granted().check_write(&ns) {
            return cx.data_mut().answer(Err(refusal));
        }
        fire_armed(&mut cx)?;
        let state = cx.data_mut();
        let deleted = state.granted().delete(&ns, &key);
        state.answer(deleted)
    })?;
    store.func_wrap("list", |mut cx, (ns, prefix): (String, String)| -> StoreResult<Vec<String>> {
        let state = cx.data_mut();
        let listed = state.granted().list(&ns, &prefix);
        state.answer(listed)
    })?;
    store.func_wrap(
        "find",
        |mut cx, (ns, prefix, conditions): (String, String, Vec<WitFieldIs>)| -> StoreResult<Vec<(String, Arc<str>)>> {
            let conditions: Vec<FieldIs> =
                conditions.into_iter().map(|c| FieldIs { path: c.path, value: c.value }).collect();
            let state = cx.data_mut();
            let found = state.granted().find(&ns, &prefix, &conditions);
            state.answer(found)
        },
    )?;
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
            let level = match level {
                Level::Trace => LogLevel::Trace,
                Level::Debug => LogLevel::Debug,
                Level::Info => LogLevel::Info,
                Level::Warn => LogLevel::Warn,
                Level::Error => LogLevel::Error,
            };
            match level {
                LogLevel::Trace => tracing::trace!(target: "plugin", tool, "{message}"),
                LogLevel::Debug => tracing::debug!(target: "plugin", tool, "{message}"),
                LogLevel::Info => tracing::info!(target: "plugin", tool, "{message}"),
                LogLevel::Warn => tracing::warn!(target: "plugin", tool, "{message}"),
                LogLevel::Error => tracing::error!(target: "plugin", tool, "{message}"),
            }
            if let Some(sink) = &state.log_sink {
                sink.log(level, tool, message);
            }
            Ok(())
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::policy::DirGrant;
    use crate::store::{State, WriteQuota};

    fn call_state(grants: Grants) -> Result<CallState, String> {
        let txn = Txn::new(State::default(), WriteQuota::default());
        CallState::new(Arc::new(grants), "plugin.tool".into(), &Limits::default(), txn, Some(7))
    }

    fn dir(host: std::path::PathBuf) -> DirGrant {
        DirGrant { host, guest: "/data".into(), writable: false }
    }

    #[test]
    fn a_call_builds_its_wasi_context_when_the_guest_first_uses_it() {
        let mut call = call_state(Grants::default()).unwrap();
        assert!(!call.used_wasi(), "built before the guest asked");
        let _ = WasiView::ctx(&mut call);
        assert!(call.used_wasi());

        // Granted directories are opened before the call starts, so a missing one is
        // reported then, by name.
        let with_dir = call_state(Grants { dirs: vec![dir(std::env::temp_dir())], ..Grants::default() }).unwrap();
        assert!(with_dir.used_wasi());
        let missing = std::env::temp_dir().join("sagabox-no-such-directory");
        let error = call_state(Grants { dirs: vec![dir(missing.clone())], ..Grants::default() }).err().unwrap();
        assert!(error.contains(&missing.display().to_string()), "{error}");
    }
}
