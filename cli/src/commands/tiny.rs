//! `kvsnap tiny-model`: write a deterministic random Gemma 3 model in Hugging Face format.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use kvsnap_reference::tiny::{self, Preset, DEFAULT_SEED};

/// Arguments of `kvsnap tiny-model`.
#[derive(clap::Args)]
pub struct Args {
    /// Directory to write config.json and model.safetensors into (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Shapes: `tiny` (6 layers, 6-token window, for tests) or `real-shapes` (Gemma 3 270M's
    /// shapes with random weights, for timing).
    #[arg(long, default_value_t = Preset::Tiny)]
    pub preset: Preset,
    /// Seed of the weights; the same seed always gives byte-identical files.
    #[arg(long, default_value_t = DEFAULT_SEED)]
    pub seed: u64,
}

/// Writes the model and prints what was written.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let start = Instant::now();
    let cfg = tiny::write_model(&args.out, args.preset, args.seed).with_context(|| {
        format!(
            "writing the {} model to {}",
            args.preset,
            args.out.display()
        )
    })?;
    println!(
        "wrote {} (preset {}, seed {}): {} layers, hidden {}, vocab {}, window {} in {:.1} s",
        args.out.display(),
        args.preset,
        args.seed,
        cfg.num_layers(),
        cfg.hidden_size,
        cfg.vocab_size,
        cfg.sliding_window,
        start.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}
