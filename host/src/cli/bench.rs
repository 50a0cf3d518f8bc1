//! `sagabox bench`: benchmarks that print numbers, never pass or fail.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use sagabox::runtime::{CallContext, CallOptions, EngineOptions, Runtime, RuntimeOptions};
use sagabox::store::{MemoryStore, State};

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

#[derive(clap::Args)]
pub struct Args {
    /// Calls per configuration.
    #[arg(long, default_value_t = 5000)]
    calls: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(plugin_args: &super::PluginArgs, args: Args) -> anyhow::Result<super::Outcome> {
    let cache = plugin_args.options().cache_dir;
    let airline = sagabox::runtime::bundled_wasm("airline").ok_or_else(|| anyhow::anyhow!("no bundled airline"))?;
    let mut results = plugin_load(airline, 5).await?;
    results.extend(per_call(args.calls, cache.as_deref()).await?);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
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
    }
    Ok(super::Outcome::Success)
}

fn format_us(us: f64) -> String {
    if us >= 10_000.0 { format!("{:.1} ms", us / 1000.0) } else { format!("{us:.1} µs") }
}
