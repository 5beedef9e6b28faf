//! The isolation check every row runs: two live KV states (the witnesses) are opened before the
//! bad call and continued after it, and must produce bit-for-bit the tokens and logits of a run
//! without the bad call, on the same backend.

use std::sync::Arc;

use kvsnap_contract::{DynModel, Error, KvModel, Logits, Result, Session};

/// The witnesses' prompt: 20 tokens, past the tiny model's 6-token window.
pub const PREFIX: [u32; 20] = [
    2, 105, 17, 300, 4, 88, 511, 9, 42, 42, 0, 256, 128, 77, 1, 390, 6, 23, 460, 12,
];
/// What the witnesses append after the bad call.
pub const UTTERANCE: [u32; 5] = [33, 101, 7, 250, 64];

/// Handles of the two witness states: `a` (the prefix) and `b` (a snapshot of `a`, one step
/// further).
#[derive(Clone, Copy, Debug)]
pub struct Witness {
    /// `prefill(PREFIX)`.
    pub a: u64,
    /// `snapshot(a)` then `step(17)`.
    pub b: u64,
}

/// One observed result: the token and the bits of its logits.
pub type Observation = (u32, Vec<u32>);

/// Opens the witnesses in `s`.
pub fn open(s: &dyn DynModel) -> Result<Witness> {
    let (a, _) = s.prefill(&PREFIX, Logits::Skip)?;
    let b = s.snapshot(a)?;
    s.step(b, 17, Logits::Skip)?;
    Ok(Witness { a, b })
}

/// Continues the witnesses (an extend and greedy steps on both, a snapshot stepped once and
/// released) and returns everything they produced.
pub fn finish(s: &dyn DynModel, w: Witness) -> Result<Vec<Observation>> {
    let observe = |next: kvsnap_contract::Next| {
        let bits = next
            .logits
            .expect("logits were asked for")
            .iter()
            .map(|v| v.to_bits())
            .collect();
        (next.token, bits)
    };
    let mut out = vec![observe(s.extend(w.a, &UTTERANCE, Logits::Return)?)];
    for h in [w.a, w.b] {
        for _ in 0..3 {
            let last = out.last().map_or(0, |o| o.0);
            out.push(observe(s.step(h, last, Logits::Return)?));
        }
    }
    let c = s.snapshot(w.a)?;
    out.push(observe(s.step(c, 5, Logits::Return)?));
    s.release(c)?;
    Ok(out)
}

/// What the witnesses produce without any bad call.
pub fn baseline<M: KvModel>(model: &Arc<M>) -> Vec<Observation> {
    let s = Session::from_arc(Arc::clone(model));
    let w = open(&s).expect("opening the witnesses");
    finish(&s, w).expect("continuing the witnesses")
}

/// Runs `bad` between opening and continuing the witnesses in a fresh session over `model`,
/// and checks that it left the session's live states, their KV bytes and lengths unchanged,
/// and that the witnesses then produce exactly [`baseline`].
pub fn isolated<M: KvModel>(model: &Arc<M>, bad: impl FnOnce(&Session<M>, Witness)) {
    let want = baseline(model);
    let s = Session::from_arc(Arc::clone(model));
    let w = open(&s).expect("opening the witnesses");
    let state = |s: &Session<M>| {
        (
            s.live(),
            s.live_kv_bytes(),
            s.len(w.a).expect("witness a is live"),
            s.len(w.b).expect("witness b is live"),
        )
    };
    let before = state(&s);
    bad(&s, w);
    assert_eq!(
        state(&s),
        before,
        "(live states, live KV bytes, len a, len b) changed across the bad call"
    );
    let got = finish(&s, w).expect("continuing the witnesses after the bad call");
    assert!(
        got == want,
        "the witnesses diverged after the bad call: tokens {:?}, expected {:?}",
        got.iter().map(|o| o.0).collect::<Vec<_>>(),
        want.iter().map(|o| o.0).collect::<Vec<_>>()
    );
}

/// Checks that `result` failed with an error of `kind` whose message contains every one of
/// `fragments`, and returns the error.
#[track_caller]
pub fn expect_err<T: std::fmt::Debug>(result: Result<T>, kind: &str, fragments: &[&str]) -> Error {
    let e = match result {
        Ok(v) => panic!("expected a `{kind}` error, got Ok({v:?})"),
        Err(e) => e,
    };
    let msg = e.to_string();
    assert_eq!(e.kind(), kind, "wrong error kind: {msg}");
    for f in fragments {
        assert!(msg.contains(f), "`{msg}` does not mention `{f}`");
    }
    e
}
