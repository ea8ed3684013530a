"""`verispec dspark calibrate`: per-position confidence thresholds from held-out rounds.

The confidence head predicts c_j = P(draft j accepted | drafts before it accepted). On
held-out prompts (ShareGPT first turns after the ones datagen used, by default) the
drafter decodes live with full proposals, and every slot j the target actually tested
(all drafts before it accepted) gives a pair (c_j, accepted_j).

Thresholds: per position j, the largest t such that the drafts it would cut, {c_j < t},
are at least `--min-evidence` many and their Laplace-smoothed acceptance
(accepted + 1) / (n + 2) is below `--target-acceptance`; where no such t exists (thin
evidence or no bad region) the position is never cut (t = 0). They are written into the
checkpoint's config.json (`confidence_threshold`, one per position), which serving uses.

Why the default target is low (0.1): a cut saves only the marginal verify cost of the
drafts it removes (on this CPU ~0.04 of a target step per token, bench/spec.py), while
the drafter's round is paid anyway. Measured with the shipped SmolLM2 drafter (16 eval
prompts, T=0, serving policy): thresholds fit for 0.3 emptied most proposals (tau 1.18,
0.92x plain decoding); fit for 0.1, tau 1.48 and 1.15x.

Calibration report: per position the expected calibration error (20 equal-width bins,
|mean c - acceptance| weighted by bin count) of the raw confidence as a conditional
acceptance probability, and a reliability diagram (reliability.png); calibration.json
holds the numbers. The paper's STS temperature fitting is not applied (DeepSpec does not
implement it either); the thresholds act on the raw sigmoids.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BINS = 20


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
    table = []
    total = len(pairs)
    error = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        members = [(c, y) for c, y in pairs if lo <= c < hi or (b == bins - 1 and c == 1.0)]
        if not members:
            continue
        conf = sum(c for c, _ in members) / len(members)
        acc = sum(y for _, y in members) / len(members)
        error += len(members) / total * abs(conf - acc)
        table.append({"bin": [lo, hi], "n": len(members), "confidence": conf, "acceptance": acc})
    return error, table


def run_calibrate(args) -> int:
    import torch
    from tqdm.auto import tqdm

    from verispec.engine.sampling import SamplingParams
    from verispec.models.loader import load_model, resolve_dtype
    from verispec.models.registry import DEFAULT_MODEL
    from verispec.models.tokenizer import encode_chat
    from verispec.drafting.dspark.checkpoint import load_dspark, newest_checkpoint
    from verispec.training.dspark.datagen import read_prompts
    from verispec.training.dspark.live import make_engine, run_live
    from verispec.drafting.dspark.source import DSparkProvider

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = newest_checkpoint(Path(args.drafter))
    loaded = load_model(args.model or DEFAULT_MODEL, dtype=resolve_dtype(args.dtype))
    drafter = load_dspark(folder, target=loaded, dtype=loaded.model.dtype)
    provider = DSparkProvider(drafter, confidence_threshold=0.0)
    engine = make_engine(loaded, provider, adaptive=False, num_draft_tokens=drafter.block_size)
    g = drafter.block_size
    pairs: list[list[tuple[float, bool]]] = [[] for _ in range(g)]
    prompts = list(read_prompts(args.prompts, args.limit, skip=args.skip))
    for _, text in tqdm(prompts, desc="calibrate", unit="prompt", file=sys.stderr, disable=args.quiet):
        ids = encode_chat(loaded.tokenizer, [{"role": "user", "content": text}])
        if len(ids) > args.max_prompt_tokens:
            continue
        live = run_live(engine, ids, args.max_tokens, SamplingParams(), loaded.stop_ids)
        for r in live.rounds:
            for j in range(min(r.proposal_len, len(r.confidences))):
                if j > r.accepted:
                    break  # not tested: an earlier draft was rejected
                pairs[j].append((r.confidences[j], j < r.accepted))
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
    (folder / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    (folder / "calibration.json").write_text(json.dumps({
        "target_acceptance": args.target_acceptance, "min_evidence": args.min_evidence, "prompts": len(prompts),
        "positions": report}, indent=2))
    _plot(report, folder / "reliability.png")
    print(f"{'position':>8}{'tested':>8}{'accept':>8}{'ECE':>8}{'threshold':>11}")
    for r in report:
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "  -"
        print(f"{r['position']:>8}{r['tested']:>8}{acc:>8}{r['ece']:>8.3f}{r['threshold']:>11.2f}")
    print(f"calibrate: thresholds {thresholds} written to {folder / 'config.json'}; report in calibration.json, "
          f"reliability.png", file=sys.stderr)
    return 0


def _plot(report: list[dict], png: Path) -> None:
    from verispec.training.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 6))
    ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    for r in report:
        if r["bins"]:
            ax.plot([b["confidence"] for b in r["bins"]], [b["acceptance"] for b in r["bins"]], marker="o",
                    markersize=3, label=f"slot {r['position']} (ECE {r['ece']:.3f})")
    ax.set_xlabel("predicted acceptance (confidence)")
    ax.set_ylabel("observed acceptance (given the drafts before it)")
    ax.set_title("DSpark confidence reliability")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
