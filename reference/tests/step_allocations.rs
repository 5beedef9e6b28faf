//! A decode step allocates no buffer of the vocabulary's size (issue 7: no per-step allocation
//! of large buffers), counted by a global allocator over steps of the tiny model with a larger
//! vocabulary. Its own test binary: the allocator counts every thread's allocations, so
//! nothing else may run beside it.

mod counting;

use std::sync::atomic::Ordering;

use kvsnap_contract::{KvModel, Logits, ModelConfig};
use kvsnap_reference::tiny::{config_json, random_weights, Preset, DEFAULT_SEED};
use kvsnap_reference::{write_safetensors, ReferenceModel};

use counting::{COUNTING, LARGE, LARGEST, LARGE_SEEN};

#[global_allocator]
static ALLOCATOR: counting::Counting = counting::Counting;

/// The tiny model's vocabulary made this large, so that a buffer of its size stands out from
/// the layers' (the tiny model's own 512 is smaller than some of its attention's blocks).
const VOCAB: usize = 16_384;

#[test]
fn a_greedy_decode_step_allocates_nothing_of_vocabulary_size() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("reference-step-alloc");
    std::fs::create_dir_all(&dir).expect("model dir");
    let mut json: serde_json::Value =
        serde_json::from_str(&config_json(Preset::Tiny)).expect("tiny config");
    json["vocab_size"] = VOCAB.into();
    std::fs::write(dir.join("config.json"), json.to_string()).expect("write config");
    let cfg = ModelConfig::from_file(&dir.join("config.json")).expect("read config");
    assert_eq!(cfg.vocab_size, VOCAB);
    let tensors = random_weights(&cfg, DEFAULT_SEED);
    write_safetensors(&dir.join("model.safetensors"), &tensors, None).expect("write weights");
    let model = ReferenceModel::load(&dir).expect("load the model");
    let prompt: Vec<u32> = (0..20).map(|i| 2 + (i * 37) % 500).collect();
    let (mut kv, mut next) = model.prefill(&prompt, Logits::Skip).expect("prefill");
    // The first step grows the global layers' K/V past the prefill's exact size (a `Vec`
    // doubling, once per doubling of the sequence, not per step); the next 15 fit.
    next = model.step(&mut kv, next.token, Logits::Skip).expect("step");
    // The smallest vocabulary-sized buffer: the screen's i32 sums (logits would be f32).
    LARGE.store(VOCAB * std::mem::size_of::<i32>(), Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    for _ in 0..15 {
        next = model.step(&mut kv, next.token, Logits::Skip).expect("step");
    }
    COUNTING.store(false, Ordering::SeqCst);
    assert_eq!(
        LARGE_SEEN.load(Ordering::SeqCst),
        0,
        "15 greedy steps allocated buffers of at least {VOCAB} x 4 bytes (largest {} bytes)",
        LARGEST.load(Ordering::SeqCst)
    );
    // The counter saw the steps' allocations at all (it would pass vacuously if it did not).
    assert!(LARGEST.load(Ordering::SeqCst) > 0, "no allocation counted");
    // With every logit asked for, the vocabulary-sized buffer is there: the count works.
    COUNTING.store(true, Ordering::SeqCst);
    model
        .step(&mut kv, next.token, Logits::Return)
        .expect("step");
    COUNTING.store(false, Ordering::SeqCst);
    assert!(
        LARGE_SEEN.load(Ordering::SeqCst) > 0,
        "a step returning its logits allocated none of vocabulary size?"
    );
}
