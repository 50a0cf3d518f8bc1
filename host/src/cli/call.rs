//! `sagabox call`: one tool call in a sandbox.

use std::path::PathBuf;

use anyhow::Context as _;
use sagabox::runtime::{CallContext, CallOptions, LimitOverrides};
use sagabox::store::{MemoryStore, State, fixture};
use serde_json::json;

use super::{Outcome, PluginArgs, json_arg};

#[derive(clap::Args)]
pub struct Args {
    /// The tool, as <plugin>.<tool> (see `sagabox plugins`).
    tool: String,

    /// The arguments: a JSON object, or @FILE.
    #[arg(long, default_value = "{}")]
    args: String,

    /// Start from this fixture (a JSON file of namespaces, or a directory of <namespace>.json).
    #[arg(long, value_name = "FIXTURE")]
    state: Option<PathBuf>,

    /// Write the store after the call to FILE (canonical JSON).
    #[arg(long, value_name = "FILE")]
    write_state: Option<PathBuf>,

    /// Print a JSON object (result or error, changes, fuel, time) instead of the bare result.
    #[arg(long)]
    json: bool,

    #[command(flatten)]
    limits: LimitArgs,
}

/// Per-call limit overrides.
#[derive(clap::Args)]
pub struct LimitArgs {
    /// Fuel units for the call.
    #[arg(long)]
    fuel: Option<u64>,
    /// Wall-clock deadline for the call, in milliseconds.
    #[arg(long)]
    deadline_ms: Option<u64>,
    /// Linear memory cap, in MiB.
    #[arg(long)]
    memory_mib: Option<u64>,
    /// Wasm stack, in KiB.
    #[arg(long)]
    stack_kib: Option<u64>,
    /// Cap on the size of the result, in KiB.
    #[arg(long)]
    output_kib: Option<u64>,
}

impl LimitArgs {
    fn overrides(&self) -> LimitOverrides {
        LimitOverrides {
            fuel: self.fuel,
            deadline_ms: self.deadline_ms,
            memory_mib: self.memory_mib,
            stack_kib: self.stack_kib,
            output_kib: self.output_kib,
            ..LimitOverrides::default()
        }
    }
}

pub async fn run(plugin_args: &PluginArgs, args: Args) -> anyhow::Result<Outcome> {
    let call_args = json_arg(&args.args, "--args")?;
    let state = match &args.state {
        Some(path) => fixture::load(path)?,
        None => State::default(),
    };
    let runtime = plugin_args.load().await?;
    let store = MemoryStore::new(state);
    let run_id = sagabox::ids::new_run_id();
    let options = CallOptions {
        context: CallContext {
            idempotency_key: sagabox::ids::idempotency_key(&run_id, "", &args.tool, &call_args),
            saga_id: run_id,
            step_id: String::new(),
            attempt: 1,
        },
        limits: args.limits.overrides(),
        ..CallOptions::default()
    };
    let outcome = runtime.call(&args.tool, &call_args, &options, &store).await;
    if let Some(path) = &args.write_state {
        std::fs::write(path, store.snapshot().to_canonical_json())
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let changes: Vec<_> = outcome
        .changes
        .iter()
        .map(|c| {
            let change = match (&c.before, &c.after) {
                (None, _) => "added",
                (_, None) => "removed",
                _ => "changed",
            };
            json!({ "namespace": c.namespace, "key": c.key, "change": change })
        })
        .collect();
    if args.json {
        let report = match &outcome.result {
            Ok(output) => json!({ "ok": true, "output": output }),
            Err(error) => json!({ "ok": false, "error": error, "message": error.to_string() }),
        };
        let mut report = report;
        report["changes"] = json!(changes);
        report["fuel_used"] = json!(outcome.fuel_used);
        report["elapsed_us"] = json!(outcome.elapsed.as_micros() as u64);
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        match &outcome.result {
            Ok(output) => println!("{}", serde_json::to_string_pretty(output)?),
            Err(error) => eprintln!("error: {error}"),
        }
        for c in &changes {
            eprintln!(
                "{} {}/{}",
                c["change"].as_str().unwrap_or_default(),
                c["namespace"].as_str().unwrap_or_default(),
                c["key"].as_str().unwrap_or_default()
            );
        }
    }
    Ok(if outcome.result.is_ok() { Outcome::Success } else { Outcome::Failure })
}
