//! One turn: a snapshot of the cached prefix, one `extend` by the utterance's tokens, greedy
//! `step`s until a stopping rule fires.

use std::time::Instant;

use kvsnap_contract::{KvModel, Logits};

use crate::cache::{Lookup, PrefillProgress, PrefixCache};
use crate::error::Result;
use crate::stop::{StopReason, StopRules};

/// Where the time of one turn went.
#[derive(Clone, Debug, PartialEq)]
pub struct TurnTimings {
    /// How the prefix was found in the cache.
    pub lookup: Lookup,
    /// Prefix tokens computed for this turn (0 on a cache hit).
    pub prefix_prefilled: usize,
    /// Seconds spent computing them: a one-time cost, not part of [`TurnTimings::latency_s`].
    pub prefix_prefill_s: f64,
    /// Seconds to copy the cached prefix state.
    pub restore_s: f64,
    /// Seconds of the `extend` by the turn's tokens.
    pub extend_s: f64,
    /// `step` calls (one fewer than the generated tokens: `extend` yields the first).
    pub steps: usize,
    /// Seconds of those steps.
    pub decode_s: f64,
}

impl TurnTimings {
    /// Seconds the turn took once its prefix was cached: restore + extend + steps.
    pub fn latency_s(&self) -> f64 {
        self.restore_s + self.extend_s + self.decode_s
    }
}

/// The result of one turn.
#[derive(Clone, Debug, PartialEq)]
pub struct Turn {
    /// Tokens of the prefix.
    pub prefix_len: usize,
    /// Tokens of the turn (utterance and its markers) after the prefix.
    pub turn_len: usize,
    /// Generated ids, the stop token included.
    pub generated: Vec<u32>,
    /// Their decoded text.
    pub text: String,
    /// Why generation stopped.
    pub stop: StopReason,
    /// Where the time went.
    pub timings: TurnTimings,
}

impl Turn {
    /// Tokens of the whole prompt (prefix and turn).
    pub fn prompt_len(&self) -> usize {
        self.prefix_len + self.turn_len
    }
}

/// Serves one turn: `prefix` from `cache`, then `turn`, then greedy decoding under `rules`.
/// `decode` turns generated ids into text for the text rules and the result.
pub fn run_turn<M: KvModel>(
    cache: &mut PrefixCache<'_, M>,
    prefix: &[u32],
    turn: &[u32],
    rules: &StopRules,
    decode: &dyn Fn(&[u32]) -> Result<String>,
    progress: &mut dyn FnMut(PrefillProgress),
) -> Result<Turn> {
    let model = cache.model();
    let checkout = cache.checkout_with_progress(prefix, progress)?;
    let mut kv = checkout.kv;

    let t = Instant::now();
    let mut next = model.extend(&mut kv, turn, Logits::Skip)?;
    let extend_s = t.elapsed().as_secs_f64();

    let t = Instant::now();
    let mut generated = Vec::new();
    let mut steps = 0;
    let (text, stop) = loop {
        generated.push(next.token);
        let text = decode(&generated)?;
        if let Some(stop) = rules.check(&generated, &text) {
            break (text, stop);
        }
        next = model.step(&mut kv, next.token, Logits::Skip)?;
        steps += 1;
    };
    let decode_s = t.elapsed().as_secs_f64();
    model.release(kv)?;

    Ok(Turn {
        prefix_len: prefix.len(),
        turn_len: turn.len(),
        generated,
        text,
        stop,
        timings: TurnTimings {
            lookup: checkout.lookup,
            prefix_prefilled: checkout.prefilled,
            prefix_prefill_s: checkout.prefill_s,
            restore_s: checkout.restore_s,
            extend_s,
            steps,
            decode_s,
        },
    })
}

/// Estimated seconds the stateless contract (`step(ids) -> id`, no KV kept) would need for the
/// same output: each of the `generated` tokens re-prefills the whole sequence before it
/// (`prompt_len`, `prompt_len + 1`, ... tokens) at `prefill_rate` tokens per second.
///
/// An estimate: it assumes the measured prefill rate holds at every length.
pub fn stateless_estimate_s(prompt_len: usize, generated: usize, prefill_rate: f64) -> f64 {
    (0..generated)
        .map(|s| (prompt_len + s) as f64 / prefill_rate)
        .sum()
}
