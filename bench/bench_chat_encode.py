"""Records/s of ``Encoder.encode`` on generated conversations, against transformers' own path.

Run from the repository root (no Ray)::

    python bench/bench_chat_encode.py [--n 10000] [--rounds 3] [--json OUT]

Builds the tiny chat models of ``ray_trainer._demo.chat`` (ChatML and Llama-3 styles, with and
without ``{% generation %}`` markers), generates ``--n`` conversations (an optional system
message, 1 to 6 exchanges) and times, on one core, in interleaved rounds (median):

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
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from ray_trainer._data.encode import Encoder
from ray_trainer._demo.chat import chat_conversations, make_tiny_chat_model


def _time(fn, items) -> float:
    start = time.perf_counter()
    for item in items:
        fn(item)
    return len(items) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()

    import transformers

    conversations = chat_conversations(opts.n, seed=1, max_exchanges=6)
    records = [{"messages": c} for c in conversations]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for style in ("chatml", "llama3"):
            for markers in (False, True):
                path = make_tiny_chat_model(Path(tmp) / f"{style}-{markers}", style, markers)
                tok = transformers.AutoTokenizer.from_pretrained(path)
                enc = Encoder(tok, train_on="assistant", max_length=4096)
                tokens = sum(len(enc.encode(r, "messages").input_ids) for r in records[:1000])
                cases = {
                    "encode": lambda r, enc=enc: enc.encode(r, "messages"),
                    "hf": lambda r, tok=tok: tok.apply_chat_template(
                        r["messages"], return_dict=True
                    ),
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
                        "tokens_per_record": tokens / 1000,
                        **{f"{k}_records_per_s": round(v) for k, v in med.items()},
                        "ratio_to_hf": round(med["encode"] / med["hf"], 2),
                    }
                )
    print(f"{opts.n} conversations, median of {opts.rounds} rounds, one process")
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
