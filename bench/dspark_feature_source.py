"""Where a drafter's training features should come from (issue #15, stage 3): the disk cache
(`dspark features` once, then `train --features`), a smaller cache (fewer taps), or the target
on the fly (`train --data`: one target forward per sequence per epoch, nothing on disk).

On the first `--sequences` records of a datagen file or pack, each source trains `--steps`
optimizer steps of `--batch` sequences with `dspark train`'s defaults, in this process through
the CLI. Measured per source: the cache build (seconds, bytes per token), training tokens/s,
and, from those, the CPU hours and disk a campaign of `--campaign-sequences` x `--epochs` would
take. The full cache and on-the-fly train the same samples (tests/test_dspark_train.py checks
bit-identical weights), so their tau per CPU hour differs by the time ratio alone; the smaller
cache's taps change the drafter, so its held-out teacher-forced tau at the same steps is
reported beside the full cache's (a short run: read it as a direction, the scaling curve is the
measurement).

    .venv/bin/python bench/dspark_feature_source.py --data data/dspark/smollm2-135m-instruct/regenerated.pack.xz
    .venv/bin/python bench/dspark_feature_source.py --data work/answers.jsonl --sequences 200 --steps 40

Prints a table, one JSON line, and the CPU. The machine should be otherwise idle.
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

import torch


def cli(argv: list[str]) -> float:
    from verispec.cli import main

    start = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(argv)
    if code != 0:
        raise SystemExit(f"failed ({code}): {' '.join(argv)}\n{err.getvalue()[-2000:]}")
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="datagen JSONL or pack")
    ap.add_argument("--model", "-m", default="smollm2-135m-instruct")
    ap.add_argument("--sequences", type=int, default=240, help="records used (default 240)")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per source (default 30)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--holdout", type=int, default=16, help="held-out sequences for validation tau (default 16)")
    ap.add_argument("--small-taps", default=None,
                    help="the smaller cache's taps (default: the first, middle and last of the default five)")
    ap.add_argument("--campaign-sequences", type=int, default=10000, help="for the projection (default 10000)")
    ap.add_argument("--epochs", type=int, default=8, help="for the projection (default 8, train's default)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from verispec.models.kernel_plan import cpu_name
    from verispec.models.loader import load_model, resolve_dtype
    from verispec.training.dspark.features import default_taps, read_records

    records = read_records(Path(args.data))[: args.sequences]
    if len(records) < args.sequences:
        raise SystemExit(f"{args.data}: {len(records)} usable records, fewer than --sequences {args.sequences}")
    layers = load_model(args.model, dtype=resolve_dtype("auto")).model.args.num_layers
    full = default_taps(layers)
    small = [int(t) for t in args.small_taps.split(",")] if args.small_taps else [full[0], full[2], full[-1]]
    train = ["dspark", "train", "--steps", str(args.steps), "--batch", str(args.batch), "--holdout",
             str(args.holdout), "--save-every", str(args.steps), "--threads", str(args.threads)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "records.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        for name, taps in (("cache", full), ("small cache", small), ("on the fly", full)):
            out = Path(tmp) / name.replace(" ", "-")
            build, size, tokens = 0.0, 0, 0
            if name != "on the fly":
                build = cli(["dspark", "features", "-m", args.model, "--data", str(data), "--out", str(out / "features"),
                             "--taps", ",".join(map(str, taps)), "--quiet", "--threads", str(args.threads)])
                manifest = json.loads((out / "features" / "manifest.json").read_text())
                size, tokens = manifest["bytes"], manifest["tokens"]
                source = ["--features", str(out / "features")]
            else:
                source = ["--data", str(data), "-m", args.model, "--taps", ",".join(map(str, taps))]
            seconds = cli([*train, *source, "--out", str(out / "run")])
            metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
            step_s = sum(m["seconds"] for m in metrics) / len(metrics)
            step_tokens = sum(m["tokens"] for m in metrics) / len(metrics)
            val = [json.loads(line) for line in (out / "run" / "validation.jsonl").read_text().splitlines()][-1]
            seq_tokens = step_tokens / args.batch
            per_seq = step_s / args.batch  # training seconds per sequence, features included when on the fly
            build_per_seq = build / len(records)
            hours = (args.campaign_sequences * (build_per_seq + args.epochs * per_seq)) / 3600
            rows.append({"source": name, "taps": taps, "build_s": round(build, 1),
                         "bytes_per_token": round(size / tokens) if tokens else 0,
                         "train_tok_s": round(step_tokens / step_s, 1), "seconds": round(seconds, 1),
                         "tau_val": round(val["tau_probabilistic"], 3),
                         "campaign_hours": round(hours, 2),
                         "campaign_disk_gib": round(args.campaign_sequences * seq_tokens * (size / tokens if tokens else 0)
                                                    / 2**30, 1)})
    result = {"bench": "dspark_feature_source", "model": args.model, "cpu": cpu_name(), "threads": args.threads,
              "sequences": args.sequences, "steps": args.steps, "batch": args.batch,
              "campaign": {"sequences": args.campaign_sequences, "epochs": args.epochs}, "rows": rows}
    print(f"{args.model}, {cpu_name()}, {args.threads} threads; {args.sequences} sequences, {args.steps} steps of "
          f"{args.batch}; campaign: {args.campaign_sequences} sequences x {args.epochs} epochs")
    print(f"{'source':<13}{'taps':<18}{'build s':>8}{'B/token':>9}{'train tok/s':>12}{'val tau':>9}"
          f"{'campaign h':>11}{'disk GiB':>9}")
    for r in rows:
        print(f"{r['source']:<13}{','.join(map(str, r['taps'])):<18}{r['build_s']:>8.0f}{r['bytes_per_token']:>9}"
              f"{r['train_tok_s']:>12.1f}{r['tau_val']:>9.3f}{r['campaign_hours']:>11.2f}{r['campaign_disk_gib']:>9.1f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
