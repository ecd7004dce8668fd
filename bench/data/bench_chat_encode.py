"""Records/s of ``Encoder.encode`` on generated conversations, against transformers' own path.

Run from the repository root (no Ray)::

    python bench/data/bench_chat_encode.py [--n 10000] [--rounds 3] [--max-exchanges 6] [--json OUT]

Builds the tiny chat tokenizers of ``ray_trainer._demo.chat`` (ChatML and Llama-3 styles, with
and without ``{% generation %}`` markers), generates ``--n`` conversations (an optional system
message, 1 to ``--max-exchanges`` user/assistant exchanges) and times each case in interleaved
rounds (median), as records per CPU-second of this one process (``time.process_time``: other
jobs on a shared machine move it less than wall time):

- ``encode``: ``Encoder(train_on="assistant").encode(record, "messages")``: render, tokenize,
  locate every assistant turn, labels;
- ``hf``: ``tokenizer.apply_chat_template(messages, return_dict=True)``: render and tokenize
  only, no mask (the baseline; the ratio is encode's records/s over hf's);
- ``hf+mask``: the same with ``return_assistant_tokens_mask=True`` (templates with markers only:
  without them transformers returns an all-zero mask).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from ray_trainer._data.encode import Encoder
from ray_trainer._demo.chat import chat_conversations, make_tiny_chat_tokenizer


def _time(fn, items) -> float:
    """Records per CPU-second of this process: steadier than wall time on a shared machine
    (everything timed runs on one thread)."""
    start = time.process_time()
    for item in items:
        fn(item)
    return len(items) / (time.process_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-exchanges", type=int, default=6, help="user/assistant pairs")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()

    conversations = chat_conversations(opts.n, seed=1, max_exchanges=opts.max_exchanges)
    records = [{"messages": c} for c in conversations]
    rows = []
    for style in ("chatml", "llama3"):
        for markers in (False, True):
            tok = make_tiny_chat_tokenizer(style, markers)
            enc = Encoder(tok, train_on="assistant", max_length=4096)
            sample = records[:1000]
            tokens = sum(len(enc.encode(r, "messages").input_ids) for r in sample) / len(sample)
            cases = {
                "encode": lambda r, enc=enc: enc.encode(r, "messages"),
                "hf": lambda r, tok=tok: tok.apply_chat_template(r["messages"], return_dict=True),
            }
            if markers:
                cases["hf+mask"] = lambda r, tok=tok: tok.apply_chat_template(
                    r["messages"], return_dict=True, return_assistant_tokens_mask=True
                )
            rates: dict[str, list[float]] = {k: [] for k in cases}
            for _ in range(opts.rounds):
                for name, fn in cases.items():
                    rates[name].append(_time(fn, records))
            med = {k: statistics.median(v) for k, v in rates.items()}
            rows.append(
                {
                    "template": f"{style}{' + generation markers' if markers else ''}",
                    "tokens_per_record": tokens,
                    **{f"{k}_records_per_s": round(v) for k, v in med.items()},
                    "ratio_to_hf": round(med["encode"] / med["hf"], 2),
                }
            )
    print(f"{opts.n} conversations, median of {opts.rounds} rounds, records per CPU-second")
    print(
        f"{'template':34} {'tok/rec':>8} {'encode/s':>9} {'hf/s':>7} {'hf+mask/s':>9} {'ratio':>6}"
    )
    for r in rows:
        mask = r.get("hf+mask_records_per_s", "-")
        print(
            f"{r['template']:34} {r['tokens_per_record']:8.0f} {r['encode_records_per_s']:9} "
            f"{r['hf_records_per_s']:7} {mask:>9} {r['ratio_to_hf']:6.2f}"
        )
    if opts.json:
        Path(opts.json).write_text(json.dumps({"n": opts.n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
