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

`--features FOLDER` instead of `--data` asks the question again at a campaign's size, on a bf16
features folder that exists (stage 28: gemma3's had outgrown the page cache): the folder is
recast to fp8 (`dspark features --from-features`, timed; into `--fp8-out`, kept, or a temporary
folder), then each store trains `--steps` steps from `--init-from` with the same seed and the
same samples, and both checkpoints are validated on the bf16 held-out sequences (what serving
reads). Reported: bytes per token, mean step seconds and tokens/s (the first `--warmup` steps
left out), held-out teacher-forced tau. The fp8 folder is read once before its run, as a
campaign's later epochs would find it; the bf16 folder is read as it comes.

    .venv/bin/python bench/dspark_feature_source.py --features work/gemma3/features-served \
        --model gemma3-270m --init-from gemma3-270m --steps 60 --holdout 40 --fp8-out work/gemma3/features-fp8

Prints a table, one JSON line, and the CPU. The machine should be otherwise idle.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
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
    ap.add_argument("--data", default=None, help="datagen JSONL or pack (builds each cache from it)")
    ap.add_argument("--features", default=None, help="instead of --data: an existing bf16 features folder, trained on "
                    "as it is and recast to fp8")
    ap.add_argument("--init-from", default=None, help="with --features: the drafter both runs start from")
    ap.add_argument("--fp8-out", default=None, help="with --features: keep the fp8 folder here (resumes a recast)")
    ap.add_argument("--lr", type=float, default=None, help="with --features: train's --lr (default: train's)")
    ap.add_argument("--keep-metrics", default=None, help="with --features: copy each run's metrics.jsonl here")
    ap.add_argument("--control-seed", type=int, default=None,
                    help="with --features: one more bf16 run with this seed (the runs use 7), so the fp8 run's tau "
                         "difference is read against what another sample order alone moves")
    ap.add_argument("--warmup", type=int, default=5, help="with --features: steps left out of the step time (default 5)")
    ap.add_argument("--fly-data", default=None, help="with --features: also time training on the fly from these records "
                    "(the folder's datagen file or pack), for --fly-steps steps")
    ap.add_argument("--fly-steps", type=int, default=8, help="with --fly-data (default 8; no tau: too few steps)")
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
    if bool(args.data) == bool(args.features):
        raise SystemExit("one of --data (build the caches) or --features (an existing bf16 folder)")
    if args.features:
        return stores(args)
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
                             "--taps", ",".join(map(str, taps)), "--quiet", "--threads", str(args.threads),
                             "--store", "bf16"])  # the samples on-the-fly training computes, bit for bit
                manifest = json.loads((out / "features" / "manifest.json").read_text())
                size, tokens = manifest["bytes"], manifest["tokens"]
                source = ["--features", str(out / "features")]
            else:
                source = ["--data", str(data), "-m", args.model, "--taps", ",".join(map(str, taps))]
            seconds = cli([*train, *source, "--out", str(out / "run")])
            step_s, step_tokens = mean_step(read_jsonl(out / "run" / "metrics.jsonl"))
            val = read_jsonl(out / "run" / "validation.jsonl")[-1]
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


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def mean_step(metrics: list[dict]) -> tuple[float, float]:
    """Mean seconds and tokens of a training step over `metrics` (metrics.jsonl rows)."""
    return (sum(m["seconds"] for m in metrics) / len(metrics), sum(m["tokens"] for m in metrics) / len(metrics))


def read_through(folder: Path) -> float:
    """Reads every file of a folder once (into the page cache, where it fits); seconds."""
    start = time.perf_counter()
    for path in sorted(folder.iterdir()):
        with path.open("rb") as f:
            while f.read(1 << 24):
                pass
    return time.perf_counter() - start


def held_out_tau(args, bf16: Path, drafter, out: Path) -> float:
    """Teacher-forced tau of `drafter` on the bf16 folder's held-out sequences: a one-step warm
    restart validates where it starts (step 0 of its validation.jsonl)."""
    cli(["dspark", "train", "--features", str(bf16), "--holdout", str(args.holdout), "--batch", "1",
         "--threads", str(args.threads), "--init-from", str(drafter), "--steps", "1", "--save-every", "1000",
         "--out", str(out)])
    return read_jsonl(out / "validation.jsonl")[0]["tau_probabilistic"]


def stores(args) -> int:
    """The bf16 folder against its fp8 recast: disk, step time, held-out tau on bf16 features."""
    from verispec.models.kernel_plan import cpu_name

    bf16 = Path(args.features)
    manifest = json.loads((bf16 / "manifest.json").read_text())
    if manifest.get("store", "bf16") != "bf16":
        raise SystemExit(f"{bf16} is stored as {manifest['store']}; --features wants a bf16 folder")
    common = ["dspark", "train", "--batch", str(args.batch), "--holdout", str(args.holdout),
              "--threads", str(args.threads), "--log-every", "1"]
    if args.init_from:
        common += ["--init-from", args.init_from]
    if args.lr:
        common += ["--lr", str(args.lr)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        start_tau = held_out_tau(args, bf16, args.init_from, Path(tmp) / "check-start") if args.init_from else None
        fp8 = Path(args.fp8_out) if args.fp8_out else Path(tmp) / "fp8"
        recast_s = cli(["dspark", "features", "--from-features", str(bf16), "--out", str(fp8), "--store", "fp8",
                        "--quiet"])
        arms = [("bf16", bf16, 7), ("fp8", fp8, 7)]
        if args.control_seed is not None:
            arms.insert(1, (f"bf16 s{args.control_seed}", bf16, args.control_seed))
        for store, folder, seed in arms:
            warm_s = read_through(folder) if folder == fp8 else 0.0
            slug = store.replace(" ", "-")
            run = Path(tmp) / f"run-{slug}"
            cli([*common, "--features", str(folder), "--seed", str(seed), "--steps", str(args.steps),
                 "--save-every", str(args.steps), "--out", str(run)])
            if args.keep_metrics:
                shutil.copy(run / "metrics.jsonl", Path(args.keep_metrics) / f"metrics-{slug}.jsonl")
            step_s, step_tokens = mean_step(read_jsonl(run / "metrics.jsonl")[args.warmup:])
            tau = held_out_tau(args, bf16, run / f"step_{args.steps}", Path(tmp) / f"check-{slug}")
            m = json.loads((folder / "manifest.json").read_text())
            rows.append({"store": store, "seed": seed, "gib": round(m["bytes"] / 2**30, 2),
                         "bytes_per_token": round(m["bytes"] / m["tokens"]), "read_s": round(warm_s, 1),
                         "step_s": round(step_s, 3), "train_tok_s": round(step_tokens / step_s, 1),
                         "tau_val_bf16": round(tau, 4)})
        if args.fly_data:
            run = Path(tmp) / "run-fly"
            taps = ",".join(map(str, manifest["target_layer_ids"]))
            cli([*common, "--data", args.fly_data, "-m", args.model, "--taps", taps, "--steps", str(args.fly_steps),
                 "--save-every", str(args.fly_steps), "--out", str(run)])
            step_s, step_tokens = mean_step(read_jsonl(run / "metrics.jsonl")[1:])
            rows.append({"store": "on the fly", "seed": 7, "gib": 0.0, "bytes_per_token": 0, "read_s": 0.0,
                         "step_s": round(step_s, 3), "train_tok_s": round(step_tokens / step_s, 1),
                         "tau_val_bf16": None})
    result = {"bench": "dspark_feature_source", "mode": "stores", "model": args.model, "cpu": cpu_name(),
              "threads": args.threads, "features": str(bf16), "sequences": manifest["records"],
              "tokens": manifest["tokens"], "steps": args.steps, "batch": args.batch, "init_from": args.init_from,
              "lr": args.lr, "tau_val_bf16_start": start_tau,
              "recast_s": round(recast_s, 1), "memory_gib": round(os.sysconf("SC_PAGE_SIZE")
                                                                  * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
              "rows": rows}
    print(f"{args.model}, {cpu_name()}, {args.threads} threads; {manifest['records']} sequences "
          f"({manifest['tokens']} tokens), {args.steps} steps of {args.batch} from {args.init_from or 'scratch'}; "
          f"{result['memory_gib']} GiB of memory; recast to fp8 in {recast_s:.0f} s"
          + (f"; held-out tau {start_tau:.4f} at the start" if start_tau is not None else ""))
    print(f"{'store':<11}{'GiB':>7}{'B/token':>9}{'step s':>8}{'train tok/s':>12}{'held-out tau (bf16)':>21}")
    for r in rows:
        tau = "-" if r["tau_val_bf16"] is None else f"{r['tau_val_bf16']:.4f}"
        print(f"{r['store']:<11}{r['gib']:>7.2f}{r['bytes_per_token']:>9}{r['step_s']:>8.2f}{r['train_tok_s']:>12.1f}"
              f"{tau:>21}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
