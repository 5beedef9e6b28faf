#!/usr/bin/env python3
"""Writes a kvsnap golden set (format "kvsnap-goldens", version 1) from a Hugging Face Gemma 3 model.

The oracle is transformers' Gemma3ForCausalLM with eager attention, loaded with dtype float64 from the
float32 checkpoint: matmuls, residuals and the embedding scale are float64, while transformers itself
keeps RMSNorm, the RoPE tables and the attention softmax in float32.
The same cases are also run in plain float32 to record how far float32 drifts (`calibration`).

Run by hand; torch never runs in CI. See goldens/README.md for the environment and the exact
commands that produced the committed files.

Cases come from a JSON file (a list of {"name", "text"?, "ids"?}; "text" needs --tokenizer) or are
synthesised (--synthetic LEN,LEN,...): BOS followed by random ids from a splitmix64 stream, so the
same --seed always gives the same ids whatever the Python version.
"""

import argparse
import hashlib
import json
import math
import os
import sys

import numpy as np
import torch
import transformers
from transformers import Gemma3ForCausalLM

FORMAT = "kvsnap-goldens"
VERSION = 1
SEMANTICS = (
    "positions[p] holds the logits that predict token p+1 of ids+greedy; lse is log-sum-exp over "
    "the whole vocabulary; greedy is the oracle's cached greedy decode of {n} tokens (no EOS stop)"
)
# Rows of logits computed at once: bounds memory for long cases on a 262144-token vocabulary.
LOGIT_CHUNK = 64


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model dir (config.json + model.safetensors)")
    ap.add_argument("--out", required=True, help="golden JSON to write")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--cases", help='JSON list of {"name", "text"?, "ids"?}')
    src.add_argument("--synthetic", help="comma-separated prompt lengths of random-id cases")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic ids")
    ap.add_argument("--tokenizer", help="tokenizer.json for cases given as text")
    ap.add_argument("--model-desc", required=True, help="the `model` field: which weights, from where")
    ap.add_argument("--greedy", type=int, default=16, help="greedy tokens per case")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return ap.parse_args()


def splitmix64(state):
    """One splitmix64 step: returns (new state, 64-bit output)."""
    mask = (1 << 64) - 1
    state = (state + 0x9E3779B97F4A7C15) & mask
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return state, z ^ (z >> 31)


def synthetic_cases(lengths, seed, vocab, bos):
    """BOS then random ids in [3, vocab) (0..2 are pad/eos/bos in Gemma's vocabulary)."""
    cases = []
    state = seed
    for n in lengths:
        ids = [bos]
        for _ in range(n - 1):
            state, r = splitmix64(state)
            ids.append(3 + r % (vocab - 3))
        cases.append({"name": f"random_{n}", "text": "", "ids": ids})
    return cases


def load_cases(args, config):
    if args.synthetic:
        lengths = [int(x) for x in args.synthetic.split(",")]
        return synthetic_cases(lengths, args.seed, config.vocab_size, config.bos_token_id)
    with open(args.cases) as f:
        cases = json.load(f)
    tok = None
    for case in cases:
        if "ids" in case:
            case.setdefault("text", "")
            continue
        if tok is None:
            if not args.tokenizer:
                sys.exit(f"case {case['name']} has only text: pass --tokenizer")
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(args.tokenizer)
        ids = tok.encode(case["text"], add_special_tokens=False).ids
        case["ids"] = [config.bos_token_id] + ids
    return cases


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def logits_rows(model, hidden, start, end):
    """Gemma3ForCausalLM.forward's head on rows start..end of the last hidden state."""
    logits = model.lm_head(hidden[:, start:end])
    cap = model.config.final_logit_softcapping
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits[0]


@torch.no_grad()
def all_logits(model, ids, top_k, gather=None):
    """No-cache forward over `ids`, one row of logits per position.

    Returns per position (top-k ids, their logits, lse, argmax), or, with `gather` (a list of id
    lists, one per position), the logits of those ids. Logit rows are never all kept at once.
    """
    x = torch.tensor([ids])
    hidden = model.model(input_ids=x, use_cache=False).last_hidden_state
    out = []
    for start in range(0, len(ids), LOGIT_CHUNK):
        logits = logits_rows(model, hidden, start, min(start + LOGIT_CHUNK, len(ids)))
        if gather is not None:
            for r in range(logits.shape[0]):
                out.append([float(logits[r, i]) for i in gather[start + r]])
            continue
        vals, idx = torch.topk(logits, top_k, dim=-1)
        lse = torch.logsumexp(logits, dim=-1)
        arg = torch.argmax(logits, dim=-1)
        for r in range(logits.shape[0]):
            out.append((idx[r].tolist(), vals[r].tolist(), float(lse[r]), int(arg[r])))
    return out


@torch.no_grad()
def cached_greedy(model, ids, n):
    """Prefill `ids` with a KV cache, then decode `n` tokens one step at a time (no EOS stop)."""
    out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    greedy = []
    for i in range(n):
        nxt = int(torch.argmax(out.logits[0, -1]))
        greedy.append(nxt)
        if i + 1 < n:
            out = model(
                input_ids=torch.tensor([[nxt]]),
                past_key_values=out.past_key_values,
                use_cache=True,
                logits_to_keep=1,
            )
    return greedy


def load_model(path, dtype):
    # Loading straight into float64 (rather than loading float32 and casting) matters: the
    # embedding scale buffer is then sqrt(hidden) in float64, not float32's rounding of it, which
    # moves logits by ~5e-6. The visible set was produced this way (agreement ~4e-15).
    model = Gemma3ForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return model.eval()


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    m64 = load_model(args.model, torch.float64)
    m32 = load_model(args.model, torch.float32)
    config = m64.config
    cases = load_cases(args, config)
    k = args.top_k

    out_cases = []
    diffs = []
    for case in cases:
        ids = [int(t) for t in case["ids"]]
        if not ids or ids[0] != config.bos_token_id:
            sys.exit(f"case {case['name']}: ids must start with BOS {config.bos_token_id}")
        if len(ids) + args.greedy > config.max_position_embeddings:
            sys.exit(f"case {case['name']}: {len(ids)} + {args.greedy} tokens exceed max_position_embeddings")
        greedy = cached_greedy(m64, ids, args.greedy)
        full = ids + greedy
        rows = all_logits(m64, full, k)
        rows32 = all_logits(m32, full, k, gather=[r[0] for r in rows])
        p0 = len(ids) - 1
        matches = all(rows[p0 + i][3] == g for i, g in enumerate(greedy))
        positions = []
        for p, ((top_ids, top_vals, lse, _), vals32) in enumerate(zip(rows, rows32)):
            positions.append(
                {
                    "pos": p,
                    "top": [[i, v] for i, v in zip(top_ids, top_vals)],
                    "lse": lse,
                    "margin": top_vals[0] - top_vals[1],
                }
            )
            diffs.extend(abs(a - b) for a, b in zip(vals32, top_vals))
        out_cases.append(
            {
                "name": case["name"],
                "text": case.get("text", ""),
                "ids": ids,
                "greedy": greedy,
                "greedy_matches_nocache_argmax": matches,
                "positions": positions,
            }
        )
        margins = sorted(p["margin"] for p in positions)
        print(
            f"{case['name']}: {len(ids)} ids, greedy {greedy}, nocache match {matches}, "
            f"smallest margins {[round(m, 4) for m in margins[:3]]}",
            file=sys.stderr,
        )

    weights = os.path.join(args.model, "model.safetensors")
    golden = {
        "format": FORMAT,
        "version": VERSION,
        "model": args.model_desc,
        "model_sha256": sha256_file(weights),
        "oracle": {
            "library": f"transformers {transformers.__version__}",
            "torch": torch.__version__,
            "dtype": "float64 compute on the float32 weights",
            "attention": "eager",
            "note": "Gemma3RMSNorm and RoPE tables are computed in float32 inside transformers",
        },
        "top_k": k,
        "semantics": SEMANTICS.format(n=args.greedy),
        "calibration": {
            "float32_vs_float64_max_abs_topk_logit_diff": float(np.max(diffs)),
            "float32_vs_float64_p99_abs_topk_logit_diff": float(np.percentile(diffs, 99)),
        },
        "cases": out_cases,
    }
    tmp = args.out + ".partial"
    with open(tmp, "w") as f:
        json.dump(golden, f, separators=(",", ":"), allow_nan=False)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {len(out_cases)} cases, calibration {golden['calibration']}", file=sys.stderr)


if __name__ == "__main__":
    main()
