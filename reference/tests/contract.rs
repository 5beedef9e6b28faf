//! The `KvModel` contract on the tiny model: incremental equals one-shot, snapshot
//! independence, embeddings input, and input errors that change nothing.

use std::path::PathBuf;

use kvsnap_contract::{Error, KvModel, Logits, Next, Tolerance};
use kvsnap_reference::kernels::Kernels;
use kvsnap_reference::tiny::{write_model, Preset, DEFAULT_SEED};
use kvsnap_reference::ReferenceModel;

/// The tiny model, written once per test binary into the target dir.
fn tiny_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("reference-contract-tiny");
        write_model(&dir, Preset::Tiny, DEFAULT_SEED).expect("write tiny model");
        dir
    })
    .clone()
}

fn tiny() -> ReferenceModel {
    ReferenceModel::load(&tiny_dir()).expect("load tiny model")
}

/// A deterministic prompt of `n` ids in the tiny vocab, BOS first.
fn prompt(n: usize, seed: u32) -> Vec<u32> {
    let mut s = seed.wrapping_mul(2_654_435_761) | 1;
    std::iter::once(2)
        .chain((1..n).map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s % 512
        }))
        .collect()
}

fn logits(next: &Next) -> &[f32] {
    next.logits.as_deref().expect("logits were requested")
}

fn assert_close(got: &Next, want: &Next, what: &str) {
    assert_eq!(got.token, want.token, "{what}: token");
    let tol = Tolerance::LOGITS;
    for (i, (g, w)) in logits(got).iter().zip(logits(want)).enumerate() {
        assert!(
            tol.accepts(*g as f64, *w as f64),
            "{what}: logit {i}: {g} vs {w}"
        );
    }
}

#[test]
fn incremental_equals_one_shot_across_window_wraps() {
    let m = tiny();
    let ids = prompt(45, 1); // window 6: the rings wrap seven times
    let (_, one_shot) = m.prefill(&ids, Logits::Return).unwrap();

    // Several splits into prefill + extend chunks + steps, some longer than the window.
    for splits in [
        vec![45],
        vec![1, 44],
        vec![5, 6, 7, 27],
        vec![20, 1, 1, 13, 10],
        vec![3; 15],
    ] {
        assert_eq!(splits.iter().sum::<usize>(), ids.len());
        let (mut kv, mut next) = m.prefill(&ids[..splits[0]], Logits::Return).unwrap();
        let mut at = splits[0];
        for &n in &splits[1..] {
            next = if n == 1 {
                m.step(&mut kv, ids[at], Logits::Return).unwrap()
            } else {
                m.extend(&mut kv, &ids[at..at + n], Logits::Return).unwrap()
            };
            at += n;
        }
        assert_eq!(m.len(&kv), ids.len());
        assert_close(&next, &one_shot, &format!("splits {splits:?}"));
    }

    // Token by token.
    let (mut kv, mut next) = m.prefill(&ids[..1], Logits::Return).unwrap();
    for &id in &ids[1..] {
        next = m.step(&mut kv, id, Logits::Return).unwrap();
    }
    assert_close(&next, &one_shot, "all steps");
}

#[test]
fn snapshot_is_independent_and_restores_bit_exactly() {
    let m = tiny();
    let ids = prompt(20, 2);
    let (mut a, _) = m.prefill(&ids, Logits::Skip).unwrap();
    let b = m.snapshot(&a).unwrap();

    // The run that never diverged: continue a copy of `a` with a fixed continuation.
    let continuation = prompt(12, 3);
    let mut straight = m.snapshot(&a).unwrap();
    let want: Vec<Next> = continuation
        .iter()
        .map(|&id| m.step(&mut straight, id, Logits::Return).unwrap())
        .collect();

    // Diverge `a` far past the window, then release it.
    m.extend(&mut a, &prompt(30, 4), Logits::Skip).unwrap();
    m.step(&mut a, 7, Logits::Skip).unwrap();
    m.release(a).unwrap();

    let mut b = b;
    for (id, want) in continuation.iter().zip(&want) {
        let got = m.step(&mut b, *id, Logits::Return).unwrap();
        assert_eq!(&got, want, "restored snapshot must be bit-exact");
    }
}

#[test]
fn embeddings_input_equals_ids_input() {
    let m = tiny();
    let ids = prompt(17, 5);
    let rows = m.embedding_rows(&ids).unwrap();
    let (_, by_ids) = m.prefill(&ids, Logits::Return).unwrap();
    let (_, by_rows) = m.prefill_embeddings(&ids, &rows, Logits::Return).unwrap();
    assert_eq!(by_ids, by_rows);
}

#[test]
fn bad_input_is_a_typed_error_and_changes_nothing() {
    let m = ReferenceModel::load_with_capacity(&tiny_dir(), 24).unwrap();
    let ids = prompt(20, 6);
    let (mut kv, _) = m.prefill(&ids, Logits::Skip).unwrap();
    let mut clean = m.snapshot(&kv).unwrap();

    let e = m.extend(&mut kv, &[], Logits::Skip).unwrap_err();
    assert!(matches!(e, Error::EmptyInput { op: "extend" }), "{e}");
    let e = m.extend(&mut kv, &[1, 512, 3], Logits::Skip).unwrap_err();
    assert!(
        matches!(
            e,
            Error::TokenOutOfRange {
                token: 512,
                index: 1,
                vocab: 512,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("token id 512"), "{e}");
    let e = m.extend(&mut kv, &[1; 5], Logits::Skip).unwrap_err();
    assert!(
        matches!(
            e,
            Error::ContextOverflow {
                have: 20,
                adding: 5,
                capacity: 24,
                ..
            }
        ),
        "{e}"
    );
    let e = m.step(&mut kv, u32::MAX, Logits::Skip).unwrap_err();
    assert!(matches!(e, Error::TokenOutOfRange { .. }), "{e}");
    let e = m.prefill(&[], Logits::Skip).unwrap_err();
    assert!(matches!(e, Error::EmptyInput { op: "prefill" }), "{e}");
    let e = m.prefill(&prompt(25, 1), Logits::Skip).unwrap_err();
    assert!(matches!(e, Error::ContextOverflow { .. }), "{e}");
    let e = m
        .prefill_embeddings(&[2, 3], &vec![0.0; 64 * 3], Logits::Skip)
        .unwrap_err();
    assert!(
        matches!(&e, Error::ShapeMismatch { expected, got, .. } if expected == &[2, 64] && got == &[3, 64]),
        "{e}"
    );

    // The state is untouched: it continues exactly like its clean copy, up to the capacity.
    assert_eq!(m.len(&kv), 20);
    let tail = [5, 6, 7, 8];
    assert_eq!(
        m.extend(&mut kv, &tail, Logits::Return).unwrap(),
        m.extend(&mut clean, &tail, Logits::Return).unwrap()
    );
    assert_eq!(m.len(&kv), 24);
    assert!(matches!(
        m.step(&mut kv, 1, Logits::Skip),
        Err(Error::ContextOverflow {
            have: 24,
            adding: 1,
            capacity: 24,
            ..
        })
    ));
}

#[test]
fn broken_model_dirs_name_the_problem() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("reference-contract-broken");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let e = ReferenceModel::load(&dir).err().unwrap();
    assert!(
        matches!(e, Error::Io { .. }) && e.to_string().contains("config.json"),
        "{e}"
    );

    // A config whose vocab does not match the weights.
    let good = tiny_dir();
    std::fs::copy(
        good.join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let config = std::fs::read_to_string(good.join("config.json")).unwrap();
    let wrong = config.replace("\"vocab_size\": 512", "\"vocab_size\": 600");
    assert_ne!(
        wrong, config,
        "the tiny config spells vocab_size as expected"
    );
    std::fs::write(dir.join("config.json"), wrong).unwrap();
    let e = ReferenceModel::load(&dir).err().unwrap();
    assert!(
        matches!(&e, Error::WeightsMismatch { tensor, .. } if tensor == "model.embed_tokens.weight"),
        "{e}"
    );
    assert!(
        e.to_string().contains("[512, 64], expected [600, 64]"),
        "{e}"
    );

    // A truncated weights file.
    std::fs::write(dir.join("config.json"), &config).unwrap();
    let bytes = std::fs::read(good.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let e = ReferenceModel::load(&dir).err().unwrap();
    assert!(
        matches!(
            e,
            Error::Format {
                format: "safetensors",
                ..
            }
        ),
        "{e}"
    );
}

/// The load report counts the tiny model's linear layers (four a decoder layer: q/k/v, o,
/// gate/up, down), packed where the AVX-512F kernels run, and the bytes a step streams: each
/// weight's panels (its rows rounded up to whole panels of 32) and the head's int8 table.
#[test]
fn the_load_report_counts_the_layers_and_what_a_step_streams() {
    let model = tiny();
    let cfg = model.config();
    let r = model.load_report();
    assert_eq!(r.kernels, Kernels::active());
    assert!(r.threads >= 1);
    assert_eq!(r.packed_layers + r.row_major_layers, 4 * cfg.num_layers());
    let (h, hd, f) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    // (rows, depth) of each weight of a layer, the stacked ones part by part.
    let weights = [(q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)];
    let panels: usize = weights
        .iter()
        .map(|&(rows, depth)| rows.div_ceil(32) * 32 * depth * 4)
        .sum();
    let head = cfg.vocab_size * h;
    if r.kernels == Kernels::Avx512 {
        assert_eq!(r.row_major_layers, 0, "{r:?}");
        assert_eq!(r.streamed_bytes, cfg.num_layers() * panels + head, "{r:?}");
    } else {
        eprintln!("no AVX-512F kernels here: the layers are row-major, only the head is streamed");
        assert_eq!(r.packed_layers, 0, "{r:?}");
        assert_eq!(r.streamed_bytes, head, "{r:?}");
    }
    assert!(r.layers_as_intended());
    if cfg!(target_os = "linux") {
        let huge = r.huge_page_bytes.expect("Linux has /proc/self/smaps");
        assert!(huge <= r.streamed_bytes, "{r:?}");
    } else {
        assert_eq!(r.huge_page_bytes, None);
    }
}
