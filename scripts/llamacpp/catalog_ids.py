"""Splits a golden case's prompt as `kvsnap bench catalog` does, for the llama.cpp baseline.

Writes OUT/prefix.ids (everything before the second-to-last <start_of_turn>), OUT/utterance.ids
(the rest of the prompt) and OUT/greedy.ids (the oracle's greedy continuation), one id a line.

    python catalog_ids.py GOLDENS.json CASE OUT
"""

import json
import sys

START_OF_TURN = 105


def main(goldens: str, case_name: str, out: str) -> None:
    with open(goldens) as f:
        cases = json.load(f)["cases"]
    case = next((c for c in cases if c["name"] == case_name), None)
    if case is None:
        sys.exit(f"catalog_ids: no case `{case_name}` in {goldens}")
    ids = case["ids"]
    starts = [i for i, t in enumerate(ids) if t == START_OF_TURN]
    if len(starts) < 2:
        sys.exit(f"catalog_ids: case `{case_name}` has no user turn after a prefix")
    split = starts[-2]
    for name, values in [
        ("prefix", ids[:split]),
        ("utterance", ids[split:]),
        ("greedy", case["greedy"]),
    ]:
        with open(f"{out}/{name}.ids", "w") as f:
            f.write("\n".join(map(str, values)) + "\n")
    print(f"catalog_ids: `{case_name}`: {split}-token prefix, {len(ids) - split}-token utterance",
          file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: catalog_ids.py GOLDENS.json CASE OUT")
    main(*sys.argv[1:])
