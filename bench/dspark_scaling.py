"""The drafter's scaling curve (issue #15, stage 2): held-out tau against training data, at
fixed compute per point.

Every point trains `verispec dspark train` for the same `--steps` x `--batch` sequences on the
first N records of a regenerated pack (nested subsets, `train --limit`), with the same 100
held-out records (the pack's last) for teacher-forced tau (`validation.jsonl` at the last step),
then decodes `--live` held-out ShareGPT first turns (the file's last ones, never a prompt of the
pack, never the eval prompts) with `dspark measure --fixed-draft` at T=0 for live tau: every round
verifies a full block, so the number is the drafter's, not the cost policy's (which, on a weak
drafter, stops drafting and reports tau ~1); the first point also measures n-gram on them, the
weightless line to beat. The default grid is the issue's:

    size     regenerated answers, 1 draft layer, 16k draft vocabulary, at --sizes (1000,2500,5000,10000)
    source   at --pivot sequences: ShareGPT's own answers (--sharegpt), and a half/half mix
    layers   at --pivot: 2 draft layers
    vocab    at --pivot: an 8k and the full draft vocabulary
    compute  with --compute-steps S1,S2: the smallest and largest size again at those step counts

Then a fit (`fit`): tau per doubling of data at fixed compute (log-linear least squares over
the size points) and per doubling of steps at fixed data (sizes measured at two step counts),
each priced as the factor and the CPU hours of this machine the next 0.5 of tau would take
(datagen at 1456 answers/h, features at 1.25 s a sequence, training at the measured minutes):
the answer the issue asks the curve for. An extrapolation, flagged when the data it asks for
is more than a point's compute ever reads. The live tau runs one fixed target on every point
(float32, PyTorch's kernels), not the served plan `measure` defaults to: the curve compares
drafters, not kernels.

A size larger than the pack holds is skipped (and said). The features of each pack are computed
once into `--work` (`dspark features`, resumable; ~7 KiB per token on disk) and every point
reads them. Each finished point appends one JSON line to `--results` (default
docs/dspark-scaling.jsonl) and redraws the PNG beside it; a point already there is skipped and a
point's training resumes from its checkpoint, so the curve grows across sessions:

    .venv/bin/python bench/dspark_scaling.py --data data/dspark/smollm2-135m-instruct/regenerated.pack.xz \\
        --minutes 170                     # stop (resumably) after this long; rerun to continue
    .venv/bin/python bench/dspark_scaling.py --data PACK --plot-only

Prints a table of the points so far and one JSON line. The machine should be otherwise idle
(points are compared by tau, not time, but the CPU hours are reported).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HOLDOUT = 100


def cli(argv: list[str]) -> None:
    from verispec.cli import main

    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(argv)
    if code != 0:
        raise SystemExit(f"failed ({code}): {' '.join(argv)}\n{err.getvalue()[-2000:]}")


def grid(args) -> list[dict]:
    base = {"source": "regenerated", "layers": 1, "draft_vocab": 16384}
    points = [{**base, "sequences": n} for n in args.sizes]
    pivot = {**base, "sequences": args.pivot}
    if args.sharegpt:
        points += [{**pivot, "source": "sharegpt"}, {**pivot, "source": "mix"}]
    points += [{**pivot, "layers": 2}, {**pivot, "draft_vocab": 8192}, {**pivot, "draft_vocab": 0}]
    for p in points:
        p["steps"] = args.steps
    # the compute axis: the same recipe at other step counts, at the smallest and largest size
    ends = sorted({min(args.sizes), max(args.sizes)})
    points += [{**base, "sequences": n, "steps": s} for s in args.compute_steps for n in ends if s != args.steps]
    for p in points:
        p["key"] = f"{p['source']}-n{p['sequences']}-L{p['layers']}-v{p['draft_vocab']}-s{p['steps']}x{args.batch}"
    return points


def held_out_prompts(packs: list[Path], model: str, count: int) -> list[str]:
    """The last `count` distinct ShareGPT first turns that are no prompt of the packs."""
    from verispec.data.decontaminate import contaminated
    from verispec.data.sharegpt import first_user_turns
    from verispec.models.loader import load_model
    from verispec.models.tokenizer import encode_chat
    from verispec.training.dspark.pack import read_pack

    tokenizer = load_model(model).tokenizer
    used = {tuple(r["prompt_ids"]) for pack in packs for r in read_pack(pack)[1]}
    chosen = []
    for text in reversed(first_user_turns(min_chars=16, max_chars=2000)):
        if tuple(encode_chat(tokenizer, [{"role": "user", "content": text}])) in used or contaminated(text):
            continue
        chosen.append(text)
        if len(chosen) == count:
            break
    return chosen


def features_for(pack: Path, work: Path, model: str, threads: int) -> Path:
    out = work / f"features-{pack.name.split('.')[0]}"
    manifest = out / "manifest.json"
    if not (manifest.is_file() and json.loads(manifest.read_text()).get("complete")):
        print(f"features of {pack} -> {out} (once; resumable)", file=sys.stderr, flush=True)
        cli(["dspark", "features", "-m", model, "--data", str(pack), "--out", str(out), "--threads", str(threads),
             "--dtype", "float32", "--store", "bf16"])  # the same on every host (auto picks bf16 where the CPU has it);
        # bf16: the store the published curve was measured on
    return out


def run_point(p: dict, args, features: dict, eval_dir: Path, deadline: float) -> dict | None:
    import torch

    from verispec.training.dspark.features import FeatureCache

    # the held-out records are always the regenerated pack's last HOLDOUT (the first folder): every
    # source is validated on the target's own answers; "sharegpt" trains on the second folder only
    folders = [features["regenerated"], *([features["sharegpt"]] if p["source"] != "regenerated" else [])]
    trained = {"regenerated": [1], "sharegpt": [2], "mix": [1, 2]}[p["source"]]
    available = sum(len(FeatureCache([folders[k - 1]])) for k in trained) - HOLDOUT * (1 in trained)
    if available < p["sequences"]:
        print(f"skip {p['key']}: {available} training sequences, fewer than {p['sequences']}", file=sys.stderr)
        return None
    run = args.work / p["key"]
    left = (deadline - time.monotonic()) / 60
    if left < 1:
        return None
    start = time.perf_counter()
    # float32 pinned: `--precision auto` picks bf16 where the CPU has it, and points must compare across hosts
    cli(["dspark", "train", "--features", ",".join(map(str, folders)), "--out", str(run), "--limit",
         str(p["sequences"]), "--train-folders", ",".join(map(str, trained)), "--precision", "fp32",
         "--holdout", str(HOLDOUT), "--steps", str(p["steps"]), "--batch", str(args.batch),
         "--layers", str(p["layers"]), "--draft-vocab", str(p["draft_vocab"]), "--save-every", "100",
         "--max-minutes", f"{left:.2f}", "--threads", str(args.threads), "--log-every", "1000"])
    last = run / (run / "latest").read_text().strip()
    state = json.loads((last / "trainer" / "state.json").read_text())
    if state["step"] < p["steps"]:
        return None  # out of time: the next run resumes this point
    train_minutes = (time.perf_counter() - start) / 60
    val = [json.loads(line) for line in (run / "validation.jsonl").read_text().splitlines()][-1]
    measure = ["dspark", "measure", "-m", args.model, "--drafter", str(run), "--eval-dir", str(eval_dir),
               "--datasets", "sharegpt-heldout", "--per-dataset", str(args.live), "--temperatures", "0",
               "--max-tokens", str(args.max_tokens), "--out", str(run / "measure"), "--quiet", "--fixed-draft",
               "--threads", str(args.threads),
               # one fixed target for every point: float32 on PyTorch's kernels, what `measure` ran before it
               # took the served plan (greedy tokens identical to it, checked on SmolLM2); points compare tau
               "--dtype", "float32", "--kernels", "onednn", "--quant", "none"]
    first = not any(True for _ in _points(args.results))
    cli([*measure, *(["--with-ngram"] if first else [])])
    row = json.loads((run / "measure" / "measure.json").read_text())["rows"][0]
    record = {**p, "batch": args.batch, "tau_teacher_forced": round(val["tau_probabilistic"], 3),
              "accept_by_position": val["accept_by_position"], "tau_live_t0": round(row["tau"], 3),
              # the held-out answers walked as live decoding walks them (stage 33; older points lack it)
              **({"tau_teacher_forced_walked_t0": round(val["tau_walk_greedy"], 3)} if "tau_walk_greedy" in val else {}),
              # the rows the draft head has (a vocabulary smaller than asked when the data uses fewer tokens)
              "draft_vocab_rows": _draft_rows(last),
              "live_prompts": args.live, "live_policy": "fixed-draft", "train_minutes_this_run": round(train_minutes, 1),
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"), "cpu": args.cpu,
              "cpu_isa": torch.backends.cpu.get_cpu_capability()}  # hosts of one name differ (AVX2 / AVX512)
    if first:
        record["ngram_tau_live_t0"] = round(row["ngram_tau"], 3)
    return record


def _draft_rows(checkpoint: Path) -> int | None:
    config = json.loads((checkpoint / "config.json").read_text())
    return config.get("draft_vocab_size") or config.get("vocab_size")


def _points(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


ANSWERS_PER_HOUR = 1456  # datagen, batch 64, AMD EPYC AVX2 (docs/dspark-campaign.md, stage 1)
FEATURE_SECONDS_PER_SEQUENCE = 1.25  # dspark features, same machine (stage 3)


def _base_recipe(p: dict) -> bool:
    """Regenerated answers, 1 draft layer, 16k vocabulary: the points the data and compute axes vary."""
    return p["source"] == "regenerated" and p["layers"] == 1 and p["draft_vocab"] == 16384


def _size_curve(points: list[dict]) -> list[dict]:
    """The data axis: the base recipe at the most common step count."""
    base = [p for p in points if _base_recipe(p)]
    if not base:
        return []
    steps = max({p["steps"] for p in base}, key=lambda s: sum(p["steps"] == s for p in base))
    return sorted((p for p in base if p["steps"] == steps), key=lambda p: p["sequences"])


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against log2(xs): tau gained per doubling."""
    lx = [math.log2(x) for x in xs]
    mx, my = sum(lx) / len(lx), sum(ys) / len(ys)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ys)) / sum((a - mx) ** 2 for a in lx)


def fit(points: list[dict], gain: float = 0.5) -> dict:
    """What the curve says the next `gain` of tau costs: tau per doubling of distinct sequences
    at fixed compute (log-linear least squares over the size curve), and per doubling of
    optimizer steps at fixed data (the sizes measured at more than one step count), each turned
    into the factor that many doublings mean and the CPU hours of this machine it would take. A
    log-linear extrapolation past the measured range: a rate, not a promise."""
    out: dict = {}
    curve = _size_curve(points)
    if len(curve) >= 2:
        n, top = [p["sequences"] for p in curve], curve[-1]
        for key in ("tau_teacher_forced", "tau_live_t0"):
            b = _slope(n, [p[key] for p in curve])
            entry = {"per_doubling": round(b, 4), "points": len(curve), "steps": top["steps"]}
            if b > 0:
                factor = 2 ** (gain / b)
                more = top["sequences"] * (factor - 1)
                entry |= {"factor_for_gain": round(factor, 1),
                          "cpu_hours_for_gain": round(more / ANSWERS_PER_HOUR + more * FEATURE_SECONDS_PER_SEQUENCE / 3600, 1)}
                # at fixed compute a step sees `batch` sequences: past steps x batch, data goes unseen
                entry["unseen_at_this_compute"] = top["sequences"] * factor > top["steps"] * top.get("batch", 16)
            out[f"data_{key}"] = entry
    by_size: dict[int, list[dict]] = {}
    for p in filter(_base_recipe, points):
        by_size.setdefault(p["sequences"], []).append(p)
    compute = {}
    for size, ps in sorted(by_size.items()):
        if len({p["steps"] for p in ps}) < 2:
            continue
        ps = sorted(ps, key=lambda p: p["steps"])
        minutes = ps[-1]["train_minutes_this_run"]  # the longest run's training, priced per repeat
        entry = {}
        for key in ("tau_teacher_forced", "tau_live_t0"):
            b = _slope([p["steps"] for p in ps], [p[key] for p in ps])
            entry[key] = {"per_doubling": round(b, 4)}
            if b > 0 and minutes:
                factor = 2 ** (gain / b)
                entry[key] |= {"factor_for_gain": round(factor, 1),
                               "cpu_hours_for_gain": round(minutes * (factor - 1) / 60, 1)}
        compute[size] = {"steps": [p["steps"] for p in ps], **entry}
    if compute:
        out["compute"] = compute
    return out


def _fit_lines(f: dict, gain: float = 0.5) -> list[str]:
    lines = []
    for key, name in (("tau_teacher_forced", "teacher-forced"), ("tau_live_t0", "live")):
        d = f.get(f"data_{key}")
        if d:
            tail = ", no gain"
            if "factor_for_gain" in d:
                unseen = "; more than this compute ever reads: data alone cannot buy it" if d["unseen_at_this_compute"] else ""
                tail = (f", +{gain} needs x{d['factor_for_gain']:.3g} the data (~{d['cpu_hours_for_gain']:.3g} CPU h of "
                        f"datagen and features here{unseen})")
            lines.append(f"data ({d['points']} sizes at {d['steps']} steps), {name}: {d['per_doubling']:+.3f} tau "
                         f"per doubling{tail}")
    for size, c in f.get("compute", {}).items():
        for key, name in (("tau_teacher_forced", "teacher-forced"), ("tau_live_t0", "live")):
            d = c[key]
            tail = (f", +{gain} needs x{d['factor_for_gain']:.3g} the steps (~{d['cpu_hours_for_gain']:.3g} CPU h of "
                    f"training here)" if "factor_for_gain" in d else ", no gain")
            lines.append(f"compute ({size} sequences, steps {c['steps']}), {name}: {d['per_doubling']:+.3f} tau per "
                         f"doubling{tail}")
    return lines


def _side_label(p: dict) -> str:
    """What a point off the data axis varies, in a few words."""
    return (f"{p['source']} answers" if p["source"] != "regenerated" else
            f"{p['layers']} draft layers" if p["layers"] != 1 else
            f"draft vocab {p['draft_vocab'] or 'full'}" if p["draft_vocab"] != 16384 else f"{p['steps']} steps")


def plot(points: list[dict], png: Path) -> None:
    """Left: tau against distinct training sequences (the base recipe). Right: every other point
    beside the base point of its size, one column each, so variants at one size do not overlap."""
    from verispec.plots import pyplot

    plt = pyplot()
    curve = _size_curve(points)
    sides = [p for p in points if p not in curve]
    fig, axes = plt.subplots(1, 2 if sides else 1, figsize=(13 if sides else 8, 5), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2] if sides else [1]})
    ax = axes[0][0]
    series = (("tau_teacher_forced", "teacher-forced (held-out records)", "o"),
              ("tau_live_t0", "live, T=0 (held-out ShareGPT)", "s"))
    colors = {}
    for key, label, marker in series:
        line, = ax.plot([p["sequences"] for p in curve], [p[key] for p in curve], marker + "-", label=label)
        colors[key] = line.get_color()
    ngram = next((p["ngram_tau_live_t0"] for p in points if "ngram_tau_live_t0" in p), None)
    ax.set_xscale("log")
    ax.set_xlabel("distinct training sequences (regenerated answers, 1 draft layer, same steps x batch)")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title("DSpark drafter: tau against training data")
    if sides:
        right = axes[0][1]
        columns = []
        for p in sorted(sides, key=lambda p: (p["sequences"], _side_label(p))):
            base = next((b for b in curve if b["sequences"] == p["sequences"] and b["steps"] == p["steps"]), None)
            base = base or next((b for b in curve if b["sequences"] == p["sequences"]), None)
            if base is not None and base not in columns:
                columns.append(base)
            columns.append(p)
        xs = range(len(columns))
        for key, label, marker in series:
            right.plot(xs, [p[key] for p in columns], marker, color=colors[key], markersize=8, label=label)
        for x, p in zip(xs, columns):
            right.annotate(f"{p['tau_teacher_forced']:.3f}\n{p['tau_live_t0']:.3f}", (x, p["tau_teacher_forced"]),
                           textcoords="offset points", xytext=(0, 8), ha="center", fontsize=7)
        right.set_xticks(list(xs))
        right.set_xticklabels([("base recipe" if p in curve else _side_label(p)) + f"\nn={p['sequences']}"
                               + (f", {p['train_minutes_this_run']:.0f} min" if p.get("train_minutes_this_run") else "")
                               for p in columns], fontsize=7, rotation=30, ha="right")
        right.set_title("one thing changed at a time (same compute)")
        right.grid(alpha=0.3)
    for a in axes[0] if ngram else ():
        a.axhline(ngram, color="grey", linestyle="--", label=f"n-gram, live ({ngram:.2f})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, type=Path, help="the regenerated pack (dspark datagen + pack)")
    ap.add_argument("--sharegpt", type=Path, default=None, help="a pack of ShareGPT's own answers (datagen "
                    "--dataset-answers + pack): adds the source points")
    ap.add_argument("--model", "-m", default="smollm2-135m-instruct")
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1000, 2500, 5000, 10000])
    ap.add_argument("--pivot", type=int, default=2500, help="the size the other points use (default 2500)")
    ap.add_argument("--steps", type=int, default=600, help="optimizer steps per point (default 600)")
    ap.add_argument("--compute-steps", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                    help="the compute axis: also train the smallest and largest size for these step counts "
                    "(e.g. 150,600), so the curve says whether data or steps buy more tau")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    ap.add_argument("--live", type=int, default=24, help="held-out prompts decoded live (default 24)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--work", type=Path, default=Path("work/scaling"), help="features and runs (default work/scaling)")
    ap.add_argument("--results", type=Path, default=Path("docs/dspark-scaling.jsonl"))
    ap.add_argument("--minutes", type=float, default=600.0, help="stop (resumably) after this long (default 600)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    import torch

    from verispec.models.kernel_plan import cpu_name

    torch.set_num_threads(args.threads)
    args.cpu = cpu_name()
    deadline = time.monotonic() + args.minutes * 60
    if not args.plot_only:
        args.work.mkdir(parents=True, exist_ok=True)
        packs = [args.data, *([args.sharegpt] if args.sharegpt else [])]
        eval_dir = args.work / "heldout"
        if not (eval_dir / "sharegpt-heldout.jsonl").is_file():
            eval_dir.mkdir(exist_ok=True)
            prompts = held_out_prompts(packs, args.model, args.live)
            (eval_dir / "sharegpt-heldout.jsonl").write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in prompts))
        features = {"regenerated": features_for(args.data, args.work, args.model, args.threads)}
        if args.sharegpt:
            features["sharegpt"] = features_for(args.sharegpt, args.work, args.model, args.threads)
        done = {p["key"] for p in _points(args.results)}
        for p in grid(args):
            if p["key"] in done:
                continue
            record = run_point(p, args, features, eval_dir, deadline)
            if record is not None:
                args.results.parent.mkdir(parents=True, exist_ok=True)
                with args.results.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                plot(_points(args.results), args.results.with_suffix(".png"))
            if time.monotonic() > deadline:
                print("out of time: rerun the same command to continue", file=sys.stderr)
                break
    points = _points(args.results)
    if points:
        plot(points, args.results.with_suffix(".png"))
    print(f"{'point':<44}{'tau tf':>8}{'tau live':>9}")
    for p in points:
        print(f"{p['key']:<44}{p['tau_teacher_forced']:>8.3f}{p['tau_live_t0']:>9.3f}")
    f = fit(points)
    for line in _fit_lines(f):
        print(line)
    print(json.dumps({"bench": "dspark_scaling", "cpu": args.cpu, "points": points, "fit": f}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
