//! `sagabox plugins`: what is loaded, and with what limits.

use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use sagabox::runtime::policy::{LimitOverrides, Network, Policy};
use serde_json::json;

use super::{Outcome, PluginArgs};

#[derive(clap::Args)]
pub struct Args {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(plugin_args: &PluginArgs, args: Args) -> anyhow::Result<Outcome> {
    let (runtime, not_loaded) = plugin_args.load_reporting().await?;
    // The diagnostic command lists what loaded, and still fails when anything did not.
    let outcome = || {
        if not_loaded == 0 {
            Ok(Outcome::Success)
        } else {
            anyhow::bail!("{not_loaded} plugin(s) did not load (see above)")
        }
    };
    if args.json {
        let plugins: Vec<_> = runtime
            .plugins()
            .map(|p| {
                json!({
                    "name": p.name,
                    "origin": p.origin,
                    "sha256": p.sha256,
                    "compiled": p.compiled,
                    "limits": p.limits,
                    "requested": p.policy,
                    "granted": { "store": p.grant.policy.store, "wasi": p.grant.policy.wasi },
                    "refused": p.grant.refused,
                    "tools": p.tools.values().map(|t| &t.info).collect::<Vec<_>>(),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&plugins)?);
        return outcome();
    }
    let mut table = Table::new();
    table.load_preset(UTF8_BORDERS_ONLY).set_header(["tool", "effects", "compensator", "description"]);
    for plugin in runtime.plugins() {
        for tool in plugin.tools.values() {
            let undoes = plugin.tools.values().find(|t| t.info.compensator.as_ref() == Some(&tool.info.name));
            let compensator = match (&tool.info.compensator, undoes, tool.info.side_effects) {
                (Some(c), _, _) => format!("{}.{c}", plugin.name),
                (None, Some(forward), _) => format!("(undoes {}.{})", plugin.name, forward.info.name),
                (None, None, true) => "(none)".into(),
                (None, None, false) => String::new(),
            };
            let effects = if tool.info.side_effects { "writes" } else { "reads" };
            table.add_row([
                format!("{}.{}", plugin.name, tool.info.name),
                effects.into(),
                compensator,
                tool.info.description.clone(),
            ]);
        }
    }
    println!("{table}");
    let mut table = Table::new();
    table.load_preset(UTF8_BORDERS_ONLY).set_header([
        "plugin",
        "sha256",
        "fuel",
        "deadline",
        "memory",
        "stack",
        "output",
        "namespaces",
        "compiled",
    ]);
    for p in runtime.plugins() {
        let l = &p.limits;
        let granted = &p.grant.policy.store;
        let mut namespaces = granted.write.iter().map(|n| format!("{n} (rw)")).collect::<Vec<_>>();
        namespaces.extend(granted.read.iter().map(|n| format!("{n} (r)")));
        table.add_row([
            p.name.clone(),
            p.sha256[..16].to_string(),
            l.fuel.to_string(),
            format!("{} ms", l.deadline_ms),
            format!("{} MiB", l.memory_mib),
            format!("{} KiB", l.stack_kib),
            format!("{} KiB", l.output_kib),
            namespaces.join(", "),
            format!("{:?}", p.compiled).to_lowercase(),
        ]);
    }
    println!("{table}");
    let mut table = Table::new();
    table.load_preset(UTF8_BORDERS_ONLY).set_header(["plugin", "requested", "granted", "refused"]);
    for p in runtime.plugins() {
        let requested = [summary(&p.policy), overrides(&p.policy.limits)].concat();
        table.add_row([
            p.name.clone(),
            requested.join("\n"),
            summary(&p.grant.policy).join("\n"),
            p.grant.refused.join("\n"),
        ]);
    }
    println!("{table}");
    outcome()
}

/// A policy's capabilities, one line each.
fn summary(policy: &Policy) -> Vec<String> {
    let mut lines = Vec::new();
    let mut add = |label: &str, items: Vec<String>| {
        if !items.is_empty() {
            lines.push(format!("{label}: {}", items.join(", ")));
        }
    };
    add("write", policy.store.write.clone());
    add("read", policy.store.read.clone());
    add("env", policy.wasi.env.clone());
    let dirs = policy
        .wasi
        .dirs
        .iter()
        .map(|d| format!("{} as {}{}", d.host.display(), d.guest, if d.writable { " (rw)" } else { "" }));
    add("dirs", dirs.collect());
    match &policy.wasi.network {
        Network::None => {}
        Network::Any => add("network", vec!["any".into()]),
        Network::Hosts(hosts) => add("network", hosts.iter().map(ToString::to_string).collect()),
    }
    lines
}

/// The limits a policy sets, as one line.
fn overrides(limits: &LimitOverrides) -> Vec<String> {
    let set: Vec<String> = serde_json::to_value(limits)
        .ok()
        .and_then(|v| v.as_object().cloned())
        .into_iter()
        .flatten()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| format!("{k} = {v}"))
        .collect();
    if set.is_empty() { Vec::new() } else { vec![format!("limits: {}", set.join(", "))] }
}
