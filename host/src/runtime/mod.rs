//! The plugin runtime: loads tool plugins as WebAssembly components and runs every call in a
//! fresh, limited sandbox.
//!
//! Per call: a new `Store` and instance from the plugin's pre-linked `InstancePre` (cheap
//! with the pooling allocator), a fuel budget, an epoch deadline (for guests spinning in
//! wasm) and a timer (for guests blocked in a host call), memory/table/instance caps, an
//! output cap and a store write quota. The call's store writes stay in its [`Txn`] until the
//! caller commits it, so a call that fails in any way writes nothing.

mod engine;
pub mod error;
mod native;
mod plugin;
pub mod policy;
mod sandbox;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;
use wasmtime::{Store, Trap};

pub use engine::{CompileCache, CompileSource, EngineOptions};
pub use error::{CallError, FailureKind, LoadError};
pub use plugin::{BundledPlugin, Origin, Plugin, Tool, ToolInfo, valid_name};
pub use policy::{LimitOverrides, Limits, Policy};
pub use sandbox::InjectedFault;

use crate::store::{Change, Conflict, MemoryStore, State, Txn};
use engine::Engines;
use plugin::{Source, validate_manifest};
use sandbox::{Abort, CallState, Grants};

/// Bindings generated from `wit/`.
pub(crate) mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "plugin",
        exports: { default: async },
    });
}

/// How many times a call runs when its commit keeps conflicting with other commits.
pub const MAX_COMMIT_RUNS: u32 = 16;

/// Where plugins come from and how they run.
#[derive(Clone, Debug)]
pub struct RuntimeOptions {
    /// Load the plugins compiled into the binary.
    pub bundled: bool,
    /// Load every `*.wasm` in these directories too.
    pub plugin_dirs: Vec<PathBuf>,
    /// Compiled plugins are cached here (`None`: no cache).
    pub cache_dir: Option<PathBuf>,
    pub engine: EngineOptions,
    /// Limits of every call, before plugin policies and per-call overrides.
    pub defaults: Limits,
    /// For benchmarks: call the bundled tools' logic natively, outside the sandbox (the
    /// plugins are still loaded, for their manifests). Not for untrusted code.
    pub native_tools: bool,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        RuntimeOptions {
            bundled: true,
            plugin_dirs: Vec::new(),
            cache_dir: CompileCache::default_dir(),
            engine: EngineOptions::default(),
            defaults: Limits::default(),
            native_tools: false,
        }
    }
}

/// Every plugin that failed to load; each line names its file.
#[derive(Debug, thiserror::Error)]
#[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
pub struct LoadErrors(pub Vec<LoadError>);

/// Who is calling; passed to the tool (see `call-context` in the WIT).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CallContext {
    pub saga_id: String,
    pub step_id: String,
    pub attempt: u32,
    pub idempotency_key: String,
}

/// Everything about one call besides the tool and its arguments.
#[derive(Clone, Debug, Default)]
pub struct CallOptions {
    pub context: CallContext,
    /// Laid over the plugin's limits.
    pub limits: LimitOverrides,
    /// A failure to inject (verification campaigns).
    pub fault: Option<InjectedFault>,
    /// Seed for deterministic WASI clocks and randomness (verification campaigns).
    pub seed: Option<u64>,
}

/// The result of running a call, before its writes are committed.
#[derive(Debug)]
pub struct Invocation {
    pub result: Result<Value, CallError>,
    /// The call's reads and writes; commit it only when `result` is `Ok`.
    pub txn: Txn,
    /// Fuel the call burned (0 when fuel is off).
    pub fuel_used: u64,
    pub elapsed: Duration,
}

/// A committed call.
#[derive(Debug)]
pub struct CallOutcome {
    pub result: Result<Value, CallError>,
    pub changes: Vec<Change>,
    pub fuel_used: u64,
    pub elapsed: Duration,
    /// Runs of the call (more than one when commits conflicted).
    pub runs: u32,
}

/// The loaded plugins and the engines that run them.
pub struct Runtime {
    engines: Engines,
    cache: CompileCache,
    defaults: Limits,
    native_tools: bool,
    plugins: BTreeMap<String, Arc<Plugin>>,
}

impl Runtime {
    /// Loads the bundled plugins and every `*.wasm` of `options.plugin_dirs`.
    pub async fn load(options: RuntimeOptions) -> Result<Runtime, LoadErrors> {
        options.defaults.check().map_err(|e| LoadErrors(vec![LoadError::Engine(e)]))?;
        let mut runtime = Runtime {
            engines: Engines::new(options.engine),
            cache: CompileCache::new(options.cache_dir.clone()),
            defaults: options.defaults.clone(),
            native_tools: options.native_tools,
            plugins: BTreeMap::new(),
        };
        let mut sources = Vec::new();
        let mut errors = Vec::new();
        if options.bundled {
            for bundled in crate::bundled::BUNDLED {
                match Source::bundled(bundled) {
                    Ok(source) => sources.push(source),
                    Err(e) => errors.push(e),
                }
            }
        }
        for dir in &options.plugin_dirs {
            match wasm_files(dir) {
                Ok(files) => {
                    for file in files {
                        match Source::file(&file) {
                            Ok(source) => sources.push(source),
                            Err(e) => errors.push(e),
                        }
                    }
                }
                Err(error) => errors.push(LoadError::Directory { path: dir.clone(), error }),
            }
        }
        for source in sources {
            if let Some(existing) = runtime.plugins.get(&source.name) {
                errors.push(LoadError::DuplicateName {
                    name: source.name.clone(),
                    first: PathBuf::from(existing.origin.to_string()),
                    second: source.path(),
                });
                continue;
            }
            match runtime.prepare(source).await {
                Ok(plugin) => {
                    runtime.plugins.insert(plugin.name.clone(), Arc::new(plugin));
                }
                Err(e) => errors.push(e),
            }
        }
        if errors.is_empty() { Ok(runtime) } else { Err(LoadErrors(errors)) }
    }

    /// Compiles (or loads from the cache), links and asks for the manifest of one plugin.
    async fn prepare(&self, source: Source) -> Result<Plugin, LoadError> {
        source.check_header()?;
        let path = source.path();
        let limits = self.defaults.with(&source.policy.limits);
        limits.check().map_err(|reason| LoadError::InvalidPolicy { path: path.clone(), reason })?;
        let sha256 = crate::json::sha256_hex(&source.wasm);
        let grants = Arc::new(Grants::from_policy(&source.policy));
        let (pre, compiled) = self.link(&source.wasm, &sha256, &grants, limits.stack_kib, &path)?;
        let manifest = self
            .read_manifest(&pre, &source.name, &limits)
            .await
            .map_err(|reason| LoadError::InvalidManifest { path: path.clone(), reason })?;
        let tools = validate_manifest(manifest).map_err(|reason| LoadError::InvalidManifest { path, reason })?;
        tracing::debug!(plugin = %source.name, %sha256, ?compiled, "loaded plugin");
        Ok(Plugin {
            name: source.name,
            origin: source.origin,
            sha256,
            policy: source.policy,
            limits: limits.clone(),
            compiled,
            tools,
            wasm: source.wasm,
            grants,
            prepared: std::sync::Mutex::new([(limits.stack_kib, pre)].into()),
        })
    }

    /// Compiles `wasm` for the engine of `stack_kib` and pre-links it.
    fn link(
        &self,
        wasm: &[u8],
        sha256: &str,
        grants: &Grants,
        stack_kib: u64,
        path: &std::path::Path,
    ) -> Result<(bindings::PluginPre<CallState>, CompileSource), LoadError> {
        let engine = self.engines.get(stack_kib).map_err(LoadError::Engine)?;
        let (component, compiled) = self
            .cache
            .load_or_compile(&engine, wasm, sha256)
            .map_err(|e| LoadError::InvalidComponent { path: path.to_path_buf(), reason: format!("{e:#}") })?;
        let linker = sandbox::linker(&engine, grants).map_err(|e| LoadError::Engine(format!("{e:#}")))?;
        let wrong_world =
            |e: wasmtime::Error| LoadError::WrongWorld { path: path.to_path_buf(), reason: format!("{e:#}") };
        let instance_pre = linker.instantiate_pre(&component).map_err(wrong_world)?;
        let pre = bindings::PluginPre::new(instance_pre).map_err(|e| LoadError::WrongWorld {
            path: path.to_path_buf(),
            reason: format!("it does not export the tool interface of the sagabox:plugin@0.1.0 world ({e:#})"),
        })?;
        Ok((pre, compiled))
    }

    /// Calls `manifest` in a sandbox with the plugin's limits and no store access.
    async fn read_manifest(
        &self,
        pre: &bindings::PluginPre<CallState>,
        name: &str,
        limits: &Limits,
    ) -> Result<Vec<bindings::exports::sagabox::plugin::tool::ToolInfo>, String> {
        let tool: Arc<str> = format!("{name}.manifest").into();
        let txn = Txn::new(State::default(), limits.write_quota());
        let state = CallState::new(Arc::new(Grants::default()), tool.clone(), limits, txn, None)?;
        let mut store = self.new_store(pre.engine(), state, limits);
        let run = tokio::time::timeout(limits.deadline(), async {
            let instance = pre.instantiate_async(&mut store).await?;
            instance.sagabox_plugin_tool().call_manifest(&mut store).await
        })
        .await;
        match run {
            Ok(Ok(infos)) => Ok(infos),
            Ok(Err(e)) => Err(format!("the manifest call failed: {}", classify(&tool, e, &store, limits))),
            Err(_) => Err(format!("the manifest call took longer than {} ms", limits.deadline_ms)),
        }
    }

    fn new_store(&self, engine: &wasmtime::Engine, state: CallState, limits: &Limits) -> Store<CallState> {
        let mut store = Store::new(engine, state);
        store.limiter(|s| &mut s.limiter);
        let options = self.engines.options();
        if options.fuel {
            // Cannot fail: fuel is enabled on every engine when `options.fuel` is set.
            let _ = store.set_fuel(limits.fuel);
        }
        if options.epochs {
            let tick = engine::EPOCH_TICK.as_millis().max(1) as u64;
            store.set_epoch_deadline(limits.deadline_ms.div_ceil(tick) + 1);
            store.epoch_deadline_trap();
        }
        store
    }

    /// Loaded plugins, by name.
    pub fn plugins(&self) -> impl Iterator<Item = &Arc<Plugin>> {
        self.plugins.values()
    }

    pub fn plugin(&self, name: &str) -> Option<&Arc<Plugin>> {
        self.plugins.get(name)
    }

    /// The plugin and tool of `<plugin>.<tool>`.
    pub fn resolve(&self, qualified: &str) -> Result<(&Arc<Plugin>, &Tool), CallError> {
        let unknown = |reason: String| CallError::UnknownTool { tool: qualified.to_string(), reason };
        let (plugin_name, tool_name) =
            qualified.split_once('.').ok_or_else(|| unknown("tool names are written <plugin>.<tool>".into()))?;
        let plugin = self.plugins.get(plugin_name).ok_or_else(|| {
            let known: Vec<&str> = self.plugins.keys().map(String::as_str).collect();
            unknown(format!("no plugin '{plugin_name}' is loaded; loaded: {}", known.join(", ")))
        })?;
        let tool = plugin.tools.get(tool_name).ok_or_else(|| {
            let known: Vec<&str> = plugin.tools.keys().map(String::as_str).collect();
            unknown(format!("plugin '{plugin_name}' has no tool '{tool_name}'; it has: {}", known.join(", ")))
        })?;
        Ok((plugin, tool))
    }

    /// The effective limits of a call to `plugin` with `overrides`.
    pub fn limits_for(&self, plugin: &Plugin, overrides: &LimitOverrides) -> Limits {
        plugin.limits.with(overrides)
    }

    /// Runs `<plugin>.<tool>` on a transaction over `base`; the writes stay in the returned
    /// transaction.
    pub async fn invoke(&self, qualified: &str, args: &Value, options: &CallOptions, base: State) -> Invocation {
        let started = Instant::now();
        let (plugin, tool) = match self.resolve(qualified) {
            Ok(found) => found,
            Err(e) => {
                let txn = Txn::new(base, Default::default());
                return Invocation { result: Err(e), txn, fuel_used: 0, elapsed: started.elapsed() };
            }
        };
        let limits = self.limits_for(plugin, &options.limits);
        let mut txn = Txn::new(base, limits.write_quota());
        let mut fuel_used = 0;
        let result = self.run(plugin, tool, qualified, args, options, &limits, &mut txn, &mut fuel_used).await;
        Invocation { result, txn, fuel_used, elapsed: started.elapsed() }
    }

    #[allow(clippy::too_many_arguments)]
    async fn run(
        &self,
        plugin: &Plugin,
        tool: &Tool,
        qualified: &str,
        args: &Value,
        options: &CallOptions,
        limits: &Limits,
        txn: &mut Txn,
        fuel_used: &mut u64,
    ) -> Result<Value, CallError> {
        let host_error = |reason: String| CallError::Host { tool: qualified.to_string(), reason };
        limits.check().map_err(|reason| CallError::InvalidInput {
            tool: qualified.to_string(),
            message: format!("impossible limits: {reason}"),
        })?;
        if let Some(errors) = tool.schema_errors(args) {
            return Err(CallError::InvalidInput {
                tool: qualified.to_string(),
                message: format!("arguments do not match the tool's schema: {errors}"),
            });
        }
        if self.native_tools {
            return native::call(plugin, &tool.info.name, args, &options.context, limits, txn);
        }
        let pre = self.prepared(plugin, limits.stack_kib).map_err(host_error)?;
        let working = std::mem::replace(txn, Txn::new(State::default(), limits.write_quota()));
        let mut state = CallState::new(plugin.grants.clone(), qualified.into(), limits, working, options.seed)
            .map_err(host_error)?;
        state.armed = options.fault;
        let mut store = self.new_store(pre.engine(), state, limits);
        let context = bindings::exports::sagabox::plugin::tool::CallContext {
            saga_id: options.context.saga_id.clone(),
            step_id: options.context.step_id.clone(),
            attempt: options.context.attempt,
            idempotency_key: options.context.idempotency_key.clone(),
        };
        let args_text = crate::json::canonical(args);
        let run = tokio::time::timeout(limits.deadline(), async {
            let instance = pre.instantiate_async(&mut store).await?;
            instance.sagabox_plugin_tool().call_call(&mut store, &tool.info.name, &args_text, &context).await
        })
        .await;
        if self.engines.options().fuel {
            *fuel_used = limits.fuel.saturating_sub(store.get_fuel().unwrap_or(0));
        }
        let armed = store.data().armed;
        let outcome = match (run, armed) {
            (Err(_elapsed), _) => {
                Err(CallError::DeadlineExceeded { tool: qualified.into(), deadline_ms: limits.deadline_ms })
            }
            (Ok(Err(e)), _) => Err(classify(qualified, e, &store, limits)),
            // An injected fault that found no store write to fire at fires at the return.
            (Ok(Ok(_)), Some(fault)) => Err(injected(qualified, fault, limits)),
            (Ok(Ok(Err(tool_error))), None) => Err(tool_failure(qualified, tool_error)),
            (Ok(Ok(Ok(output))), None) => parse_output(qualified, &output, limits),
        };
        *txn = std::mem::replace(&mut store.data_mut().txn, Txn::new(State::default(), limits.write_quota()));
        outcome
    }

    /// The pre-linked instance of `plugin` for engines with `stack_kib` of wasm stack,
    /// compiling it on first use of that stack size.
    fn prepared(&self, plugin: &Plugin, stack_kib: u64) -> Result<bindings::PluginPre<CallState>, String> {
        let mut prepared = plugin.prepared.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(pre) = prepared.get(&stack_kib) {
            return Ok(pre.clone());
        }
        let path = PathBuf::from(plugin.origin.to_string());
        let (pre, _) =
            self.link(&plugin.wasm, &plugin.sha256, &plugin.grants, stack_kib, &path).map_err(|e| e.to_string())?;
        prepared.insert(stack_kib, pre.clone());
        Ok(pre)
    }

    /// Runs a call and commits its writes to `store`, running it again (on a fresh
    /// snapshot) when another commit changed what it read.
    pub async fn call(&self, qualified: &str, args: &Value, options: &CallOptions, store: &MemoryStore) -> CallOutcome {
        let mut runs = 0;
        loop {
            runs += 1;
            let invocation = self.invoke(qualified, args, options, store.snapshot()).await;
            let committed = match &invocation.result {
                Ok(_) => store.commit(&invocation.txn),
                Err(_) => Ok(Vec::new()),
            };
            match committed {
                Ok(changes) => {
                    return CallOutcome {
                        result: invocation.result,
                        changes,
                        fuel_used: invocation.fuel_used,
                        elapsed: invocation.elapsed,
                        runs,
                    };
                }
                Err(Conflict { namespace, key }) if runs >= MAX_COMMIT_RUNS => {
                    return CallOutcome {
                        result: Err(CallError::Transient {
                            tool: qualified.into(),
                            message: format!("{namespace}/{key} kept changing under the call ({runs} runs)"),
                        }),
                        changes: Vec::new(),
                        fuel_used: invocation.fuel_used,
                        elapsed: invocation.elapsed,
                        runs,
                    };
                }
                Err(conflict) => tracing::debug!(tool = qualified, %conflict, "commit conflict, running again"),
            }
        }
    }
}

/// The bytes of a bundled plugin.
pub fn bundled_wasm(name: &str) -> Option<&'static [u8]> {
    crate::bundled::BUNDLED.iter().find(|p| p.name == name).map(|p| p.wasm)
}

/// `*.wasm` files of `dir`, sorted.
fn wasm_files(dir: &std::path::Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "wasm"))
        .collect();
    files.sort();
    Ok(files)
}

fn tool_failure(tool: &str, error: bindings::exports::sagabox::plugin::tool::ToolError) -> CallError {
    use bindings::exports::sagabox::plugin::tool::ToolError as E;
    let tool = tool.to_string();
    match error {
        E::InvalidInput(message) => CallError::InvalidInput { tool, message },
        E::Rejected(message) => CallError::Rejected { tool, message },
        E::Transient(message) => CallError::Transient { tool, message },
    }
}

fn injected(tool: &str, fault: InjectedFault, limits: &Limits) -> CallError {
    let tool = tool.to_string();
    match fault {
        InjectedFault::Trap => {
            CallError::Trap { tool, message: "injected fault: trap".into(), backtrace: String::new() }
        }
        InjectedFault::Fuel => CallError::OutOfFuel { tool, fuel: limits.fuel },
        InjectedFault::Deadline => CallError::DeadlineExceeded { tool, deadline_ms: limits.deadline_ms },
    }
}

fn parse_output(tool: &str, output: &str, limits: &Limits) -> Result<Value, CallError> {
    if output.len() > limits.output_bytes() {
        return Err(CallError::OutputTooLarge { tool: tool.into(), bytes: output.len(), limit: limits.output_bytes() });
    }
    serde_json::from_str(output).map_err(|e| CallError::InvalidOutput { tool: tool.into(), reason: e.to_string() })
}

/// Turns an error out of wasmtime into the typed reason the call stopped.
fn classify(tool: &str, error: wasmtime::Error, store: &Store<CallState>, limits: &Limits) -> CallError {
    let state = store.data();
    let name = tool.to_string();
    match &state.abort {
        Some(Abort::AccessDenied(what)) => return CallError::AccessDenied { tool: name, what: what.clone() },
        Some(Abort::Injected(InjectedFault::Trap)) => return injected(tool, InjectedFault::Trap, limits),
        _ => {}
    }
    if let Some(detail) = &state.limiter.refused {
        return CallError::MemoryLimit { tool: name, memory_mib: limits.memory_mib, detail: detail.clone() };
    }
    let stderr = String::from_utf8_lossy(&state.stderr.contents()).trim().to_string();
    match error.downcast_ref::<Trap>() {
        Some(Trap::OutOfFuel) => CallError::OutOfFuel { tool: name, fuel: limits.fuel },
        Some(Trap::Interrupt) => CallError::DeadlineExceeded { tool: name, deadline_ms: limits.deadline_ms },
        Some(Trap::StackOverflow) => CallError::StackOverflow { tool: name, stack_kib: limits.stack_kib },
        Some(trap) => {
            let backtrace = error.downcast_ref::<wasmtime::WasmBacktrace>().map(|b| b.to_string()).unwrap_or_default();
            let message = if stderr.is_empty() { trap.to_string() } else { format!("{trap}; guest stderr: {stderr}") };
            CallError::Trap { tool: name, message, backtrace }
        }
        None => {
            let message = format!("{error:#}");
            if message.contains("concurrent") && message.contains("limit") {
                CallError::Host { tool: name, reason: format!("too many calls in flight: {message}") }
            } else {
                CallError::Trap { tool: name, message, backtrace: String::new() }
            }
        }
    }
}
