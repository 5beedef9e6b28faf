//! Greedy decode steps queued on the device one after another
//! (`IreeModel::decode_queued`) against a loop of `step`, on the CPU and on Vulkan device 0:
//! checks that both give the same tokens and the same state (the next step's logits), and
//! times both, per step, after an 860-token prefill (half the capacity on a smaller model).
//! `TARGET=cpu` or `TARGET=vulkan` runs one target only.
//!
//! ```text
//! cargo run --release -p kvsnap-iree --example queued_decode -- MODEL_DIR [MODULE_DIR]
//! ```
use std::time::Instant;

use kvsnap_contract::{KvModel, Logits};
use kvsnap_iree::compile::Target;
use kvsnap_iree::{IreeModel, IreeOptions};

fn main() -> kvsnap_contract::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let targets: &[Target] = match std::env::var("TARGET").as_deref() {
        Ok("cpu") => &[Target::LlvmCpu],
        Ok("vulkan") => &[Target::VulkanSpirv],
        _ => &[Target::LlvmCpu, Target::VulkanSpirv],
    };
    for &target in targets {
        let opts = IreeOptions {
            target,
            module_dir: args.get(2).map(Into::into),
            ..IreeOptions::cpu()
        };
        let model = IreeModel::load(std::path::Path::new(&args[1]), &opts)?;
        let cfg = model.config();
        let len = 860.min(cfg.context_capacity / 2) as u32;
        let prefix: Vec<u32> = (0..len)
            .map(|i| (i * 7919) % cfg.vocab_size as u32)
            .collect();
        let (base, first) = model.prefill(&prefix, Logits::Skip)?;
        let steps = 15;
        for round in 0..4 {
            let mut looped = model.snapshot(&base)?;
            let start = Instant::now();
            let mut want = Vec::new();
            let mut id = first.token;
            for _ in 0..steps {
                id = model.step(&mut looped, id, Logits::Skip)?.token;
                want.push(id);
            }
            let t_loop = start.elapsed();
            let mut queued = model.snapshot(&base)?;
            let start = Instant::now();
            let got = model.decode_queued(&mut queued, first.token, steps)?;
            let t_queued = start.elapsed();
            assert_eq!(
                got, want,
                "{target:?}: queued tokens differ from the loop's"
            );
            let a = model.step(&mut looped, 3, Logits::Return)?.logits.unwrap();
            let b = model.step(&mut queued, 3, Logits::Return)?.logits.unwrap();
            let d = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            println!(
                "{target:?} round {round}: tokens equal ({steps}), next logits max |d| {d:.3e}; loop {:.3} ms a step, queued {:.3}",
                t_loop.as_secs_f64() * 1e3 / steps as f64,
                t_queued.as_secs_f64() * 1e3 / steps as f64
            );
        }
        let used: Vec<String> = model
            .entry_calls()
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(name, n)| format!("{name} x{n}"))
            .collect();
        println!("{target:?} entry points called: {}", used.join(", "));
    }
    Ok(())
}
