"""`verispec dspark calibrate`: calibrated confidences and per-position thresholds from
held-out rounds.

The confidence head predicts c_j = P(draft j accepted | drafts before it accepted). On
held-out prompts (ShareGPT first turns after the ones datagen used, by default) the
drafter decodes live with full proposals, and every round gives its confidence logits
and how many drafts the target accepted.

`--method sts` (the default): Sequential Temperature Scaling (paper §3.2.1,
training/dspark/sts.py): per position a temperature, fitted left to right so that the
cumulative product prod_{i<=j} c_i is calibrated as the probability that the round keeps
its first j drafts. The prompts are split in two (even / odd): the temperatures are fitted
on one half and the ECE / AUC before and after are reported on the other, with the
reliability diagrams before and after (sts.png). The temperatures go into the checkpoint's
config.json (`confidence_temperature`); checkpoints without them (DeepSpec's) load with
identity temperatures. Thresholds are then fitted on the calibrated confidences, as below.

`--method threshold`: thresholds only, on the raw sigmoids (temperatures removed): per
position j, the largest t such that the drafts it would cut, {c_j < t}, are at least
`--min-evidence` many and their Laplace-smoothed acceptance (accepted + 1) / (n + 2) is
below `--target-acceptance`; where no such t exists (thin evidence or no bad region) the
position is never cut (t = 0). They are written into config.json
(`confidence_threshold`, one per position), which serving uses.

Why the default target is low (0.1): a cut saves only the marginal verify cost of the
drafts it removes (on this CPU ~0.04 of a target step per token, bench/spec.py), while
the drafter's round is paid anyway. Measured with the shipped SmolLM2 drafter (16 eval
prompts, T=0, serving policy): thresholds fit for 0.3 emptied most proposals (tau 1.18,
0.92x plain decoding); fit for 0.1, tau 1.48 and 1.15x.

Threshold report: per position the expected calibration error (20 equal-width bins,
|mean c - acceptance| weighted by bin count) of the (calibrated) confidence as a
conditional acceptance probability, and a reliability diagram (reliability.png);
calibration.json holds the numbers.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from verispec.training.dspark.sts import BINS, ece as tensor_ece


def laplace(accepted: int, n: int) -> float:
    return (accepted + 1) / (n + 2)


def fit_threshold(pairs: list[tuple[float, bool]], target: float, min_evidence: int, grid: int = BINS) -> float:
    """The largest t in (0, 1) whose cut set {c < t} is big enough and bad enough."""
    best = 0.0
    for step in range(1, grid):
        t = step / grid
        cut = [y for c, y in pairs if c < t]
        if len(cut) >= min_evidence and laplace(sum(cut), len(cut)) < target:
            best = t
    return best


def ece(pairs: list[tuple[float, bool]], bins: int = BINS) -> tuple[float, list[dict]]:
    """The expected calibration error of (confidence, accepted) pairs (sts.ece, the one
    implementation) and its reliability bins."""
    conf = torch.tensor([c for c, _ in pairs], dtype=torch.float64)
    hits = torch.tensor([bool(y) for _, y in pairs])
    index = (conf * bins).long().clamp(0, bins - 1)
    table = []
    for b in range(bins):
        members = index == b
        if members.any():
            table.append({"bin": [b / bins, (b + 1) / bins], "n": int(members.sum()),
                          "confidence": float(conf[members].mean()), "acceptance": float(hits[members].double().mean())})
    return (tensor_ece(conf, hits, bins) if pairs else 0.0), table


def run_calibrate(args) -> int:
    from tqdm.auto import tqdm

    from verispec.engine.sampling import SamplingParams
    from verispec.models.loader import load_model, resolve_dtype
    from verispec.models.registry import DEFAULT_MODEL
    from verispec.models.tokenizer import encode_user_text
    from verispec.drafting.dspark.checkpoint import load_dspark, newest_checkpoint
    from verispec.training.dspark.datagen import read_prompts
    from verispec.training.dspark.live import make_engine, run_live
    from verispec.drafting.dspark.source import DSparkProvider

    from verispec.training.dspark import sts

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = newest_checkpoint(Path(args.drafter))
    loaded = load_model(args.model or DEFAULT_MODEL, dtype=resolve_dtype(args.dtype))
    drafter = load_dspark(folder, target=loaded, dtype=loaded.model.dtype)
    provider = DSparkProvider(drafter, confidence_threshold=0.0)
    engine = make_engine(loaded, provider, adaptive=False, num_draft_tokens=drafter.block_size)
    g = drafter.block_size
    halves: list[list[tuple[list[float], int, int]]] = [[], []]  # rounds of even / odd prompts
    prompts = list(read_prompts(args.prompts, args.limit, skip=args.skip))
    for i, (_, text) in enumerate(tqdm(prompts, desc="calibrate", unit="prompt", file=sys.stderr,
                                       disable=args.quiet)):
        ids = encode_user_text(loaded.tokenizer, text)
        if len(ids) > args.max_prompt_tokens:
            continue
        live = run_live(engine, ids, args.max_tokens, SamplingParams(), loaded.stop_ids)
        halves[i % 2].extend((r.logits, r.accepted, r.proposal_len) for r in live.rounds if len(r.logits) >= g)
    summary: dict = {"method": args.method, "prompts": len(prompts)}
    (folder / "calibration_rounds.json").write_text(json.dumps(
        {"note": "live rounds (confidence logits, drafts accepted, proposal length) of even / odd prompts",
         "halves": halves}))
    temperatures = None
    if args.method == "sts":
        fit, check = sts.Rounds(halves[0], g), sts.Rounds(halves[1], g)
        temperatures = sts.fit_sts(fit)
        before, after = sts.report(check, None), sts.report(check, temperatures)
        summary["sts"] = {"temperatures": temperatures, "fit_rounds": len(fit), "check_rounds": len(check),
                          "before": before, "after": after}
        _plot_sts(before, after, folder / "sts.png")
        print(f"STS on {len(fit)} rounds, checked on {len(check)} held-out rounds (cumulative products):")
        print(f"{'position':>8}{'tested':>8}{'survive':>9}{'T':>8}{'ECE raw':>9}{'ECE STS':>9}{'noise':>7}"
              f"{'AUC raw':>9}{'AUC STS':>9}")
        for b, a, t in zip(before, after, temperatures):
            surv = f"{b['survival']:.3f}" if b["survival"] is not None else "  -"
            print(f"{b['position']:>8}{b['tested']:>8}{surv:>9}{t:>8.3f}{b['ece']:>9.3f}{a['ece']:>9.3f}"
                  f"{a['ece_floor']:>7.3f}{b['auc']:>9.3f}{a['auc']:>9.3f}")
        print("(noise: the ECE a perfectly calibrated predictor would show on as many rounds)")
    # thresholds on the (calibrated) conditional confidences, every tested slot
    pairs: list[list[tuple[float, bool]]] = [[] for _ in range(g)]
    for logits, accepted, proposal_len in halves[0] + halves[1]:
        for j in range(min(proposal_len, g)):
            if j > accepted:
                break  # not tested: an earlier draft was rejected
            t = 1.0 if temperatures is None else temperatures[j]
            pairs[j].append((1 / (1 + math.exp(-logits[j] / t)), j < accepted))
    thresholds, report = [], []
    for j in range(g):
        t = fit_threshold(pairs[j], args.target_acceptance, args.min_evidence)
        error, table = ece(pairs[j])
        n = len(pairs[j])
        rate = sum(y for _, y in pairs[j]) / n if n else None
        thresholds.append(t)
        report.append({"position": j, "tested": n, "acceptance": rate, "ece": error, "threshold": t, "bins": table})
    raw = json.loads((folder / "config.json").read_text())
    raw["confidence_threshold"] = thresholds
    if temperatures is None:
        raw.pop("confidence_temperature", None)
    else:
        raw["confidence_temperature"] = temperatures
    (folder / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    (folder / "calibration.json").write_text(json.dumps({
        **summary, "target_acceptance": args.target_acceptance, "min_evidence": args.min_evidence,
        "positions": report}, indent=2))
    _plot(report, folder / "reliability.png")
    print(f"{'position':>8}{'tested':>8}{'accept':>8}{'ECE':>8}{'threshold':>11}")
    for r in report:
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "  -"
        print(f"{r['position']:>8}{r['tested']:>8}{acc:>8}{r['ece']:>8.3f}{r['threshold']:>11.2f}")
    written = f"temperatures {temperatures} and " if temperatures is not None else ""
    print(f"calibrate: {written}thresholds {thresholds} written to {folder / 'config.json'}; report in "
          f"calibration.json, reliability.png" + (", sts.png" if temperatures is not None else ""), file=sys.stderr)
    return 0


def _reliability(ax, report: list[dict], predicted: str, observed: str, label) -> None:
    """One reliability diagram: a curve per position over its bins, and the diagonal."""
    ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    for r in report:
        if r["bins"]:
            ax.plot([b[predicted] for b in r["bins"]], [b[observed] for b in r["bins"]], marker="o",
                    markersize=3, label=f"{label(r['position'])} (ECE {r['ece']:.3f})")
    ax.legend(fontsize=7)


def _plot_sts(before: list[dict], after: list[dict], png: Path) -> None:
    """Reliability of the cumulative products per position, raw and after STS."""
    from verispec.plots import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.5), sharey=True)
    for ax, report, title in ((axes[0], before, "raw confidences"), (axes[1], after, "after STS")):
        _reliability(ax, report, "predicted", "observed", lambda k: f"position {k + 1}")
        ax.set_xlabel("predicted P(first k drafts accepted)")
        ax.set_title(f"{title}, held-out rounds")
    axes[0].set_ylabel("observed rate")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def _plot(report: list[dict], png: Path) -> None:
    from verispec.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 6))
    _reliability(ax, report, "confidence", "acceptance", lambda k: f"slot {k}")
    ax.set_xlabel("predicted acceptance (confidence)")
    ax.set_ylabel("observed acceptance (given the drafts before it)")
    ax.set_title("DSpark confidence reliability")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
