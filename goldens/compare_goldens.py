#!/usr/bin/env python3
"""Compares two kvsnap golden sets case by case (standard library only).

    compare_goldens.py NEW.json REFERENCE.json [--tol 1e-9]

Cases are matched by name; REFERENCE may hold more cases than NEW. For each case: ids, greedy,
greedy_matches_nocache_argmax and the top-k ids must be identical, and the largest difference of
top-k logits and lse is reported. Exits 1 when a structure differs or a difference exceeds --tol.
Used to check that make_goldens.py reproduces an existing set (see README.md).
"""

import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("new")
    ap.add_argument("reference")
    ap.add_argument("--tol", type=float, default=1e-9, help="largest accepted abs difference")
    args = ap.parse_args()
    new = json.load(open(args.new))
    ref = json.load(open(args.reference))
    for g in (new, ref):
        if (g.get("format"), g.get("version")) != ("kvsnap-goldens", 1):
            sys.exit("not a kvsnap-goldens version 1 file (see shared/goldens/FORMAT.md)")
    by_name = {c["name"]: c for c in ref["cases"]}
    ok = True
    worst_all = 0.0
    for c in new["cases"]:
        r = by_name.get(c["name"])
        if r is None:
            print(f"{c['name']}: not in {args.reference}")
            ok = False
            continue
        problems = [
            key
            for key in ("ids", "greedy", "greedy_matches_nocache_argmax")
            if c[key] != r[key]
        ]
        if len(c["positions"]) != len(r["positions"]):
            problems.append("number of positions")
        worst, worst_pos = 0.0, None
        for p, q in zip(c["positions"], r["positions"]):
            if [t[0] for t in p["top"]] != [t[0] for t in q["top"]]:
                problems.append(f"top-k ids at pos {p['pos']}")
                continue
            d = max([abs(a[1] - b[1]) for a, b in zip(p["top"], q["top"])] + [abs(p["lse"] - q["lse"])])
            if d > worst:
                worst, worst_pos = d, p["pos"]
        worst_all = max(worst_all, worst)
        ok &= not problems and worst <= args.tol
        status = "differs: " + ", ".join(problems) if problems else "same structure"
        print(f"{c['name']}: {status}; max abs diff {worst:.3g} (pos {worst_pos})")
    print(f"max abs diff over all cases: {worst_all:.3g} (tolerance {args.tol:g})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
