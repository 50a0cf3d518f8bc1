//! `sagabox fixtures generate`: seeded large stores for snapshot and campaign benchmarks.

use std::path::PathBuf;

use anyhow::Context as _;
use sagabox::store::fixture;
use sagabox::store::generate::{self, Scale};

use super::Outcome;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Generate a fixture in the bundled tools' shapes (tau-bench airline and retail, hotels).
    Generate(GenerateArgs),
}

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// Seed of the generator: the same seed gives the same bytes.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Size in units: each is 100 flights x 10 dates, 50 users, 100 reservations, 20 products,
    /// 100 orders and 10 hotels (about 0.35 MB).
    #[arg(long, conflicts_with = "size_mb")]
    scale: Option<usize>,
    /// Approximate size of the canonical JSON, in MB (chooses the scale).
    #[arg(long)]
    size_mb: Option<f64>,
    /// A fixture whose documents are laid over the generated ones (e.g. a saga's own), so the
    /// saga still runs on the large store: a JSON file {namespace: {key: document}} or a
    /// directory of <namespace>.json files, as every --state takes.
    #[arg(long, value_name = "FIXTURE")]
    base: Option<PathBuf>,
    /// Write to FILE instead of stdout.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

pub fn run(command: Command) -> anyhow::Result<Outcome> {
    let Command::Generate(args) = command;
    let units = match (args.scale, args.size_mb) {
        (Some(units), _) => units,
        (None, Some(mb)) => {
            let unit = sagabox::json::canonical(&generate::generate(args.seed, &Scale::of(1))).len() as f64;
            ((mb * 1e6 / unit).round() as usize).max(1)
        }
        (None, None) => 1,
    };
    let mut store = generate::generate(args.seed, &Scale::of(units));
    if let Some(base) = &args.base {
        // The one fixture loader, so --base takes what every other fixture option takes.
        store = generate::overlay(store, &fixture::load(base)?.to_json());
    }
    let text = sagabox::json::canonical(&store);
    match &args.out {
        Some(path) => {
            std::fs::write(path, &text).with_context(|| format!("cannot write {}", path.display()))?;
            eprintln!("wrote {} ({:.1} MB, scale {units})", path.display(), text.len() as f64 / 1e6);
        }
        None => println!("{text}"),
    }
    Ok(Outcome::Success)
}
