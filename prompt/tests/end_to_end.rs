//! The whole turn flow with a real forward pass: on the tiny model (cache, extend, greedy steps
//! and every stopping rule, against a plain prefill-and-step decode), and on the real model
//! through [`ToolCaller`] against the oracle's greedy tokens of the `catalog_tv` golden.

mod common;

use std::path::PathBuf;

use kvsnap_contract::{KvModel, Logits, Tolerance};
use kvsnap_prompt::{
    run_turn, stateless_estimate_s, Catalog, Lookup, PrefixCache, StopReason, StopRules, Tokenizer,
    ToolCaller,
};
use kvsnap_reference::tiny::{write_model, Preset, DEFAULT_SEED};
use kvsnap_reference::ReferenceModel;

fn tiny() -> ReferenceModel {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("prompt-e2e-tiny");
        write_model(&dir, Preset::Tiny, DEFAULT_SEED).expect("write tiny model");
        dir
    });
    ReferenceModel::load(dir).expect("load tiny model")
}

const PREFIX: [u32; 14] = [2, 105, 17, 301, 44, 90, 7, 260, 13, 88, 499, 5, 61, 200];
const TURN: [u32; 6] = [106, 105, 33, 150, 106, 105];

/// Greedy decode of `n` tokens without any cache: prefill everything, then step.
fn plain_greedy(model: &ReferenceModel, n: usize) -> Vec<u32> {
    let whole: Vec<u32> = PREFIX.iter().chain(&TURN).copied().collect();
    let (mut kv, mut next) = model.prefill(&whole, Logits::Skip).unwrap();
    let mut out = vec![next.token];
    while out.len() < n {
        next = model.step(&mut kv, next.token, Logits::Skip).unwrap();
        out.push(next.token);
    }
    out
}

fn no_stops(max_new_tokens: usize) -> StopRules {
    StopRules {
        end_of_turn: None,
        eos: vec![],
        end_function_call: true,
        max_new_tokens,
    }
}

fn text_of(ids: &[u32]) -> kvsnap_prompt::Result<String> {
    Ok(ids.iter().map(|i| format!("t{i} ")).collect())
}

/// The first index whose token did not occur before it (so a rule on it fires there first).
fn first_new(tokens: &[u32], from: usize) -> usize {
    (from..tokens.len())
        .find(|&k| !tokens[..k].contains(&tokens[k]))
        .expect("the greedy decode has a fresh token")
}

#[test]
fn turns_decode_like_a_plain_greedy_run_and_stop_at_each_rule() {
    let model = tiny();
    let greedy = plain_greedy(&model, 12);
    let mut cache = PrefixCache::new(&model, u64::MAX).with_chunk(5);
    let none = &mut |_| {};

    // The token limit, on a cold cache.
    let t = run_turn(&mut cache, &PREFIX, &TURN, &no_stops(12), &text_of, none).unwrap();
    assert_eq!(t.generated, greedy);
    assert_eq!(t.stop, StopReason::MaxNewTokens(12));
    assert_eq!(t.text, text_of(&greedy).unwrap());
    assert_eq!((t.prefix_len, t.turn_len, t.prompt_len()), (14, 6, 20));
    assert_eq!(t.timings.lookup, Lookup::Miss);
    assert_eq!(t.timings.prefix_prefilled, 14);
    assert_eq!(t.timings.steps, 11, "extend yields the first token");

    // <end_of_turn> by id, served from the cached prefix.
    let k = first_new(&greedy, 2);
    let rules = StopRules {
        end_of_turn: Some(greedy[k]),
        ..no_stops(12)
    };
    let t = run_turn(&mut cache, &PREFIX, &TURN, &rules, &text_of, none).unwrap();
    assert_eq!(t.timings.lookup, Lookup::Hit);
    assert_eq!(t.timings.prefix_prefilled, 0);
    assert_eq!(t.generated, greedy[..=k]);
    assert_eq!(t.stop, StopReason::EndOfTurn);

    // An EOS id of the config.
    let rules = StopRules {
        eos: vec![greedy[k]],
        ..no_stops(12)
    };
    let t = run_turn(&mut cache, &PREFIX, &TURN, &rules, &text_of, none).unwrap();
    assert_eq!(
        (t.generated.len(), t.stop),
        (k + 1, StopReason::Eos(greedy[k]))
    );

    // <end_function_call> in the decoded text, spelled by the tokens at positions j and j + 1.
    let j = 3;
    let spell = move |ids: &[u32]| -> kvsnap_prompt::Result<String> {
        Ok(ids
            .iter()
            .enumerate()
            .map(|(p, &i)| match p {
                _ if p == j => "}<end_function".to_string(),
                _ if p == j + 1 => "_call>".to_string(),
                _ => format!("t{i}"),
            })
            .collect())
    };
    let t = run_turn(&mut cache, &PREFIX, &TURN, &no_stops(12), &spell, none).unwrap();
    assert_eq!(t.stop, StopReason::EndFunctionCall);
    assert_eq!(t.generated, greedy[..=j + 1]);

    let s = cache.stats();
    assert_eq!((s.misses, s.hits, s.entries), (1, 3, 1));
}

#[test]
fn a_turn_that_runs_past_the_context_is_an_error_not_a_silent_stop() {
    let model = tiny();
    let cap = model.config().context_capacity;
    let mut cache = PrefixCache::new(&model, u64::MAX);
    let r = run_turn(
        &mut cache,
        &PREFIX,
        &TURN,
        &no_stops(cap),
        &text_of,
        &mut |_| {},
    );
    let e = r.expect_err("the context overflows").to_string();
    assert!(e.contains("context overflow"), "{e}");
}

#[test]
fn the_stateless_estimate_sums_every_re_prefill() {
    // 3 tokens after a 10-token prompt at 10 tok/s: 1.0 + 1.1 + 1.2 s.
    assert!((stateless_estimate_s(10, 3, 10.0) - 3.3).abs() < 1e-12);
    assert_eq!(stateless_estimate_s(10, 0, 10.0), 0.0);
}

/// The real model behind `ToolCaller`: the golden `catalog_tv` prompt, served from the cached
/// catalog prefix, decodes the oracle's greedy tokens (up to the first near-tie) until a rule
/// stops it, and a second utterance is a cache hit.
#[test]
fn real_model_tool_caller_follows_the_oracle_on_catalog_tv() {
    let Some(dir) = common::real_model_with("real-model ToolCaller", "model.safetensors") else {
        return;
    };
    let case = common::golden_case("catalog_tv");
    let ids: Vec<u32> = case["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let greedy: Vec<u32> = case["greedy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let margins: Vec<f64> = case["positions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["margin"].as_f64().unwrap())
        .collect();

    let model = ReferenceModel::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let catalog =
        Catalog::from_file(&common::manifest_dir().join("../examples/tv-catalog.json")).unwrap();
    let mut caller = ToolCaller::new(&model, tokenizer, 256 << 20, greedy.len()).unwrap();
    let out = caller
        .call(
            &catalog,
            "turn the living room lights on and set the volume to 20",
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(out.turn.prompt_len(), ids.len());
    assert_eq!(out.turn.timings.lookup, Lookup::Miss);

    let tol = Tolerance::LOGITS;
    for (s, (&got, &want)) in out.turn.generated.iter().zip(&greedy).enumerate() {
        if margins[ids.len() - 1 + s] <= 2.0 * tol.abs {
            break; // a near-tie: float32 may pick either, and everything after may differ
        }
        assert_eq!(got, want, "generated token {s}");
    }
    match out.turn.stop {
        StopReason::MaxNewTokens(n) => assert_eq!(out.turn.generated.len(), n),
        _ => assert!(out.turn.generated.len() <= greedy.len()),
    }
    if let Err(why) = &out.call {
        // The base model is not tuned for function calling: say why, never panic.
        assert!(!why.to_string().is_empty());
    }

    let again = caller
        .call(&catalog, "switch to channel 7", &mut |_| {})
        .unwrap();
    assert_eq!(again.turn.timings.lookup, Lookup::Hit);
    assert_eq!(caller.cache().stats().misses, 1);

    // A catalog that appends a function extends the cached catalog's snapshot: the base
    // tokenizer spells the markers with several tokens, and only the last one is held back.
    assert_eq!(caller.held_back(), 1);
    let (key, _) = caller.prefix_ids(&catalog).unwrap();
    let mut more = catalog.clone();
    more.functions.push(catalog.functions[0].clone());
    more.functions.last_mut().unwrap().name = "set_volume_again".into();
    let out = caller.call(&more, "mute", &mut |_| {}).unwrap();
    assert_eq!(
        out.turn.timings.lookup,
        Lookup::Extended { reused: key.len() }
    );
    // The split moves tokens between key and turn but the sequence is the whole prompt's.
    let tok = caller.tokenizer();
    let whole = tok
        .encode_with_bos(&kvsnap_prompt::render::prompt(&more, "mute").unwrap())
        .unwrap();
    assert_eq!(out.turn.prompt_len(), whole.len());
}
