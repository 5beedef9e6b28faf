//! An IREE model against the reference on one model directory, for a device where the tests
//! cannot run (they compile modules, which needs IREE's compiler): the catalog's shape of
//! work, an 860-token prefill (half the capacity on a smaller model), a 36-token extend and a
//! 15-step greedy `decode`, then one step, each compared with the reference's: the tokens, and
//! the logits' largest difference where they are returned. Exits non-zero on a token that
//! differs or a logit difference above `TOL` (default 2e-3, `kvsnap parity`'s tolerance).
//!
//! ```text
//! cargo run --release -p kvsnap-iree --example against_reference -- MODEL_DIR [MODULE_DIR]
//! ```
//! `TARGET=cpu` runs llvm-cpu instead of Vulkan device 0.

use kvsnap_contract::{KvModel, Logits};
use kvsnap_iree::compile::Target;
use kvsnap_iree::{IreeModel, IreeOptions};
use kvsnap_reference::ReferenceModel;

fn main() -> kvsnap_contract::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let Some(dir) = args.get(1).map(std::path::Path::new) else {
        eprintln!("usage: against_reference MODEL_DIR [MODULE_DIR]");
        std::process::exit(2);
    };
    let target = match std::env::var("TARGET").as_deref() {
        Ok("cpu") => Target::LlvmCpu,
        _ => Target::VulkanSpirv,
    };
    let tol: f32 = std::env::var("TOL").map_or(2e-3, |t| t.parse().expect("TOL: a number"));
    let opts = IreeOptions {
        target,
        module_dir: args.get(2).map(Into::into),
        ..IreeOptions::cpu()
    };
    let iree = IreeModel::load(dir, &opts)?;
    let reference = ReferenceModel::load(dir)?;
    let cfg = iree.config();
    let vocab = cfg.vocab_size as u32;
    let ids =
        |n: u32, seed: u32| -> Vec<u32> { (0..n).map(|i| (i * 7919 + seed) % vocab).collect() };
    let len = 860.min(cfg.context_capacity / 2) as u32;
    let mut worst = 0f32;
    let mut compare = |what: &str, a: &Option<Vec<f32>>, b: &Option<Vec<f32>>| {
        let (a, b) = (a.as_ref().expect("logits"), b.as_ref().expect("logits"));
        let d = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        println!("{what}: logits max |d| {d:.3e}");
        worst = worst.max(d);
    };

    let prefix = ids(len, 0);
    let (mut a, pa) = iree.prefill(&prefix, Logits::Return)?;
    let (mut b, pb) = reference.prefill(&prefix, Logits::Return)?;
    compare(&format!("prefill {len}"), &pa.logits, &pb.logits);
    let mut same = pa.token == pb.token;

    let utterance = ids(36, 11);
    let ea = iree.extend(&mut a, &utterance, Logits::Return)?;
    let eb = reference.extend(&mut b, &utterance, Logits::Return)?;
    compare("extend 36", &ea.logits, &eb.logits);
    same &= ea.token == eb.token;

    let da = iree.decode(&mut a, eb.token, 15)?;
    let db = reference.decode(&mut b, eb.token, 15)?;
    println!(
        "decode 15: tokens {}",
        if da == db { "equal" } else { "DIFFER" }
    );
    same &= da == db;

    let last = *db.last().expect("15 tokens");
    let sa = iree.step(&mut a, last, Logits::Return)?;
    let sb = reference.step(&mut b, last, Logits::Return)?;
    compare("step after the decode", &sa.logits, &sb.logits);
    same &= sa.token == sb.token;

    println!(
        "{}: tokens {}, largest logit difference {worst:.3e} (bound {tol:.1e})",
        target.name(),
        if same { "equal" } else { "DIFFER" }
    );
    if !same || worst > tol {
        std::process::exit(1);
    }
    Ok(())
}
