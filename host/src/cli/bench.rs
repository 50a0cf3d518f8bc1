//! `sagabox bench`: benchmarks that print numbers, never pass or fail.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use std::sync::Arc;

use sagabox::durable::{Durability, SqliteBackend};
use sagabox::runtime::{CallContext, CallOptions, EngineOptions, Runtime, RuntimeOptions};
use sagabox::saga::{self, MemoryBackend, RunOptions, Saga, Status};
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
    pub samples: usize,
}

impl Measurement {
    pub fn from_samples(name: impl Into<String>, mut samples: Vec<Duration>) -> Measurement {
        samples.sort();
        let at = |q: f64| {
            let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
            samples.get(i).map_or(0.0, |d| d.as_secs_f64() * 1e6)
        };
        Measurement { name: name.into(), median_us: at(0.5), p90_us: at(0.9), samples: samples.len() }
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
        ("pooling, fuel, epochs (default)", EngineOptions::default()),
        ("on-demand allocator", EngineOptions { pooling: false, ..EngineOptions::default() }),
        ("fuel off", EngineOptions { fuel: false, ..EngineOptions::default() }),
        ("epochs off", EngineOptions { epochs: false, ..EngineOptions::default() }),
    ];
    let mut out = Vec::new();
    for (label, engine) in configurations {
        let options =
            RuntimeOptions { engine, cache_dir: cache_dir.map(Path::to_path_buf), ..RuntimeOptions::default() };
        let runtime = Runtime::load(options).await?;
        let store = MemoryStore::new(pool_state());
        let args = json!({ "pool_id": "bench", "amount": 1 });
        let mut samples = Vec::with_capacity(calls);
        for i in 0..calls + calls / 10 {
            let options = CallOptions {
                context: CallContext {
                    saga_id: "bench".into(),
                    step_id: "allocate".into(),
                    attempt: 1,
                    idempotency_key: format!("{i:064x}"),
                },
                ..CallOptions::default()
            };
            let started = Instant::now();
            let outcome = runtime.call("resources.allocate", &args, &options, &store).await;
            let elapsed = started.elapsed();
            outcome.result.map_err(|e| anyhow::anyhow!("benchmark call failed: {e}"))?;
            if i >= calls / 10 {
                samples.push(elapsed); // the first tenth warms up
            }
        }
        out.push(Measurement::from_samples(format!("fresh instance + call + commit: {label}"), samples));
    }
    Ok(out)
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
    /// Benchmark groups to run: runtime, sagas, verify, durable, snapshot [default: all].
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(plugin_args: &super::PluginArgs, args: Args) -> anyhow::Result<super::Outcome> {
    let wants = |group: &str| args.only.is_empty() || args.only.iter().any(|g| g == group);
    let cache = plugin_args.options().cache_dir;
    let runtime = Arc::new(plugin_args.load().await?);
    let mut results = Vec::new();
    let mut rates: Vec<(String, f64)> = Vec::new();
    if wants("runtime") {
        let airline = sagabox::runtime::bundled_wasm("airline").ok_or_else(|| anyhow::anyhow!("no bundled airline"))?;
        results.extend(plugin_load(airline, 5).await?);
        results.extend(per_call(args.calls, cache.as_deref()).await?);
    }
    if wants("sagas") {
        for (name, expect) in [("ct1-payment-failure", Status::Failed), ("travel", Status::Completed)] {
            let (saga, state, input) = shipped_saga(&runtime, &args.sagas_dir, name)?;
            let saga = Arc::new(saga);
            for concurrency in [1, 64] {
                let t = saga_throughput(
                    runtime.clone(),
                    saga.clone(),
                    state.clone(),
                    input.clone(),
                    args.sagas,
                    concurrency,
                    expect,
                )
                .await?;
                results.push(t.latency.clone());
                rates.push((format!("sagas/s: {}", t.name), t.per_second));
            }
        }
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
        let (saga, state, input) = shipped_saga(&runtime, &args.sagas_dir, "ct1-payment-failure")?;
        let saga = Arc::new(saga);
        for durability in [Durability::Normal, Durability::Full] {
            let dir = tempfile_dir()?;
            let db = Arc::new(SqliteBackend::open(&dir.join("bench.db"), durability)?);
            db.seed(&state)?;
            let sagas = (args.sagas / 10).max(100);
            let started = Instant::now();
            for i in 0..sagas {
                let report =
                    saga::run(&runtime, &saga, db.as_ref(), RunOptions::new(format!("d{i}"), input.clone())).await;
                if report.status != Status::Failed {
                    anyhow::bail!("durable ct1 ended {:?}: {:?}", report.status, report.error);
                }
            }
            let per_second = sagas as f64 / started.elapsed().as_secs_f64();
            let bytes = db.journal_bytes("d0")?;
            rates.push((
                format!("durable ct1 sagas/s, synchronous={durability:?} (journal {bytes} bytes/saga)"),
                per_second,
            ));
            drop(db);
            std::fs::remove_dir_all(&dir)?;
        }
    }
    if wants("snapshot") {
        for mb in &args.sizes_mb {
            results.extend(snapshot_costs(*mb)?);
        }
    }
    if args.json {
        let rates: Vec<_> = rates.iter().map(|(name, rate)| json!({ "name": name, "per_second": rate })).collect();
        println!("{}", serde_json::to_string_pretty(&json!({ "measurements": results, "rates": rates }))?);
    } else {
        let mut table = comfy_table::Table::new();
        table.load_preset(comfy_table::presets::UTF8_BORDERS_ONLY).set_header([
            "benchmark",
            "median",
            "p90",
            "samples",
        ]);
        for m in &results {
            table.add_row([m.name.clone(), format_us(m.median_us), format_us(m.p90_us), m.samples.to_string()]);
        }
        println!("{table}");
        let mut table = comfy_table::Table::new();
        table.load_preset(comfy_table::presets::UTF8_BORDERS_ONLY).set_header(["throughput", "per second"]);
        for (name, rate) in &rates {
            table.add_row([name.clone(), format!("{rate:.0}")]);
        }
        println!("{table}");
    }
    Ok(super::Outcome::Success)
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
