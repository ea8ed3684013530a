"""Datagen throughput: answers per hour and answer tokens/s of `verispec dspark datagen`, per
batch size and kernel plan, on the same prompts (issue #15: "the batched datagen at its best
measured throughput").

Each arm is one `verispec dspark datagen` run (in this process, through its CLI) into a fresh
file: the first `--prompts` ShareGPT prompts (every user turn, decontaminated, as datagen
takes them), DeepSpec's sampling settings, `--minutes` of submitting prompts, after which the
rows in flight finish (so a short window undercounts big batches a little: their last rows
finish at falling occupancy). The time of a run that submits nothing (`--max-minutes` 1e-9:
model load, kernel plan, prompt scan) is measured per plan and subtracted. Arms run in the
order given, each on the same prompts; the machine should be otherwise idle.

    .venv/bin/python bench/datagen_throughput.py                         # batch 16,32,64 x auto,onednn, 5 min each
    .venv/bin/python bench/datagen_throughput.py --batches 32 --kernels auto --minutes 2

Kernel plans: `auto` is what `verispec serve` runs (the measured plan, batch-invariant where it
can be); `onednn` PyTorch's kernels only. Prints a table, one JSON line, and the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

from verispec.allocator import keep_large_blocks

keep_large_blocks()  # as `verispec` does before torch loads: the arms run its CLI in this process
import torch  # noqa: E402


def run(argv: list[str]) -> float:
    from verispec.cli import main

    start = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    if code != 0:
        raise SystemExit(f"datagen failed ({code}): {' '.join(argv)}")
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default="smollm2-135m-instruct")
    ap.add_argument("--batches", default="16,32,64", help="rows decoded together (default 16,32,64)")
    ap.add_argument("--kernels", default="auto,onednn", help="kernel plans (default auto,onednn)")
    ap.add_argument("--minutes", type=float, default=5.0, help="minutes of submitting prompts per arm (default 5)")
    ap.add_argument("--prompts", type=int, default=2000, help="prompts available to each arm (default 2000)")
    ap.add_argument("--max-tokens", type=int, default=384, help="longest answer (datagen's default 384)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from verispec.models.kernel_plan import cpu_name
    from verispec.training.dspark.features import read_records

    batches = [int(b) for b in args.batches.split(",")]
    plans = [k.strip() for k in args.kernels.split(",") if k.strip()]
    common = ["dspark", "datagen", "-m", args.model, "--limit", str(args.prompts), "--max-tokens",
              str(args.max_tokens), "--threads", str(args.threads), "--quiet"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for plan in plans:
            setup = run([*common, "--kernels", plan, "--out", f"{tmp}/setup-{plan}.jsonl", "--max-minutes", "1e-9"])
            for batch in batches:
                out = Path(tmp) / f"{plan}-{batch}.jsonl"
                seconds = run([*common, "--kernels", plan, "--batch", str(batch), "--out", str(out),
                               "--max-minutes", str(args.minutes)]) - setup
                # datagen's own reader (lines end at "\n" only: an answer may hold U+2028); a
                # record left out for quoting an eval prompt has no answer to count
                records = [r for r in read_records(out, min_loss_tokens=0) if "answer_ids" in r]
                tokens = sum(len(r["answer_ids"]) for r in records)
                row = {"kernels": plan, "batch": batch, "answers": len(records), "tokens": tokens,
                       "seconds": round(seconds, 1), "answers_per_hour": round(len(records) * 3600 / seconds),
                       "tok_s": round(tokens / seconds, 1),
                       "mean_answer_tokens": round(tokens / max(1, len(records)), 1)}
                rows.append(row)
                print(f"  {plan:<7} batch {batch:>3}: {row['answers']} answers, {row['tok_s']} tok/s", file=sys.stderr)
    best = max(rows, key=lambda r: r["tok_s"])
    result = {"bench": "datagen_throughput", "model": args.model, "cpu": cpu_name(), "threads": args.threads,
              "minutes": args.minutes, "max_tokens": args.max_tokens, "rows": rows,
              "best": {"kernels": best["kernels"], "batch": best["batch"]}}
    if not args.json:
        print(f"{args.model}, {cpu_name()}, {args.threads} threads, {args.minutes:g} min of prompts per arm, "
              f"max {args.max_tokens} tokens, temperature 0.7 / top-p 0.8 / top-k 20")
        print(f"{'kernels':<8}{'batch':>6}{'answers':>9}{'tokens':>9}{'s':>8}{'answers/h':>11}{'tok/s':>8}{'mean len':>10}")
        for r in rows:
            mark = "  <- best" if r is best else ""
            print(f"{r['kernels']:<8}{r['batch']:>6}{r['answers']:>9}{r['tokens']:>9}{r['seconds']:>8.0f}"
                  f"{r['answers_per_hour']:>11}{r['tok_s']:>8.1f}{r['mean_answer_tokens']:>10.1f}{mark}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
