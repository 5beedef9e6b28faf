//! The prefix cache on the tiny model (vocab 512, so token ids are built directly): hits,
//! misses, extension of a shorter cached prefix, snapshot independence, LRU eviction under the
//! byte budget, and the errors.

use std::path::PathBuf;

use kvsnap_contract::{Error as ModelError, KvModel, Logits, Tolerance};
use kvsnap_prompt::{Error, Lookup, PrefillProgress, PrefixCache};
use kvsnap_reference::tiny::{write_model, Preset, DEFAULT_SEED};
use kvsnap_reference::ReferenceModel;

fn tiny() -> ReferenceModel {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("prompt-cache-tiny");
        write_model(&dir, Preset::Tiny, DEFAULT_SEED).expect("write tiny model");
        dir
    });
    ReferenceModel::load(dir).expect("load tiny model")
}

/// `n` deterministic ids in the tiny vocab, BOS first; `seed` picks the sequence.
fn ids(n: usize, seed: u32) -> Vec<u32> {
    let mut s = seed.wrapping_mul(2_654_435_761) | 1;
    std::iter::once(2)
        .chain((1..n).map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            3 + s % 509
        }))
        .collect()
}

/// Logits after extending a checked-out prefix by `turn`.
fn logits_after<M: KvModel>(model: &M, mut kv: M::Kv, turn: &[u32]) -> Vec<f32> {
    let next = model.extend(&mut kv, turn, Logits::Return).unwrap();
    next.logits.unwrap()
}

fn assert_close(got: &[f32], want: &[f32]) {
    let tol = Tolerance::LOGITS;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(tol.accepts(g as f64, w as f64), "logit {i}: {g} vs {w}");
    }
}

#[test]
fn miss_then_hit_serves_the_same_state_as_a_one_shot_prefill() {
    let model = tiny();
    let mut cache = PrefixCache::new(&model, u64::MAX).with_chunk(4);
    let prefix = ids(20, 1);
    let turn = ids(5, 2)[1..].to_vec();

    let first = cache.checkout(&prefix).unwrap();
    assert_eq!(first.lookup, Lookup::Miss);
    assert_eq!((first.prefix_len, first.prefilled), (20, 20));
    let from_miss = logits_after(&model, first.kv, &turn);

    let second = cache.checkout(&prefix).unwrap();
    assert_eq!(second.lookup, Lookup::Hit);
    assert_eq!((second.prefilled, second.prefill_s), (0, 0.0));
    let from_hit = logits_after(&model, second.kv, &turn);
    assert_eq!(
        from_hit, from_miss,
        "a hit restores exactly the cached state"
    );

    let whole: Vec<u32> = prefix.iter().chain(&turn).copied().collect();
    let (_, one_shot) = model.prefill(&whole, Logits::Return).unwrap();
    assert_close(&from_hit, &one_shot.logits.unwrap());

    let stats = cache.stats();
    assert_eq!(
        (stats.hits, stats.misses, stats.extended, stats.evictions),
        (1, 1, 0, 0)
    );
    assert_eq!((stats.prefilled_tokens, stats.reused_tokens), (20, 20));
    assert_eq!(stats.entries, 1);
    assert_eq!(stats.bytes, model.config().kv_bytes(20));
    assert!(stats.prefill_rate().unwrap() > 0.0);
}

#[test]
fn extending_a_checkout_never_changes_the_cached_prefix() {
    let model = tiny();
    let mut cache = PrefixCache::new(&model, u64::MAX);
    let prefix = ids(12, 3);
    let turn = vec![7, 8, 9];
    let reference = logits_after(&model, cache.checkout(&prefix).unwrap().kv, &turn);

    // Grow a checkout far past the tiny model's 6-token window, then check out again.
    let mut scribble = cache.checkout(&prefix).unwrap().kv;
    for id in ids(30, 4) {
        model.step(&mut scribble, id, Logits::Skip).unwrap();
    }
    let again = logits_after(&model, cache.checkout(&prefix).unwrap().kv, &turn);
    assert_eq!(again, reference);
}

#[test]
fn a_longer_prefix_extends_the_longest_cached_prefix_of_it() {
    let model = tiny();
    let mut cache = PrefixCache::new(&model, u64::MAX).with_chunk(3);
    let long = ids(24, 5);
    let turn = vec![40, 41];
    cache.checkout(&long[..8]).unwrap();
    cache.checkout(&long[..14]).unwrap(); // extends the 8-token entry
    let mut progress = Vec::new();
    let c = cache
        .checkout_with_progress(&long, &mut |p: PrefillProgress| progress.push(p))
        .unwrap();
    assert_eq!(c.lookup, Lookup::Extended { reused: 14 });
    assert_eq!(c.prefilled, 10);
    assert_eq!(
        progress.iter().map(|p| p.done).collect::<Vec<_>>(),
        [17, 20, 23, 24],
        "progress per 3-token chunk, counted over the whole prefix"
    );
    assert!(progress.iter().all(|p| p.total == 24));
    let extended = logits_after(&model, c.kv, &turn);

    let whole: Vec<u32> = long.iter().chain(&turn).copied().collect();
    let (_, one_shot) = model.prefill(&whole, Logits::Return).unwrap();
    assert_close(&extended, &one_shot.logits.unwrap());

    let s = cache.stats();
    assert_eq!((s.misses, s.extended, s.hits, s.entries), (1, 2, 0, 3));
    assert_eq!(s.prefilled_tokens, 24, "every token computed once");
    assert_eq!(s.reused_tokens, 8 + 14);
    assert_eq!(cache.checkout(&long).unwrap().lookup, Lookup::Hit);
}

#[test]
fn a_cached_prefix_that_only_shares_a_start_cannot_serve() {
    let model = tiny();
    let mut cache = PrefixCache::new(&model, u64::MAX);
    let a = ids(16, 6);
    let mut b = a[..10].to_vec();
    b.extend(ids(6, 7));
    cache.checkout(&a).unwrap();
    // No truncation in the contract: `a` is not a prefix of `b`, so `b` is a miss ...
    assert_eq!(cache.checkout(&b).unwrap().lookup, Lookup::Miss);
    // ... and neither is a shorter request a hit on a longer entry.
    assert_eq!(cache.checkout(&a[..10]).unwrap().lookup, Lookup::Miss);
}

#[test]
fn least_recently_used_entries_are_evicted_to_stay_within_the_budget() {
    let model = tiny();
    let n = 10;
    let entry = model.config().kv_bytes(n);
    let mut cache = PrefixCache::new(&model, 2 * entry + entry / 2);
    let (a, b, c) = (ids(n, 10), ids(n, 11), ids(n, 12));

    cache.checkout(&a).unwrap();
    cache.checkout(&b).unwrap();
    assert_eq!(cache.checkout(&a).unwrap().lookup, Lookup::Hit); // b is now least recent
    cache.checkout(&c).unwrap();

    assert!(cache.contains(&a) && cache.contains(&c) && !cache.contains(&b));
    let s = cache.stats();
    assert_eq!((s.evictions, s.entries, s.bytes), (1, 2, 2 * entry));
    assert!(s.bytes <= s.budget);
    assert_eq!(cache.cached_lengths(), [n, n]);

    // b comes back as a miss and pushes out a, now the least recent.
    assert_eq!(cache.checkout(&b).unwrap().lookup, Lookup::Miss);
    assert!(!cache.contains(&a) && cache.contains(&b) && cache.contains(&c));
    assert_eq!(cache.stats().evictions, 2);
}

#[test]
fn a_prefix_larger_than_the_budget_is_an_error_that_evicts_nothing() {
    let model = tiny();
    let small = ids(4, 13);
    let budget = model.config().kv_bytes(4);
    let mut cache = PrefixCache::new(&model, budget);
    cache.checkout(&small).unwrap();

    let big = ids(40, 14);
    match cache.checkout(&big) {
        Err(Error::Model(ModelError::KvBudget { adding, cap, .. })) => {
            assert_eq!(adding, model.config().kv_bytes(40));
            assert_eq!(cap, budget);
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a prefix over the budget was cached"),
    }
    assert!(cache.contains(&small));
    assert_eq!(cache.stats().evictions, 0);
    assert!(matches!(cache.checkout(&[]), Err(Error::EmptyPrefix)));
    // A token the model rejects leaves the cache as it was.
    assert!(matches!(
        cache.checkout(&[2, 9999]),
        Err(Error::Model(ModelError::TokenOutOfRange { .. }))
    ));
    assert_eq!(cache.stats().entries, 1);
}
