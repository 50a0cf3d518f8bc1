//! `sagabox bench`: benchmarks that print numbers, never pass or fail.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;
use serde_json::{Value, json};

use std::sync::Arc;

use sagabox::backend::MemoryBackend;
use sagabox::runtime::{CallContext, CallOptions, EngineOptions, Runtime, RuntimeOptions};
use sagabox::saga::{self, RunOptions, Saga, Status};
use sagabox::store::generate::{self, Scale};
use sagabox::store::{MemoryStore, State};
use sagabox::verify::{self, CampaignOptions, Subject};

/// One measured quantity.
#[derive(Clone, Debug, Serialize)]
pub struct Measurement {
    pub name: String,
    /// Median, in microseconds.
    pub median_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub samples: usize,
}

impl Measurement {
    pub fn from_samples(name: impl Into<String>, mut samples: Vec<Duration>) -> Measurement {
        samples.sort();
        let at = |q: f64| {
            let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
            samples.get(i).map_or(0.0, |d| d.as_secs_f64() * 1e6)
        };
        Measurement { name: name.into(), median_us: at(0.5), p90_us: at(0.9), p99_us: at(0.99), samples: samples.len() }
    }
}

/// Time to load one plugin with an empty compile cache, and again from the cache.
pub async fn plugin_load(wasm: &[u8], rounds: usize) -> anyhow::Result<Vec<Measurement>> {
    let mut compiled = Vec::new();
    let mut cached = Vec::new();
    for _ in 0..rounds {
        let dir = tempfile_dir()?;
        std::fs::write(dir.join("airline.wasm"), wasm)?;
        let options = RuntimeOptions {
            bundled: false,
            plugin_dirs: vec![dir.clone()],
            cache_dir: Some(dir.join("cache")),
            ..RuntimeOptions::default()
        };
        for samples in [&mut compiled, &mut cached] {
            let started = Instant::now();
            Runtime::load(options.clone()).await?;
            samples.push(started.elapsed());
        }
        std::fs::remove_dir_all(&dir)?;
    }
    Ok(vec![
        Measurement::from_samples("load airline.wasm, compiling (cold cache)", compiled),
        Measurement::from_samples("load airline.wasm from the compile cache", cached),
    ])
}

fn tempfile_dir() -> std::io::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("sagabox-bench-{}", sagabox::ids::new_run_id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// The store the per-call benchmark allocates from: a pool too large to fill.
fn pool_state() -> State {
    State::from_json(&json!({ "pools": { "bench": { "capacity": u64::MAX / 4, "allocated": 0 } } }))
        .expect("a valid fixture")
}

/// Median cost of one `resources.allocate` call (fresh instance, call, store commit) under
/// each engine configuration.
pub async fn per_call(calls: usize, cache_dir: Option<&Path>) -> anyhow::Result<Vec<Measurement>> {
    let configurations = [
        ("pooling, fuel, epochs (default)", EngineOptions::default(), false),
        ("on-demand allocator", EngineOptions { pooling: false, ..EngineOptions::default() }, false),
        ("fuel off", EngineOptions { fuel: false, ..EngineOptions::default() }, false),
        ("epochs off", EngineOptions { epochs: false, ..EngineOptions::default() }, false),
        ("native, no sandbox", EngineOptions::default(), true),
    ];
    // All configurations are loaded first and measured in alternating rounds, so that the
    // machine's drifts (frequency, neighbours) spread evenly over them.
    let mut runtimes = Vec::new();
    for (label, engine, native_tools) in configurations {
        let options = RuntimeOptions {
            engine,
            native_tools,
            cache_dir: cache_dir.map(Path::to_path_buf),
            ..RuntimeOptions::default()
        };
        let runtime = Runtime::load(options).await?;
        let name = if native_tools {
            format!("call + commit: {label}")
        } else {
            format!("fresh instance + call + commit: {label}")
        };
        runtimes.push((name, runtime, MemoryStore::new(pool_state()), Vec::with_capacity(calls)));
    }
    let args = json!({ "pool_id": "bench", "amount": 1 });
    let rounds = 10;
    let mut key = 0u64;
    for round in 0..=rounds {
        for (_, runtime, store, samples) in runtimes.iter_mut() {
            for _ in 0..calls.div_ceil(rounds) {
                key += 1;
                let options = CallOptions {
                    context: CallContext {
                        saga_id: "bench".into(),
                        step_id: "allocate".into(),
                        attempt: 1,
                        idempotency_key: format!("{key:064x}"),
                    },
                    ..CallOptions::default()
                };
                let started = Instant::now();
                let outcome = runtime.call("resources.allocate", &args, &options, store).await;
                let elapsed = started.elapsed();
                outcome.result.map_err(|e| anyhow::anyhow!("benchmark call failed: {e}"))?;
                if round > 0 {
                    samples.push(elapsed); // round 0 warms up
                }
            }
        }
    }
    Ok(runtimes.into_iter().map(|(name, _, _, samples)| Measurement::from_samples(name, samples)).collect())
}

/// The sandboxed call alone that `bench --only serve` makes over MCP: `hostile.echo {"x":1}`.
async fn echo_in_process(runtime: &Runtime, calls: usize) -> anyhow::Result<Measurement> {
    let store = MemoryStore::new(State::default());
    let args = json!({ "x": 1 });
    let mut samples = Vec::with_capacity(calls);
    for i in 0..calls + calls / 10 {
        let options = CallOptions {
            context: CallContext { idempotency_key: format!("{i:064x}"), ..CallContext::default() },
            ..CallOptions::default()
        };
        let started = Instant::now();
        let outcome = runtime.call("hostile.echo", &args, &options, &store).await;
        let elapsed = started.elapsed();
        outcome.result.map_err(|e| anyhow::anyhow!("benchmark call failed: {e}"))?;
        if i >= calls / 10 {
            samples.push(elapsed);
        }
    }
    Ok(Measurement::from_samples("the same call in process: fresh instance + call + commit (hostile.echo)", samples))
}

/// Sagas per second, each on a fresh copy of its fixture, `concurrency` in flight at once.
pub struct Throughput {
    pub name: String,
    pub per_second: f64,
    pub latency: Measurement,
}

pub async fn saga_throughput(
    runtime: Arc<Runtime>,
    saga: Arc<Saga>,
    state: State,
    input: serde_json::Value,
    sagas: usize,
    concurrency: usize,
    expect: Status,
) -> anyhow::Result<Throughput> {
    let per_task = sagas.div_ceil(concurrency);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..concurrency {
        let (runtime, saga, state, input) = (runtime.clone(), saga.clone(), state.clone(), input.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(per_task);
            for i in 0..per_task {
                let backend = MemoryBackend::new(state.clone());
                let options = RunOptions::new(format!("bench-{t}-{i}"), input.clone());
                let begun = Instant::now();
                let report = saga::run(&runtime, &saga, &backend, options).await;
                latencies.push(begun.elapsed());
                if report.status != expect {
                    anyhow::bail!("saga ended {:?}, not {expect:?}: {:?}", report.status, report.error);
                }
            }
            Ok(latencies)
        }));
    }
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await??);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let count = latencies.len();
    let name = format!("{} x{count}, {concurrency} in flight", saga.name);
    Ok(Throughput {
        per_second: count as f64 / elapsed,
        latency: Measurement::from_samples(format!("{name}: latency"), latencies),
        name,
    })
}

/// Loads a shipped saga with its fixture and input.
pub fn shipped_saga(runtime: &Runtime, dir: &Path, name: &str) -> anyhow::Result<(Saga, State, serde_json::Value)> {
    let saga = Saga::load(&dir.join(format!("{name}.json")), runtime)?;
    let state = match &saga.companions.fixture {
        Some(path) => sagabox::store::fixture::load(path)?,
        None => State::default(),
    };
    let input = match &saga.companions.input {
        Some(path) => serde_json::from_str(&std::fs::read_to_string(path)?)?,
        None => json!({}),
    };
    Ok((saga, state, input))
}

/// `fixture` with room for every run at once: a million seats on each flight and rooms in each
/// hotel. Runs sharing one store (a server's sessions, a durable queue) each hold a seat and a
/// room until they roll back; with the fixture's few, most would be refused at their first
/// step, and a benchmark would time one-call runs instead of CT1.
pub fn roomy(fixture: &Value) -> Value {
    match fixture {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let v = match (k.as_str(), v) {
                        ("rooms_available", Value::Number(_)) => json!(1_000_000),
                        ("available_seats", Value::Object(seats)) => {
                            Value::Object(seats.keys().map(|c| (c.clone(), json!(1_000_000))).collect())
                        }
                        _ => roomy(v),
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(roomy).collect()),
        other => other.clone(),
    }
}

#[derive(clap::Args)]
pub struct Args {
    /// Calls per configuration.
    #[arg(long, default_value_t = 5000)]
    calls: usize,
    /// Sagas per throughput measurement.
    #[arg(long, default_value_t = 20000)]
    sagas: usize,
    /// Where the shipped sagas are.
    #[arg(long, default_value = "sagas")]
    sagas_dir: std::path::PathBuf,
    /// Generated store sizes for the snapshot benchmark, in MB.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100")]
    sizes_mb: Vec<f64>,
    /// Random schedules in the verification benchmark's campaign.
    #[arg(long, default_value_t = 1000)]
    campaign_runs: usize,
    /// Steps of the long saga the scale benchmark validates, runs and rolls back.
    #[arg(long, default_value_t = 10_000)]
    scale_steps: usize,
    /// langchain-compensation CT1 runs through its middleware (the agent loop runs an eighth).
    #[arg(long, default_value_t = 2000)]
    peer_sagas: usize,
    /// Benchmark groups to run: runtime, sagas, cli, memory, verify, durable, snapshot, scale, serve
    /// [default: all of these], and peers (only when named: it sets up a Python venv from PyPI).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// A PostgreSQL server for the durable group's PostgreSQL rows (each measurement in a
    /// schema of its own, dropped after).
    #[arg(long, value_name = "URL", env = "SAGABOX_PG_URL")]
    pg_url: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(plugin_args: &super::PluginArgs, args: Args) -> anyhow::Result<super::Outcome> {
    let wants = |group: &str| args.only.is_empty() || args.only.iter().any(|g| g == group);
    let cache = plugin_args.options().cache_dir;
    let runtime = Arc::new(plugin_args.load().await?);
    // Interrupted, it still removes the databases it made (the durable group's).
    tokio::spawn(async {
        super::serve::shutdown_signal().await;
        eprintln!("interrupted: removing the benchmark's databases");
        let _ = tokio::task::spawn_blocking(super::bench_durable::remove_leftovers).await;
        std::process::exit(130);
    });
    if sagabox::runtime::swap_is_on() {
        eprintln!(
            "note: this process can swap, so pooled slots are reset without PAGEMAP_SCAN: calls are slower \
             than where it cannot (README, The sandbox)"
        );
    }
    let mut results = Vec::new();
    let mut rates: Vec<(String, f64)> = Vec::new();
    let mut peers = Vec::new();
    // First: its peak is the process's, and what another group leaves resident (the runtime
    // group's engines, the allocator's kept pages) would count in it (162 against 140 MiB).
    if wants("memory") {
        results.extend(memory(runtime.clone(), &args.sagas_dir).await?);
    }
    if wants("runtime") {
        let airline = sagabox::runtime::bundled_wasm("airline").ok_or_else(|| anyhow::anyhow!("no bundled airline"))?;
        results.extend(plugin_load(airline, 5).await?);
        results.extend(per_call(args.calls, cache.as_deref()).await?);
    }
    if wants("sagas") {
        let native = Arc::new(Runtime::load(RuntimeOptions { native_tools: true, ..plugin_args.options() }).await?);
        for (name, expect) in [("ct1-payment-failure", Status::Failed), ("travel", Status::Completed)] {
            let (saga, state, input) = shipped_saga(&runtime, &args.sagas_dir, name)?;
            let saga = Arc::new(saga);
            for (mode, rt) in [("sandboxed", &runtime), ("native", &native)] {
                for concurrency in [1, 2, 64] {
                    let t = saga_throughput(
                        rt.clone(),
                        saga.clone(),
                        state.clone(),
                        input.clone(),
                        args.sagas,
                        concurrency,
                        expect,
                    )
                    .await?;
                    rates.push((format!("sagas/s, {mode}: {}", t.name), t.per_second));
                    if concurrency == 1 {
                        let mut latency = t.latency;
                        latency.name = format!("{mode}: {}", latency.name);
                        results.push(latency);
                    }
                }
            }
        }
    }
    if wants("cli") {
        results.extend(cli_startup(&args.sagas_dir)?);
    }
    if wants("verify") {
        let (saga, state, input) = shipped_saga(&runtime, &args.sagas_dir, "ct1-payment-failure")?;
        let saga = Arc::new(saga);
        let fixture = state.to_json();
        let big = generate::overlay(generate::generate(0, &Scale::of(units_for_mb(10.0))), &fixture);
        let big = State::from_json(&big).map_err(anyhow::Error::msg)?;
        for (label, initial) in [("default fixture", state), ("10 MB generated store", big)] {
            let subject = Subject { saga: saga.clone(), initial, input: input.clone(), expected: None };
            let options = CampaignOptions { runs: args.campaign_runs, ..CampaignOptions::default() };
            let (report, timing) = verify::run_campaign(runtime.clone(), &[subject], &options, &|_, _| {}).await;
            if !report.passed() {
                anyhow::bail!("the benchmark campaign failed {} cases", report.totals.failed);
            }
            rates.push((
                format!("verification cases/s: ct1-payment-failure, {label} ({} cases)", timing.cases),
                timing.cases_per_second,
            ));
        }
    }
    if wants("durable") {
        let durable = super::bench_durable::run(&runtime, &args.sagas_dir, args.sagas, args.pg_url.as_deref()).await?;
        results.extend(durable.latencies);
        rates.extend(durable.rates);
    }
    if wants("snapshot") {
        for mb in &args.sizes_mb {
            results.extend(snapshot_costs(*mb)?);
        }
    }
    if wants("scale") {
        results.extend(long_saga(&runtime, args.scale_steps).await?);
    }
    if wants("serve") {
        results.push(echo_in_process(&runtime, args.calls).await?);
        let fixture_path = args.sagas_dir.join("ct1-payment-failure.fixture.json");
        let calls = args.calls;
        results.extend(
            tokio::task::spawn_blocking(move || super::serve_bench::stdio_round_trips(&fixture_path, calls)).await??,
        );
        let read = |name: &str| -> anyhow::Result<serde_json::Value> {
            let path = args.sagas_dir.join(name);
            Ok(serde_json::from_str(
                &std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?,
            )?)
        };
        let (fixture, input) = (read("ct1-payment-failure.fixture.json")?, read("ct1-payment-failure.input.json")?);
        for clients in [4, 16, 64] {
            let (fixture, input) = (fixture.clone(), input.clone());
            let sessions = (args.sagas * 2).max(clients * 10);
            let (rate, latency) = tokio::task::spawn_blocking(move || {
                super::serve_bench::http_sessions(&fixture, &input, sessions, clients)
            })
            .await??;
            rates.push((
                format!(
                    "rolled-back MCP sessions/s over HTTP (saga_begin, 2 bookings, declined charge), {clients} clients"
                ),
                rate,
            ));
            results.push(latency);
        }
    }
    if args.only.iter().any(|g| g == "peers") {
        let sagas_dir = std::path::absolute(&args.sagas_dir)?;
        let (saga, state, input) = shipped_saga(&runtime, &sagas_dir, "ct1-payment-failure")?;
        let ct1 = SagaboxCt1 { runtime: runtime.clone(), saga: Arc::new(saga), state, input, sagas: args.sagas };
        let venv_dir = cache.clone().unwrap_or_else(|| std::env::temp_dir().join("sagabox")).join(PEER_VENV);
        peers = compare_langchain_compensation(&ct1, &venv_dir, &sagas_dir, args.peer_sagas).await?;
    }
    if args.json {
        let rates: Vec<_> = rates.iter().map(|(name, rate)| json!({ "name": name, "per_second": rate })).collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({ "measurements": results, "rates": rates, "peers": peers }))?
        );
    } else {
        print_table(
            &["benchmark", "median", "p90", "p99", "samples"],
            results.iter().map(|m| {
                vec![
                    m.name.clone(),
                    format_us(m.median_us),
                    format_us(m.p90_us),
                    format_us(m.p99_us),
                    m.samples.to_string(),
                ]
            }),
        );
        print_table(
            &["throughput", "per second"],
            rates.iter().map(|(name, rate)| vec![name.clone(), format!("{rate:.0}")]),
        );
        print_table(
            &["CT1 rolled back, one run: sagabox | langchain-compensation 0.5.8", "sagabox", "peer", "sagabox / peer"],
            peers.iter().map(|p| {
                vec![p.name.clone(), format!("{:.0}", p.sagabox), format!("{:.1}", p.peer), format!("{:.1}×", p.ratio)]
            }),
        );
    }
    Ok(super::Outcome::Success)
}

/// Prints a table of `rows` under `header`, unless there are no rows (a group not run).
fn print_table(header: &[&str], rows: impl Iterator<Item = Vec<String>>) {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::UTF8_BORDERS_ONLY).set_header(header);
    for row in rows {
        table.add_row(row);
    }
    if table.row_count() > 0 {
        println!("{table}");
    }
}

/// A saga of `steps` chained one-unit allocations: validated, run to completion, and run
/// against a pool one unit short, so that its last step fails and every other is undone.
async fn long_saga(runtime: &Runtime, steps: usize) -> anyhow::Result<Vec<Measurement>> {
    let chain: Vec<serde_json::Value> = (0..steps)
        .map(|i| {
            json!({ "id": format!("s{i}"), "action": { "name": "resources.allocate",
                         "arguments": { "pool_id": "p", "amount": 1 } } })
        })
        .collect();
    let text = json!({ "saga": { "steps": chain } }).to_string();
    let path = Path::new("long.json");
    let pool =
        |capacity: usize| State::from_json(&json!({ "pools": { "p": { "capacity": capacity, "allocated": 0 } } }));
    let (mut validate, mut forward, mut rollback) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..3 {
        let started = Instant::now();
        let saga = Saga::from_text(&text, path, runtime)?;
        validate.push(started.elapsed());
        for (capacity, expect, samples) in
            [(steps, Status::Completed, &mut forward), (steps - 1, Status::Failed, &mut rollback)]
        {
            let backend = MemoryBackend::new(pool(capacity).map_err(anyhow::Error::msg)?);
            let mut options = RunOptions::new(format!("long-{round}"), json!({}));
            options.deterministic = true;
            let started = Instant::now();
            let report = saga::run(runtime, &saga, &backend, options).await;
            samples.push(started.elapsed());
            if report.status != expect {
                anyhow::bail!("the {steps}-step saga ended {:?}: {:?}", report.status, report.error);
            }
        }
    }
    Ok(vec![
        Measurement::from_samples(format!("{steps}-step saga: validate"), validate),
        Measurement::from_samples(format!("{steps}-step saga: run, all complete"), forward),
        Measurement::from_samples(format!("{steps}-step saga: run, last fails, {} undone", steps - 1), rollback),
    ])
}

/// `sagabox run sagas/ct1-payment-failure.json` as a whole process, with a warm compile cache
/// and with a cold one.
fn cli_startup(sagas: &Path) -> anyhow::Result<Vec<Measurement>> {
    let exe = std::env::current_exe()?;
    let saga = sagas.join("ct1-payment-failure.json");
    let cache = tempfile_dir()?;
    let run = |cache: &Path| -> anyhow::Result<Duration> {
        let started = Instant::now();
        let out = std::process::Command::new(&exe)
            .arg("run")
            .arg(&saga)
            .env("SAGABOX_CACHE_DIR", cache)
            .stdout(std::process::Stdio::null())
            .output()?;
        if out.status.code() != Some(1) {
            anyhow::bail!("ct1 should fail (exit 1): {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(started.elapsed())
    };
    let mut cold = Vec::new();
    let mut warm = Vec::new();
    for _ in 0..5 {
        let _ = std::fs::remove_dir_all(&cache);
        cold.push(run(&cache)?);
    }
    for _ in 0..20 {
        warm.push(run(&cache)?);
    }
    std::fs::remove_dir_all(&cache)?;
    Ok(vec![
        Measurement::from_samples("CLI `run ct1-payment-failure`, whole process, cold compile cache", cold),
        Measurement::from_samples("CLI `run ct1-payment-failure`, whole process, warm compile cache", warm),
    ])
}

/// The `kB` field `name` (e.g. `VmHWM:`) of the /proc file `file`, in bytes; 0 where /proc
/// is missing.
fn proc_kb(file: &str, name: &str) -> u64 {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    let line = text.lines().find(|l| l.starts_with(name));
    line.and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()).map_or(0, |kb| kb * 1024)
}

/// This process's peak resident set size, in bytes (Linux).
fn peak_rss() -> u64 {
    proc_kb("/proc/self/status", "VmHWM:")
}

/// This process's resident memory now: RSS, PSS (shared pages divided among their users)
/// and the shared part of RSS (plugins' memory images mapped into every instance count once
/// per instance in RSS), in bytes.
fn memory_now() -> (u64, u64, u64) {
    let field = |name: &str| proc_kb("/proc/self/smaps_rollup", name);
    (field("Rss:"), field("Pss:"), field("Shared_Clean:") + field("Shared_Dirty:"))
}

/// Peak RSS with 1,000 CT1 sagas in flight at once, each holding a sandbox open: every saga
/// first runs a step that blocks for a second, so all 1,000 instances are alive together.
async fn memory(runtime: Arc<Runtime>, sagas: &Path) -> anyhow::Result<Vec<Measurement>> {
    let (ct1, state, input) = shipped_saga(&runtime, sagas, "ct1-payment-failure")?;
    let mut definition: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&ct1.path)?)?;
    let wait = json!({
        "id": "wait", "action": { "name": "hostile.sleep", "arguments": { "seconds": 1 } },
        "limits": { "deadline_ms": 10000 }
    });
    if let Some(steps) = definition.pointer_mut("/saga/steps").and_then(|s| s.as_array_mut()) {
        steps.insert(0, wait);
    }
    let dir = tempfile_dir()?;
    let path = dir.join("ct1-wait.json");
    std::fs::write(&path, definition.to_string())?;
    let saga = Arc::new(Saga::load(&path, &runtime)?);
    let before = peak_rss();
    let started = Instant::now();
    // Read while every saga sleeps in its sandbox (they all started within the first
    // few hundred ms, and each sleeps a second).
    let sampled = tokio::spawn(async {
        tokio::time::sleep(std::time::Duration::from_millis(800)).await;
        memory_now()
    });
    let mut tasks = Vec::new();
    for i in 0..1000 {
        let (runtime, saga, state, input) = (runtime.clone(), saga.clone(), state.clone(), input.clone());
        tasks.push(tokio::spawn(async move {
            let backend = MemoryBackend::new(state);
            saga::run(&runtime, &saga, &backend, RunOptions::new(format!("m{i}"), input)).await.status
        }));
    }
    for task in tasks {
        let status = task.await?;
        if status != Status::Failed {
            anyhow::bail!("a memory-benchmark saga ended {status:?}");
        }
    }
    let elapsed = started.elapsed();
    let after = peak_rss();
    let (rss, pss, shared) = sampled.await?;
    std::fs::remove_dir_all(&dir)?;
    let mb = |b: u64| b as f64 / (1 << 20) as f64;
    Ok(vec![Measurement {
        name: format!(
            "1,000 concurrent CT1 sagas with a live sandbox each: peak RSS {:.0} MiB (was {:.0} MiB before; \
             with all alive: RSS {:.0}, PSS {:.0}, of which shared {:.0} MiB), done in",
            mb(after),
            mb(before),
            mb(rss),
            mb(pss),
            mb(shared)
        ),
        median_us: elapsed.as_secs_f64() * 1e6,
        p90_us: elapsed.as_secs_f64() * 1e6,
        p99_us: elapsed.as_secs_f64() * 1e6,
        samples: 1,
    }])
}

/// Generator units for a store of about `mb` MB.
fn units_for_mb(mb: f64) -> usize {
    let unit = sagabox::json::canonical(&generate::generate(0, &Scale::of(1))).len() as f64;
    ((mb * 1e6 / unit).round() as usize).max(1)
}

/// What snapshots cost on a generated store of about `mb` MB.
fn snapshot_costs(mb: f64) -> anyhow::Result<Vec<Measurement>> {
    let value = generate::generate(0, &Scale::of(units_for_mb(mb)));
    let label = |what: &str, state: &State| format!("{what}, {:.0} MB store ({} docs)", mb, state.doc_count());
    let started = Instant::now();
    let state = State::from_json(&value).map_err(anyhow::Error::msg)?;
    let load = started.elapsed();
    drop(value);
    let started = Instant::now();
    let cold = state.digest();
    let first_digest = started.elapsed();

    let rounds = 20;
    let (mut snapshots, mut after_case, mut canonical) = (Vec::new(), Vec::new(), Vec::new());
    let store = MemoryStore::new(state.clone());
    for i in 0..rounds {
        let started = Instant::now();
        let snapshot = store.snapshot();
        snapshots.push(started.elapsed());
        // A case changes a few documents; its digest recomputes only their namespaces.
        let mut txn = sagabox::store::Txn::new(snapshot, sagabox::store::WriteQuota::default());
        txn.put("flights", "HAT0000", &format!("{{\"touched\":{i}}}")).map_err(anyhow::Error::msg)?;
        txn.put("orders", "#W3000000", &format!("{{\"touched\":{i}}}")).map_err(anyhow::Error::msg)?;
        store.commit(&txn)?;
        let started = Instant::now();
        let digest = store.snapshot().digest();
        after_case.push(started.elapsed());
        assert_ne!(digest, cold);
        if i < 5 {
            let started = Instant::now();
            let text = store.snapshot().to_canonical_json();
            let _ = sagabox::json::sha256_hex(text.as_bytes());
            canonical.push(started.elapsed());
        }
    }
    Ok(vec![
        Measurement::from_samples(label("load fixture (canonicalize + hash every doc)", &state), vec![load]),
        Measurement::from_samples(label("first full digest", &state), vec![first_digest]),
        Measurement::from_samples(label("snapshot (persistent clone)", &state), snapshots),
        Measurement::from_samples(label("snapshot + digest after a case", &state), after_case),
        Measurement::from_samples(label("canonical JSON + SHA-256 of the whole store", &state), canonical),
    ])
}

fn format_us(us: f64) -> String {
    if us >= 10_000.0 { format!("{:.1} ms", us / 1000.0) } else { format!("{us:.1} µs") }
}

/// The langchain-compensation peer (host/peer-bench/langchain_compensation/), carried in the
/// binary so that `bench --only peers` runs from anywhere.
const PEER_SCRIPT: &str = include_str!("../../peer-bench/langchain_compensation/ct1.py");
const PEER_LOCK: &str = include_str!("../../peer-bench/langchain_compensation/requirements.lock");
const PEER_VENV: &str = "py-venv-langchain-compensation";

/// sagabox's side of a peer comparison: CT1, sandboxed, on fresh copies of its fixture.
struct SagaboxCt1 {
    runtime: Arc<Runtime>,
    saga: Arc<Saga>,
    state: State,
    input: serde_json::Value,
    sagas: usize,
}

impl SagaboxCt1 {
    /// (sagas per second, sagas per CPU-second of this process) with `concurrency` in flight.
    async fn measure(&self, concurrency: usize) -> anyhow::Result<(f64, f64)> {
        let cpu = cpu_seconds();
        let t = saga_throughput(
            self.runtime.clone(),
            self.saga.clone(),
            self.state.clone(),
            self.input.clone(),
            self.sagas,
            concurrency,
            Status::Failed,
        )
        .await?;
        let count = self.sagas.div_ceil(concurrency) * concurrency;
        Ok((t.per_second, count as f64 / (cpu_seconds() - cpu)))
    }
}

/// One line of a peer comparison: the same quantity for sagabox and for the peer.
#[derive(Debug, Serialize)]
pub struct PeerRow {
    pub name: String,
    pub sagabox: f64,
    pub peer: f64,
    pub ratio: f64,
}

fn peer_row(name: String, sagabox: f64, peer: f64) -> PeerRow {
    PeerRow { name, sagabox, peer, ratio: sagabox / peer }
}

/// CPU time (user + system) this process has used, all threads, in seconds.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage(2) fills the zeroed struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// CT1 rolled back by sagabox (sandboxed) and by langchain-compensation 0.5.8 in one run: wall
/// clock rates and rates per CPU-second (the Python side runs on one core, under the GIL).
async fn compare_langchain_compensation(
    ct1: &SagaboxCt1,
    venv_dir: &Path,
    sagas_dir: &Path,
    peer_sagas: usize,
) -> anyhow::Result<Vec<PeerRow>> {
    let dir = venv_dir.to_path_buf();
    let python = tokio::task::spawn_blocking(move || peer_venv(&dir, PEER_LOCK)).await??;
    let script = venv_dir.join("ct1.py");
    std::fs::write(&script, PEER_SCRIPT).with_context(|| format!("cannot write {}", script.display()))?;
    let run_peer = |mode: &'static str, sagas: usize| {
        let (python, script, sagas_dir) = (python.clone(), script.clone(), sagas_dir.to_path_buf());
        tokio::task::spawn_blocking(move || run_peer_script(&python, &script, &sagas_dir, mode, sagas))
    };
    let (ours, ours_cpu) = ct1.measure(1).await?;
    let middleware = run_peer("middleware", peer_sagas).await??;
    let agent = run_peer("agent", (peer_sagas / 8).max(50)).await??;
    let (ours64, ours64_cpu) = ct1.measure(64).await?;
    let middleware_path = "peer: CompensationMiddleware.wrap_tool_call + @tools";
    let agent_path = "peer: create_comp_agent, scripted model";
    Ok(vec![
        peer_row(format!("sagas/s: sandboxed, 1 in flight | {middleware_path}"), ours, middleware.0),
        peer_row(format!("sagas per CPU-second: sandboxed, 1 in flight | {middleware_path}"), ours_cpu, middleware.1),
        peer_row(
            format!("sagas per CPU-second: sandboxed, 64 in flight | {middleware_path}"),
            ours64_cpu,
            middleware.1,
        ),
        peer_row(
            format!("sagas/s: sandboxed, 64 in flight (all cores) | {middleware_path} (GIL: one core)"),
            ours64,
            middleware.0,
        ),
        peer_row(format!("sagas/s: sandboxed, 1 in flight | {agent_path}"), ours, agent.0),
        peer_row(format!("sagas per CPU-second: sandboxed, 1 in flight | {agent_path}"), ours_cpu, agent.1),
    ])
}

/// Runs the peer's script; (sagas per second, sagas per CPU-second). The script exits non-zero
/// when a saga was not rolled back.
fn run_peer_script(
    python: &Path,
    script: &Path,
    sagas_dir: &Path,
    mode: &str,
    sagas: usize,
) -> anyhow::Result<(f64, f64)> {
    let mut command = std::process::Command::new(python);
    command
        .arg(script)
        .args(["--mode", mode, "--sagas", &sagas.to_string(), "--sagas-dir"])
        .arg(sagas_dir)
        // No LangSmith tracing: it would send every run over the network.
        .env("LANGSMITH_TRACING", "false")
        .env("LANGCHAIN_TRACING_V2", "false");
    let stdout = checked(&mut command).context("the langchain-compensation peer failed")?;
    let line = stdout.lines().last().unwrap_or_default();
    let report: serde_json::Value = serde_json::from_str(line)
        .with_context(|| format!("the langchain-compensation peer printed no JSON summary: {stdout}"))?;
    let rate = |field: &str| {
        report[field].as_f64().ok_or_else(|| anyhow::anyhow!("the peer's summary has no {field}: {line}"))
    };
    Ok((rate("sagas_per_second")?, rate("sagas_per_cpu_second")?))
}

/// `dir` holding a venv with exactly the packages of `lock` (pip --no-deps, then `pip check`),
/// built the first time and again whenever the lock or the Python changes; returns its python.
/// `SAGABOX_PYTHON` names another interpreter than `python3`.
fn peer_venv(dir: &Path, lock: &str) -> anyhow::Result<std::path::PathBuf> {
    let base = std::env::var("SAGABOX_PYTHON").unwrap_or_else(|_| "python3".into());
    let version = checked(std::process::Command::new(&base).arg("--version")).with_context(|| {
        format!(
            "the langchain-compensation peer needs CPython 3.11 with venv and pip: `{base} --version` failed \
             (install python3 and python3-venv, or set SAGABOX_PYTHON)"
        )
    })?;
    let stamp = format!("{}\n{}", sagabox::json::sha256_hex(lock.as_bytes()), version.trim());
    let parent = dir.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    // Two benches at once build the venv once.
    let guard = std::fs::File::create(dir.with_extension("lock"))?;
    guard.lock()?;
    let python = dir.join("bin/python");
    let stamp_path = dir.join("sagabox-stamp");
    if python.exists() && std::fs::read_to_string(&stamp_path).is_ok_and(|s| s == stamp) {
        return Ok(python);
    }
    eprintln!("setting up {} from PyPI (langchain-compensation 0.5.8, every package pinned)…", dir.display());
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("cannot remove {}", dir.display()))?;
    }
    checked(std::process::Command::new(&base).args(["-m", "venv"]).arg(dir))
        .with_context(|| format!("`{base} -m venv` failed (Debian and Ubuntu: apt-get install python3-venv)"))?;
    let requirements = dir.join("requirements.lock");
    std::fs::write(&requirements, lock)?;
    let pip = |args: &[&str]| {
        let mut command = std::process::Command::new(&python);
        command.args(["-m", "pip", "--disable-pip-version-check", "--no-input"]).args(args);
        command
    };
    // --no-deps: the lock pins every package, and `pip check` proves that none is missing.
    checked(pip(&["install", "--no-deps", "--requirement"]).arg(&requirements))
        .context("cannot install the langchain-compensation peer's packages from PyPI")?;
    checked(&mut pip(&["check"])).context("the peer's venv is incomplete")?;
    std::fs::write(&stamp_path, stamp)?;
    Ok(python)
}

/// Runs `command` to its end; its stdout, or an error with everything it printed.
fn checked(command: &mut std::process::Command) -> anyhow::Result<String> {
    let out =
        command.stdin(std::process::Stdio::null()).output().with_context(|| format!("cannot start {command:?}"))?;
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        anyhow::bail!(
            "{command:?}: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            out.status,
            stdout.trim_end(),
            stderr.trim_end()
        );
    }
    Ok(stdout.into_owned())
}
