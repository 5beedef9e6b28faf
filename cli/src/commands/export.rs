//! `kvsnap export`: compile a model's IREE module once and write it to a directory, for
//! inspection with IREE's own tools and for loading where no compiler exists
//! (`--module-dir` / the JNI `moduleDir`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use kvsnap_contract::ModelConfig;
use kvsnap_iree::compile::{Compiler, Target};
use kvsnap_iree::module;

use super::backend::Backend;

/// Arguments of `kvsnap export`.
#[derive(clap::Args)]
pub struct Args {
    /// HF model directory (only config.json is read).
    #[arg(long, default_value = "models/gemma-3-270m")]
    model: PathBuf,
    /// `llvm-cpu` or `vulkan-spirv`.
    #[arg(long, default_value = "llvm-cpu")]
    target: String,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Context capacity in tokens (default: the config's default).
    #[arg(long)]
    capacity: Option<usize>,
    /// `vulkan-spirv` only: the GPU to compile for (IREE's `--iree-vulkan-target`: `ampere`,
    /// `ada`, `rdna3`, `valhall4`, `rtx4090`, ...). Default: $KVSNAP_VULKAN_TARGET, else IREE's
    /// generic SPIR-V environment, which runs on any Vulkan device but slower.
    #[arg(long)]
    vulkan_target: Option<String>,
}

/// Builds, compiles (through the cache) and writes the module.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let target = match args.target.as_str() {
        "llvm-cpu" => Target::LlvmCpu,
        "vulkan-spirv" | "vulkan" => Target::VulkanSpirv,
        other => bail!("unknown target `{other}` (known: llvm-cpu, vulkan-spirv)"),
    };
    if args.vulkan_target.is_some() && target != Target::VulkanSpirv {
        bail!("--vulkan-target applies to `--target vulkan-spirv` only");
    }
    let cfg = ModelConfig::from_dir(&args.model, args.capacity)?;
    let mut compiler = Compiler::discover()?;
    if let Some(name) = &args.vulkan_target {
        compiler = compiler.with_vulkan_target(Some(name))?;
    }
    if target == Target::VulkanSpirv {
        match compiler.vulkan_target() {
            Some(name) => eprintln!("compiling for the Vulkan target `{name}`"),
            None => eprintln!(
                "compiling for IREE's generic SPIR-V environment (any Vulkan device; \
                 --vulkan-target names a GPU and runs faster on it)"
            ),
        }
    }
    // The module loading would run here: the environment's IREE options (own kernels) apply.
    let backend = match target {
        Target::LlvmCpu => Backend::IreeCpu,
        Target::VulkanSpirv => Backend::IreeVulkan,
    };
    let opts = kvsnap_iree::IreeOptions {
        target,
        module_dir: None,
        ..super::backend::iree_options(backend)?
    };
    let start = Instant::now();
    let (graphs, compiled) =
        module::export_with(&compiler, &args.out, &cfg, &opts, &mut |p| eprintln!("{p}"))
            .with_context(|| format!("exporting the module to {}", args.out.display()))?;
    let (mlir, vmfb, json) = module::paths(&args.out, target);
    if let Some(with) = module::info(&args.out, target)?.exported_with {
        println!(
            "recorded for loading: context capacity {} tokens, chunk sizes {:?}, input \
             `{}`, kvsnap's own kernels {}",
            with.capacity,
            with.chunks,
            with.input.name(),
            if with.own_kernels {
                "linked"
            } else {
                "not linked"
            }
        );
    }
    println!(
        "exported {} ({} KB of MLIR, {} entry points) and {} ({:.1} MB) in {:.1} s; {}",
        mlir.display(),
        graphs.mlir.len() / 1024,
        graphs.manifest.entry_points.len(),
        vmfb.display(),
        compiled.vmfb.len() as f64 / 1e6,
        start.elapsed().as_secs_f64(),
        json.display()
    );
    println!(
        "load it with KVSNAP_MODULE_DIR={} (CLI) or moduleDir (JNI); run it with iree-run-module --module={}",
        args.out.display(),
        vmfb.display()
    );
    Ok(ExitCode::SUCCESS)
}
