//! The plugin runtime: loads tool plugins as WebAssembly components and runs every call in a
//! fresh, limited sandbox.
//!
//! Per call: a new `Store` and instance from the plugin's pre-linked `InstancePre` (cheap
//! with the pooling allocator), a fuel budget, an epoch deadline (for guests spinning in
//! wasm) and a timer (for guests blocked in a host call), memory/table/instance caps, an
//! output cap and a store write quota. The call's store writes stay in its [`Txn`] until the
//! caller commits it, so a call that fails in any way writes nothing.

mod access;
mod args;
mod engine;
pub mod error;
mod http;
mod native;
pub mod operator;
mod plugin;
pub mod policy;
mod sandbox;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;
use wasmtime::{Store, Trap, UpdateDeadline};

pub use args::CallArgs;
pub use engine::{COMPILE_PROGRESS, CompileCache, CompileSource, EngineOptions, swap_is_on};
pub use error::{CallError, FailureKind, LoadError};
pub use operator::{Grant, Operator, OperatorError};
pub use plugin::{BundledPlugin, LoadCaps, Origin, Plugin, Tool, ToolInfo, valid_name};
pub use policy::{LimitOverrides, Limits, Policy};
pub use sandbox::{InjectedFault, LogLevel, LogSink};

tokio::task_local! {
    /// Where plugin log messages of calls made inside [`forwarding_logs`] also go.
    static PLUGIN_LOGS: Arc<dyn LogSink>;
}

/// Runs `work` with the log messages of the plugin calls it makes also sent to `sink`.
pub async fn forwarding_logs<F: std::future::Future>(sink: Arc<dyn LogSink>, work: F) -> F::Output {
    PLUGIN_LOGS.scope(sink, work).await
}

use crate::store::{Change, Conflict, MemoryStore, State, Txn};
use crate::sync::lock;
use engine::Engines;
use plugin::{ManifestError, Source, validate_manifest};
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

/// Runs after which a call that keeps conflicting queues for the runtime's contention gate.
const UNGATED_RUNS: u32 = 2;

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
    /// The most any plugin's policy may be granted.
    pub operator: Operator,
    /// For benchmarks: call the bundled tools' logic natively, outside the sandbox (the
    /// plugins are still loaded, for their manifests). Not for untrusted code.
    pub native_tools: bool,
    /// What loading one plugin may cost (file size, nesting, functions, manifest).
    pub load: LoadCaps,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        RuntimeOptions {
            bundled: true,
            plugin_dirs: Vec::new(),
            cache_dir: CompileCache::default_dir(),
            engine: EngineOptions::default(),
            defaults: Limits::default(),
            operator: Operator::default(),
            native_tools: false,
            load: LoadCaps::default(),
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
    /// An instant the call may not run past whatever its limits say (a saga's deadline):
    /// its deadline is the earlier of the two, so the guest is cut there.
    pub deadline: Option<Instant>,
    /// Run the guest in a task of its own, in parallel with the caller's other calls (for
    /// a caller with several calls in flight; a lone call is cheaper inline).
    pub parallel: bool,
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

/// What became of committing one run of a call.
pub enum CommitAttempt<T, E> {
    /// The writes are in.
    Committed(T),
    /// Something the call read changed before its writes got in: run it again.
    Conflict(Conflict),
    /// The commit failed for another reason; the call is not run again.
    Failed(E),
}

/// Why a call run to commit did not complete.
#[derive(Debug)]
pub enum CallFailure<E> {
    /// The call itself failed (or its reads kept changing under it); nothing was written.
    Call(CallError),
    /// The caller's commit failed.
    Commit(E),
}

/// A call run (and run again on conflicts) until its writes were committed.
#[derive(Debug)]
pub struct Committed<T, E> {
    pub result: Result<(Value, T), CallFailure<E>>,
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
    /// Held by a call while it runs again after [`UNGATED_RUNS`] conflicts: contended calls
    /// then take turns (first come, first served) instead of invalidating each other's reads
    /// until one runs out of runs, so a hot document cannot starve a call.
    contention: tokio::sync::Mutex<()>,
}

impl Runtime {
    /// Loads the plugins, serving those that load: the error list names every plugin that
    /// did not. `Err` only when nothing can run (the engine or the default limits).
    pub async fn load_partial(options: RuntimeOptions) -> Result<(Runtime, Vec<LoadError>), LoadErrors> {
        options.defaults.check().map_err(|e| LoadErrors(vec![LoadError::Engine(e)]))?;
        let mut runtime = Runtime {
            engines: Engines::new(options.engine),
            cache: CompileCache::new(options.cache_dir.clone()),
            defaults: options.defaults.clone(),
            native_tools: options.native_tools,
            plugins: BTreeMap::new(),
            contention: tokio::sync::Mutex::new(()),
        };
        let (sources, mut errors) = sources(&options);
        let sources = first_of_each_name(sources, &mut errors);
        // Plugins load side by side (compilation on blocking threads, manifest calls as
        // futures that yield every tick), so a slow one delays no other; `buffered` keeps
        // the order of the error list.
        let loads = sources.into_iter().map(|source| {
            let span = tracing::warn_span!("plugin", path = %source.path().display());
            tracing::Instrument::instrument(runtime.prepare(source, &options.operator, &options.load), span)
        });
        let results: Vec<_> =
            futures::StreamExt::collect(futures::StreamExt::buffered(futures::stream::iter(loads), load_parallelism()))
                .await;
        for result in results {
            match result {
                Ok(plugin) => {
                    runtime.plugins.insert(plugin.name.clone(), Arc::new(plugin));
                }
                Err(e) => errors.push(e),
            }
        }
        Ok((runtime, errors))
    }

    /// Loads the bundled plugins and every `*.wasm` of `options.plugin_dirs`; all or
    /// nothing (see [`Runtime::load_partial`] to serve the plugins that load).
    pub async fn load(options: RuntimeOptions) -> Result<Runtime, LoadErrors> {
        let (runtime, errors) = Runtime::load_partial(options).await?;
        if errors.is_empty() { Ok(runtime) } else { Err(LoadErrors(errors)) }
    }

    /// Compiles (or loads from the cache), links and asks for the manifest of one plugin.
    async fn prepare(&self, source: Source, operator: &Operator, caps: &LoadCaps) -> Result<Plugin, LoadError> {
        source.check_header()?;
        let path = source.path();
        let bundled = source.origin == Origin::Bundled;
        let grant = operator.grant(&source.name, bundled, &source.policy, &self.defaults);
        let limits = grant.limits.clone();
        limits.check().map_err(|reason| LoadError::InvalidPolicy { path: path.clone(), reason })?;
        let sha256 = crate::json::sha256_hex(&source.wasm);
        let grants = Arc::new(Grants::from_policy(&grant.policy));
        let (pre, compiled) = self.link_for_load(&source, &sha256, &grants, limits.stack_kib, caps).await?;
        let manifest = self.read_manifest(&pre, &source.name, &limits, caps).await.map_err(|e| e.at(path.clone()))?;
        let tools = validate_manifest(manifest, caps).map_err(|e| e.at(path))?;
        tracing::debug!(plugin = %source.name, %sha256, ?compiled, "loaded plugin");
        Ok(Plugin {
            name: source.name,
            origin: source.origin,
            sha256,
            policy: source.policy,
            grant,
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
        Ok((self.pre_link(&engine, &component, grants, path)?, compiled))
    }

    /// [`Runtime::link`] at load time: the structure checked against `caps` first, and the
    /// CPU-bound work on a blocking thread (inside the caller's span, so that wasmtime's
    /// warnings name the plugin).
    async fn link_for_load(
        &self,
        source: &Source,
        sha256: &str,
        grants: &Grants,
        stack_kib: u64,
        caps: &LoadCaps,
    ) -> Result<(bindings::PluginPre<CallState>, CompileSource), LoadError> {
        let path = source.path();
        let engine = self.engines.get(stack_kib).map_err(LoadError::Engine)?;
        let (cache, wasm, sha256, caps, span) =
            (self.cache.clone(), source.wasm.clone(), sha256.to_string(), caps.clone(), tracing::Span::current());
        let (job_engine, job_path) = (engine.clone(), path.clone());
        let job = tokio::task::spawn_blocking(move || {
            let _entered = span.enter();
            plugin::check_structure(&wasm, &job_path, &caps)?;
            cache
                .load_or_compile(&job_engine, &wasm, &sha256)
                .map_err(|e| LoadError::InvalidComponent { path: job_path, reason: format!("{e:#}") })
        });
        let (component, compiled) =
            job.await.map_err(|e| LoadError::InvalidComponent { path: path.clone(), reason: format!("{e}") })??;
        Ok((self.pre_link(&engine, &component, grants, &path)?, compiled))
    }

    /// Links a compiled plugin against the host's imports for its grants.
    fn pre_link(
        &self,
        engine: &wasmtime::Engine,
        component: &wasmtime::component::Component,
        grants: &Grants,
        path: &std::path::Path,
    ) -> Result<bindings::PluginPre<CallState>, LoadError> {
        let linker = sandbox::linker(engine, grants).map_err(|e| LoadError::Engine(format!("{e:#}")))?;
        let wrong_world =
            |e: wasmtime::Error| LoadError::WrongWorld { path: path.to_path_buf(), reason: format!("{e:#}") };
        let instance_pre = linker.instantiate_pre(component).map_err(wrong_world)?;
        bindings::PluginPre::new(instance_pre).map_err(|e| LoadError::WrongWorld {
            path: path.to_path_buf(),
            reason: format!("it does not export the tool interface of the sagabox:plugin@0.1.0 world ({e:#})"),
        })
    }

    /// Calls `manifest` in a sandbox with the plugin's limits, cut to the load budget of
    /// `caps` (a policy cannot stall start-up), and no store access.
    async fn read_manifest(
        &self,
        pre: &bindings::PluginPre<CallState>,
        name: &str,
        limits: &Limits,
        caps: &LoadCaps,
    ) -> Result<Vec<bindings::exports::sagabox::plugin::tool::ToolInfo>, ManifestError> {
        let limits = &manifest_limits(limits, caps);
        let tool: Arc<str> = format!("{name}.manifest").into();
        let txn = Txn::new(State::default(), limits.write_quota());
        let state = CallState::new(Arc::new(Grants::default()), tool.clone(), limits, txn, None)
            .map_err(ManifestError::Invalid)?;
        let mut store = self.new_store(pre.engine(), state, limits);
        let run = tokio::time::timeout(limits.deadline(), async {
            let instance = pre.instantiate_async(&mut store).await?;
            instance.sagabox_plugin_tool().call_manifest(&mut store).await
        })
        .await;
        let over_time = || {
            ManifestError::OverCap(
                "manifest_deadline_ms",
                format!("the manifest call took longer than {} ms", limits.deadline_ms),
            )
        };
        match run {
            Ok(Ok(infos)) => Ok(infos),
            Ok(Err(e)) => match classify(&tool, e, &store, limits) {
                CallError::OutOfFuel { fuel, .. } => Err(ManifestError::OverCap(
                    "manifest_fuel",
                    format!("the manifest call ran out of fuel ({fuel} units)"),
                )),
                CallError::DeadlineExceeded { .. } => Err(over_time()),
                other => Err(ManifestError::Invalid(format!("the manifest call failed: {other}"))),
            },
            Err(_) => Err(over_time()),
        }
    }

    fn new_store(&self, engine: &wasmtime::Engine, mut state: CallState, limits: &Limits) -> Store<CallState> {
        let options = self.engines.options();
        if options.epochs {
            state.ticking = Some(self.engines.call_started());
        }
        let mut store = Store::new(engine, state);
        store.limiter(|s| &mut s.limiter);
        if options.fuel {
            // Cannot fail: fuel is enabled on every engine when `options.fuel` is set.
            let _ = store.set_fuel(limits.fuel);
        }
        if options.epochs {
            let deadline = Instant::now() + limits.deadline();
            // Every tick the guest yields to the executor, so a spinning guest never holds a
            // worker thread (nor a task that shares it); at its deadline, or when an injected
            // deadline fault fires, it is interrupted.
            store.set_epoch_deadline(1);
            store.epoch_deadline_callback(move |cx| {
                let injected = cx.data().abort == Some(Abort::Injected(InjectedFault::Deadline));
                if injected || Instant::now() >= deadline {
                    Ok(UpdateDeadline::Interrupt)
                } else {
                    Ok(UpdateDeadline::Yield(1))
                }
            });
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
    pub async fn invoke(
        &self,
        qualified: &str,
        args: impl Into<CallArgs<'_>>,
        options: &CallOptions,
        base: State,
    ) -> Invocation {
        let started = Instant::now();
        let args = args.into();
        let (plugin, tool) = match self.resolve(qualified) {
            Ok(found) => found,
            Err(e) => {
                let txn = Txn::new(base, Default::default());
                return Invocation { result: Err(e), txn, fuel_used: 0, elapsed: started.elapsed() };
            }
        };
        let mut limits = self.limits_for(plugin, &options.limits);
        let mut txn = Txn::new(base, limits.write_quota());
        if let Some(deadline) = options.deadline {
            let left = deadline.saturating_duration_since(started);
            if left.is_zero() {
                let result = Err(CallError::DeadlineExceeded { tool: qualified.into(), deadline_ms: 0 });
                return Invocation { result, txn, fuel_used: 0, elapsed: started.elapsed() };
            }
            // Rounded up: the guest is never cut before `deadline`, so a caller that sees
            // the call cut by its deadline also finds `deadline` passed.
            let left_ms = left.as_micros().div_ceil(1000).max(1) as u64;
            limits.deadline_ms = limits.deadline_ms.min(left_ms);
        }
        let mut fuel_used = 0;
        let result = match Self::check(tool, qualified, args.value(), &limits) {
            Err(e) => Err(e),
            Ok(()) if self.native_tools => {
                native::call(plugin, &tool.info.name, args.value(), &options.context, &limits, &mut txn)
            }
            // Boxed: the sandboxed call's future (store, instance, timer) is a few KB, and
            // every async layer above would otherwise hold it inline and copy it when created.
            Ok(()) => {
                Box::pin(self.run_sandboxed(plugin, tool, qualified, args, options, &limits, &mut txn, &mut fuel_used))
                    .await
            }
        };
        Invocation { result, txn, fuel_used, elapsed: started.elapsed() }
    }

    /// What is refused before any code runs: impossible limits, arguments off the schema.
    fn check(tool: &Tool, qualified: &str, args: &Value, limits: &Limits) -> Result<(), CallError> {
        limits.check().map_err(|reason| CallError::InvalidInput {
            tool: qualified.to_string(),
            message: format!("impossible limits: {reason}"),
        })?;
        tool.check_args(qualified, args)
    }

    /// The call in a fresh instance of the plugin's sandbox.
    #[allow(clippy::too_many_arguments)]
    async fn run_sandboxed(
        &self,
        plugin: &Plugin,
        tool: &Tool,
        qualified: &str,
        args: CallArgs<'_>,
        options: &CallOptions,
        limits: &Limits,
        txn: &mut Txn,
        fuel_used: &mut u64,
    ) -> Result<Value, CallError> {
        let host_error = |reason: String| CallError::Host { tool: qualified.to_string(), reason };
        let pre = self.prepared(plugin, limits.stack_kib).map_err(host_error)?;
        let working = std::mem::replace(txn, Txn::new(State::default(), limits.write_quota()));
        let mut state = CallState::new(plugin.grants.clone(), qualified.into(), limits, working, options.seed)
            .map_err(host_error)?;
        state.armed = options.fault;
        state.log_sink = PLUGIN_LOGS.try_with(Arc::clone).ok();
        let mut store = self.new_store(pre.engine(), state, limits);
        let context = bindings::exports::sagabox::plugin::tool::CallContext {
            saga_id: options.context.saga_id.clone(),
            step_id: options.context.step_id.clone(),
            attempt: options.context.attempt,
            idempotency_key: options.context.idempotency_key.clone(),
        };
        let args_text = args.canonical().into_owned();
        let (tool_name, budget) = (tool.info.name.clone(), limits.deadline());
        // The timer catches a guest blocked in a host call (the epoch, one spinning in wasm).
        let guest = async move {
            let run = tokio::time::timeout(budget, async {
                let instance = pre.instantiate_async(&mut store).await?;
                instance.sagabox_plugin_tool().call_call(&mut store, &tool_name, &args_text, &context).await
            })
            .await;
            (run, store)
        };
        let (run, mut store) = if options.parallel {
            match AbortOnDrop(tokio::spawn(guest)).await {
                Ok(done) => done,
                Err(e) => return Err(host_error(format!("the call's task failed: {e}"))),
            }
        } else {
            guest.await
        };
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
        let mut prepared = lock(&plugin.prepared);
        if let Some(pre) = prepared.get(&stack_kib) {
            return Ok(pre.clone());
        }
        let path = PathBuf::from(plugin.origin.to_string());
        let (pre, _) =
            self.link(&plugin.wasm, &plugin.sha256, &plugin.grants, stack_kib, &path).map_err(|e| e.to_string())?;
        prepared.insert(stack_kib, pre.clone());
        Ok(pre)
    }

    /// Runs a call on the state `snapshot` gives and hands its result to `commit`; when the
    /// commit meets a conflict, waits a little and runs the call again on a fresh snapshot,
    /// up to [`MAX_COMMIT_RUNS`] runs, after [`UNGATED_RUNS`] of them in turn with the other
    /// contended calls. A failed call commits nothing.
    pub async fn call_and_commit<T, E>(
        &self,
        qualified: &str,
        args: impl Into<CallArgs<'_>>,
        options: &CallOptions,
        snapshot: impl Fn() -> State,
        mut commit: impl FnMut(&Invocation, &Value) -> CommitAttempt<T, E>,
    ) -> Committed<T, E> {
        let args = args.into();
        let mut runs = 0;
        let mut turn = None;
        loop {
            runs += 1;
            if runs > UNGATED_RUNS && turn.is_none() {
                turn = Some(self.contention.lock().await);
            }
            let invocation = self.invoke(qualified, args, options, snapshot()).await;
            let (fuel_used, elapsed) = (invocation.fuel_used, invocation.elapsed);
            let done = |result| Committed { result, fuel_used, elapsed, runs };
            let output = match &invocation.result {
                Ok(output) => output,
                Err(e) => return done(Err(CallFailure::Call(e.clone()))),
            };
            let conflict = match commit(&invocation, output) {
                CommitAttempt::Committed(value) => {
                    return done(invocation.result.map(|o| (o, value)).map_err(CallFailure::Call));
                }
                CommitAttempt::Failed(e) => return done(Err(CallFailure::Commit(e))),
                CommitAttempt::Conflict(conflict) => conflict,
            };
            if runs >= MAX_COMMIT_RUNS {
                let message =
                    format!("{}/{} kept changing under the call ({runs} runs)", conflict.namespace, conflict.key);
                return done(Err(CallFailure::Call(CallError::Transient { tool: qualified.into(), message })));
            }
            tracing::debug!(tool = qualified, %conflict, "commit conflict; running the call again");
            tokio::time::sleep(conflict_backoff(runs, options.deadline)).await;
        }
    }

    /// Runs a call and commits its writes to `store` (see [`Runtime::call_and_commit`]).
    pub async fn call(&self, qualified: &str, args: &Value, options: &CallOptions, store: &MemoryStore) -> CallOutcome {
        let committed = self
            .call_and_commit(
                qualified,
                args,
                options,
                || store.snapshot(),
                |invocation, _| match store.commit(&invocation.txn) {
                    Ok(changes) => CommitAttempt::Committed(changes),
                    Err(conflict) => CommitAttempt::<_, std::convert::Infallible>::Conflict(conflict),
                },
            )
            .await;
        let (result, changes) = match committed.result {
            Ok((output, changes)) => (Ok(output), changes),
            Err(CallFailure::Call(e)) => (Err(e), Vec::new()),
            Err(CallFailure::Commit(never)) => match never {},
        };
        CallOutcome {
            result,
            changes,
            fuel_used: committed.fuel_used,
            elapsed: committed.elapsed,
            runs: committed.runs,
        }
    }
}

/// How long to wait before running a call again after its `runs`-th commit conflicted:
/// exponential from 1 ms up to 32 ms, with random jitter so that the calls that collided
/// do not collide again; never past `deadline`.
fn conflict_backoff(runs: u32, deadline: Option<Instant>) -> Duration {
    let ceiling = Duration::from_millis(1 << runs.saturating_sub(1).min(5));
    let delay = ceiling.mul_f64(rand::random_range(0.5..1.0));
    deadline.map_or(delay, |d| delay.min(d.saturating_duration_since(Instant::now())))
}

/// A spawned task that is aborted when its handle is dropped (a caller that gives up on a
/// call, e.g. a cancelled request, stops the guest at its next yield).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<T> std::future::Future for AbortOnDrop<T> {
    type Output = Result<T, tokio::task::JoinError>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0).poll(cx)
    }
}

/// The bytes of a bundled plugin.
pub fn bundled_wasm(name: &str) -> Option<&'static [u8]> {
    crate::bundled::BUNDLED.iter().find(|p| p.name == name).map(|p| p.wasm)
}

/// Every `*.wasm` entry of `dir`, sorted: the plugin files, and an error for each entry that
/// is not one (a directory, a FIFO, a device, a dangling symlink, a symlink out of `dir`
/// unless `follow_links_out`), so that nothing is skipped silently.
fn wasm_files(dir: &std::path::Path, follow_links_out: bool) -> std::io::Result<Vec<Result<PathBuf, LoadError>>> {
    let root = std::fs::canonicalize(dir)?;
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "wasm"))
        .collect();
    paths.sort();
    Ok(paths.into_iter().map(|path| plugin_file(path, &root, follow_links_out)).collect())
}

/// `path` when it is a regular file, or a symlink to one inside `root` (anywhere when
/// `follow_links_out`).
fn plugin_file(path: PathBuf, root: &std::path::Path, follow_links_out: bool) -> Result<PathBuf, LoadError> {
    let refuse = |path: PathBuf, reason: String| Err(LoadError::NotAPlugin { path, reason });
    let meta = match std::fs::symlink_metadata(&path) {
        Ok(meta) => meta,
        Err(e) => return refuse(path, format!("cannot inspect it: {e}")),
    };
    if !meta.file_type().is_symlink() {
        return if meta.is_file() { Ok(path) } else { refuse(path, format!("it is {}", file_kind(&meta))) };
    }
    let target = match std::fs::canonicalize(&path) {
        Ok(target) => target,
        Err(e) => return refuse(path, format!("a dangling symlink ({e})")),
    };
    if !follow_links_out && !target.starts_with(root) {
        let reason = format!(
            "a symlink out of the plugin directory, to {} (following such links is off: load cap follow_links_out)",
            target.display()
        );
        return refuse(path, reason);
    }
    match std::fs::metadata(&target) {
        Ok(meta) if meta.is_file() => Ok(path),
        Ok(meta) => refuse(path, format!("a symlink to {}, which is {}", target.display(), file_kind(&meta))),
        Err(e) => refuse(path, format!("a symlink to {}, which cannot be read ({e})", target.display())),
    }
}

/// What a non-regular file is, for messages.
fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let kind = meta.file_type();
        if kind.is_fifo() {
            return "a FIFO, not a regular file";
        }
        if kind.is_char_device() || kind.is_block_device() {
            return "a device, not a regular file";
        }
        if kind.is_socket() {
            return "a socket, not a regular file";
        }
    }
    if meta.is_dir() { "a directory, not a regular file" } else { "not a regular file" }
}

/// The plugins `options` names, read and checked for size; an error for each that is not.
fn sources(options: &RuntimeOptions) -> (Vec<Source>, Vec<LoadError>) {
    let (mut sources, mut errors) = (Vec::new(), Vec::new());
    let bundled = if options.bundled { crate::bundled::BUNDLED } else { &[] };
    for result in bundled.iter().map(Source::bundled) {
        match result {
            Ok(source) => sources.push(source),
            Err(e) => errors.push(e),
        }
    }
    for dir in &options.plugin_dirs {
        match wasm_files(dir, options.load.follow_links_out) {
            Ok(files) => {
                for file in files {
                    match file.and_then(|file| Source::file(&file, &options.load)) {
                        Ok(source) => sources.push(source),
                        Err(e) => errors.push(e),
                    }
                }
            }
            Err(error) => errors.push(LoadError::Directory { path: dir.clone(), error }),
        }
    }
    (sources, errors)
}

/// The first source of each name; an error for every later one.
fn first_of_each_name(sources: Vec<Source>, errors: &mut Vec<LoadError>) -> Vec<Source> {
    let mut seen: std::collections::HashMap<String, PathBuf> = std::collections::HashMap::new();
    let mut kept = Vec::with_capacity(sources.len());
    for source in sources {
        if let Some(first) = seen.get(&source.name) {
            let (name, first, second) = (source.name.clone(), first.clone(), source.path());
            errors.push(LoadError::DuplicateName { name, first, second });
            continue;
        }
        seen.insert(source.name.clone(), source.path());
        kept.push(source);
    }
    kept
}

/// Plugins loading at once: enough to keep the cores busy, few enough to bound the memory
/// of compilations in flight.
fn load_parallelism() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 8)
}

/// A plugin's limits cut to the load budget for its `manifest` call.
fn manifest_limits(limits: &Limits, caps: &LoadCaps) -> Limits {
    let mut cut = limits.clone();
    cut.fuel = cut.fuel.min(caps.manifest_fuel);
    cut.deadline_ms = cut.deadline_ms.min(caps.manifest_deadline_ms).max(1);
    cut
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflict_retries_back_off_at_random_up_to_32_ms_and_never_past_the_deadline() {
        for runs in 1..=MAX_COMMIT_RUNS {
            let ceiling = Duration::from_millis(1 << (runs - 1).min(5));
            let waits: Vec<Duration> = (0..64).map(|_| conflict_backoff(runs, None)).collect();
            assert!(waits.iter().all(|w| *w >= ceiling / 2 && *w <= ceiling), "{runs}: {waits:?}");
            // Jittered: calls that collided do not all come back at the same instant.
            assert!(waits.iter().any(|w| *w != waits[0]), "{runs}: {waits:?}");
        }
        let soon = Instant::now() + Duration::from_micros(100);
        assert!(conflict_backoff(MAX_COMMIT_RUNS, Some(soon)) <= Duration::from_micros(100));
        assert_eq!(conflict_backoff(3, Some(Instant::now())), Duration::ZERO);
    }

    /// Every async layer above `invoke` (the saga engine's attempt, step and run) holds its
    /// future inline and copies it when created: the sandboxed call, a few KB, is boxed.
    #[tokio::test]
    async fn the_future_of_a_call_is_small() {
        let options = RuntimeOptions { bundled: false, cache_dir: None, ..RuntimeOptions::default() };
        let runtime = Runtime::load(options).await.unwrap();
        let (args, call_options) = (Value::Null, CallOptions::default());
        let call = runtime.invoke("none.tool", &args, &call_options, State::default());
        assert!(std::mem::size_of_val(&call) <= 1024, "invoke's future: {} bytes", std::mem::size_of_val(&call));
    }

    /// A sandboxed call hands the guest the canonical text its caller brought (the saga
    /// engine prints a step's arguments once, for the key and every attempt), not its value
    /// printed again. The two differ here only so that the guest's echo tells which it read.
    #[tokio::test]
    async fn a_sandboxed_call_hands_the_guest_the_text_its_caller_brought() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("hostile.wasm"), bundled_wasm("hostile").unwrap()).unwrap();
        let options = RuntimeOptions {
            bundled: false,
            plugin_dirs: vec![dir.path().into()],
            cache_dir: None,
            ..Default::default()
        };
        let runtime = Runtime::load(options).await.unwrap();
        let value = serde_json::json!({ "from": "value" });
        let args = CallArgs::with_canonical(&value, r#"{"from":"text"}"#);
        let call = runtime.invoke("hostile.echo", args, &CallOptions::default(), State::default()).await;
        assert_eq!(call.result.unwrap(), serde_json::json!({ "from": "text" }));
        // A caller without the text gets the value printed.
        let call = runtime.invoke("hostile.echo", &value, &CallOptions::default(), State::default()).await;
        assert_eq!(call.result.unwrap(), value);
    }

    /// The initial pages of the largest memory that `wasm` (a component) declares.
    fn initial_pages(wasm: &[u8]) -> u64 {
        let mut largest = 0;
        for payload in wasmparser::Parser::new(0).parse_all(wasm) {
            if let Ok(wasmparser::Payload::MemorySection(memories)) = payload {
                for memory in memories.into_iter().flatten() {
                    largest = largest.max(memory.initial);
                }
            }
        }
        largest
    }

    /// guest-tools/.cargo/config.toml links the bundled plugins with 2 MiB of initial memory,
    /// so that their calls rarely grow it; the build applies it only when it runs cargo from
    /// guest-tools/ (host/build.rs).
    #[test]
    fn bundled_plugins_start_with_two_mib_of_linear_memory() {
        for plugin in crate::bundled::BUNDLED {
            assert_eq!(initial_pages(plugin.wasm), 32, "{}: initial pages of its memory", plugin.name);
        }
    }

    /// The bytes of the data segments of `wasm` (a component), all its core modules together.
    fn data_bytes(wasm: &[u8]) -> usize {
        let mut total = 0;
        for payload in wasmparser::Parser::new(0).parse_all(wasm) {
            if let Ok(wasmparser::Payload::DataSection(segments)) = payload {
                total += segments.into_iter().flatten().map(|segment| segment.data.len()).sum::<usize>();
            }
        }
        total
    }

    /// Every live instance maps its plugin's data segments (the memory image), and the kernel
    /// maps all of it on the first read: 4 KiB of resident memory per page per instance.
    /// guest-tools/Cargo.toml builds serde_json's float printer (zmij) at opt-level "s", which
    /// computes the powers of ten its 17 KB table held (BENCHMARKS item 43). Three plugins
    /// carry more because their semantics need it: Unicode case mapping (`to_lowercase`, as
    /// Python's `str.lower`; 11.7 KB) in rental and tau2's retail, float parsing and fixed
    /// precision printing (rounding to cents as tau2 does; 11.7 KB) in tau2's two domains.
    #[test]
    fn bundled_plugins_data_fits_in_seven_pages_or_fourteen_with_unicode_or_float_tables() {
        let page = 4096;
        for plugin in crate::bundled::BUNDLED {
            let bytes = data_bytes(plugin.wasm);
            let pages = if ["rental", "taubench_airline", "taubench_retail"].contains(&plugin.name) { 14 } else { 7 };
            assert!(bytes > 0, "{}: no data segments read", plugin.name);
            assert!(bytes <= pages * page, "{}: {bytes} bytes of data segments, more than {pages} pages", plugin.name);
        }
    }

    /// The names of the functions that `wasm` (a component) defines, from its core modules'
    /// name sections.
    fn function_names(wasm: &[u8]) -> Vec<String> {
        let mut names = Vec::new();
        for payload in wasmparser::Parser::new(0).parse_all(wasm) {
            let Ok(wasmparser::Payload::CustomSection(section)) = payload else { continue };
            let wasmparser::KnownCustom::Name(reader) = section.as_known() else { continue };
            for name in reader.into_iter().flatten() {
                if let wasmparser::Name::Function(map) = name {
                    names.extend(map.into_iter().flatten().map(|naming| naming.name.to_string()));
                }
            }
        }
        names
    }

    /// `export_plugin!` makes the toolkit's heap for one call the bundled plugins' allocator
    /// (`guest-tools/toolkit/src/call_heap.rs`; BENCHMARKS item 18).
    #[test]
    fn bundled_plugins_allocate_with_the_heap_for_one_call() {
        for plugin in crate::bundled::BUNDLED {
            let names = function_names(plugin.wasm);
            assert!(names.iter().any(|n| n.contains("cabi_realloc")), "{}: no function names to read", plugin.name);
            assert!(
                names.iter().any(|n| n.contains("call_heap") && n.contains("alloc")),
                "{}: does not allocate with call_heap::Heap",
                plugin.name
            );
        }
    }
}
