//! `sagabox plugins`: what is loaded, and with what limits.

use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use serde_json::json;

use super::{Outcome, PluginArgs};

#[derive(clap::Args)]
pub struct Args {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(plugin_args: &PluginArgs, args: Args) -> anyhow::Result<Outcome> {
    let runtime = plugin_args.load().await?;
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
                    "policy": p.policy,
                    "tools": p.tools.values().map(|t| &t.info).collect::<Vec<_>>(),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&plugins)?);
        return Ok(Outcome::Success);
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
        let mut namespaces = p.policy.store.write.iter().map(|n| format!("{n} (rw)")).collect::<Vec<_>>();
        namespaces.extend(p.policy.store.read.iter().map(|n| format!("{n} (r)")));
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
    Ok(Outcome::Success)
}
