//! A forward pass allocates its activations once, not once per layer (`blocks::Scratch`):
//! allocated per layer, the catalog's 860-token prefill zeroed about 37 MB a layer
//! (docs/BENCHMARKS.md, thirty-fourth pass). Counted by a global allocator over an extend of
//! the tiny model. Its own test binary: the allocator counts every thread's allocations, so
//! nothing else may run beside it.

mod counting;

use std::sync::atomic::Ordering;

use kvsnap_contract::{KvModel, Logits};
use kvsnap_reference::tiny::{write_model, Preset, DEFAULT_SEED};
use kvsnap_reference::ReferenceModel;

use counting::{COUNTING, LARGE, LARGE_SEEN};

#[global_allocator]
static ALLOCATOR: counting::Counting = counting::Counting;

#[test]
fn a_forward_pass_allocates_its_largest_activations_once() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("reference-pass-alloc");
    let cfg = write_model(&dir, Preset::Tiny, DEFAULT_SEED).expect("write the tiny model");
    let model = ReferenceModel::load(&dir).expect("load the model");
    let prompt: Vec<u32> = (0..20).map(|i| 2 + (i * 37) % 500).collect();
    let (mut kv, _) = model.prefill(&prompt, Logits::Skip).expect("prefill");
    let utterance: Vec<u32> = (0..40).map(|i| 3 + (i * 11) % 500).collect();

    // The largest activations of the extend: its rows of the stacked gate/up projection's
    // output, and of q/k/v's (the tiny model's are the same size). Nothing else it allocates
    // is as large: the K/V it appends, attention's blocks and the products' interleaved rows
    // are smaller.
    let (n, layers) = (utterance.len(), cfg.layer_kinds.len());
    let gate_up = n * 2 * cfg.intermediate_size * std::mem::size_of::<f32>();
    let qkv = n
        * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
        * cfg.head_dim
        * std::mem::size_of::<f32>();
    assert!(
        layers >= 4 && qkv <= gate_up,
        "the tiny model's shapes changed"
    );
    LARGE.store(qkv.min(gate_up), Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    model
        .extend(&mut kv, &utterance, Logits::Skip)
        .expect("extend");
    COUNTING.store(false, Ordering::SeqCst);
    let seen = LARGE_SEEN.load(Ordering::SeqCst);
    // One buffer each for the pass (per layer it would be 2 x layers); at least one, or the
    // count saw nothing.
    assert!(
        (1..=2).contains(&seen),
        "an extend of {n} rows over {layers} layers allocated {seen} buffers of at least {} bytes",
        qkv.min(gate_up)
    );
}
