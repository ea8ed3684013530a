"""`verispec dspark measure`: what a drafter does live, on the eval prompts.

For each dataset of DeepSpec's eval prompts (`../shared/eval-prompts`: mt-bench, gsm8k,
humaneval, mbpp; `{"turns": [...]}`, `turns[0]` as the single user message through the
chat template) and each temperature (0 and 1 by default), every prompt is decoded twice in
the same run, interleaved: plainly, and with the drafter (the serving defaults: the
cost-based draft length and the checkpoint's confidence thresholds). Reported per dataset:
tau (tokens per target forward, the bonus token included), the conditional acceptance at
each draft position (P(draft j accepted | drafts before it accepted), over the slots the
target tested: a proposal's slots past what the verify schedule sent count nowhere), and
decode tok/s of both (tokens after the first / time after the first, one request at a time)
with their ratio; a markdown table (report.md) and PNG plots
(acceptance by position, tau by dataset). These prompts are for measuring only.

References decoded in the same run, interleaved prompt by prompt under the same policy:
n-gram lookup (`--with-ngram`), the composite of this drafter and the lookup
(`--with-composite`), and another DSpark drafter (`--against`, e.g. the shipped one when
deciding whether a retrained drafter replaces it: runs apart drift by 10-20% in plain
tok/s on a shared VM, so only speedups within one run compare). At temperature 0 an
unpacked drafter measured against itself keeps the same tau (tests/test_dspark_train.py;
packed, each load times its own int8 choice, which can flip near-ties).

The target runs the plan `verispec serve` runs (`load_for_serving`: the kernels and weight
formats measured for this machine, `--kernels`/`--quant`/`--dtype` as serve takes them) and the
drafter serve's dtype, so the speedups are the ones a served request gets. This stage ran
PyTorch's float32 kernels before (17 tok/s plain on an AVX2 host whose served plan decodes at
84-91 tok/s), which priced a drafter against a far dearer step than users get.
`--kernels onednn --quant none --dtype float32` is close to that old setting.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from verispec.data.eval_prompts import default_eval_dir, load_eval
from verispec.errors import UserError


def report_folder(spec: str, out: str | None) -> Path:
    """Where the report goes: `--out`, else beside the checkpoint; a shipped drafter's report
    goes to ./dspark-measure/NAME, never into the installed package."""
    from verispec.drafting.factory import BUNDLED_DRAFTERS, named_drafter

    if out:
        return Path(out)
    return Path("dspark-measure") / spec if spec in BUNDLED_DRAFTERS else named_drafter(spec, "--drafter")


def run_measure(args) -> int:
    import torch
    from tqdm.auto import tqdm

    from verispec.engine.sampling import SamplingParams
    from verispec.models.loader import load_for_serving
    from verispec.serve_cli import drafter_dtype, plan_summary
    from verispec.models.registry import DEFAULT_MODEL
    from verispec.models.tokenizer import encode_user_text
    from verispec.drafting.dspark.checkpoint import load_dspark
    from verispec.drafting.factory import named_drafter
    from verispec.training.dspark.live import make_engine, run_live
    from verispec.drafting.dspark.source import DSparkProvider
    from verispec.engine.verify_schedule import SERVED as SERVED_SCHEDULE

    if args.threads:
        torch.set_num_threads(args.threads)
    eval_dir = Path(args.eval_dir) if args.eval_dir else default_eval_dir()
    if eval_dir is None or not eval_dir.is_dir():
        raise UserError("no eval prompts found: pass --eval-dir (a folder of mt-bench.jsonl, gsm8k.jsonl, ...)")
    loaded = load_for_serving(args.model or DEFAULT_MODEL, args.dtype, args.kernels, args.quant,
                              progress=not args.quiet)
    def served_drafter(spec: str, flag: str):  # both arms load the way `verispec serve` does, so they cannot drift
        return load_dspark(named_drafter(spec, flag), target=loaded, dtype=drafter_dtype(args.dtype), int8="auto")

    drafter = served_drafter(args.drafter, "--drafter")
    g = drafter.block_size
    plain = make_engine(loaded)
    from verispec.engine.step_costs import step_costs_for

    # one SPS table for every arm: each engine reading the cache alone may re-time it on a
    # busy machine, and arms priced on different tables verify different lengths
    policy = {"adaptive": not args.fixed_draft, "num_draft_tokens": g,
              "verify_schedule": getattr(args, "verify_schedule", SERVED_SCHEDULE),  # as `verispec serve` decides by default
              "step_costs": step_costs_for(loaded.model)[0]}
    dspark = make_engine(loaded, DSparkProvider(drafter), **policy)
    from verispec.drafting.ngram import NgramProvider

    references = {}  # arm -> engine: the weightless reference and the composite, under the same policy
    if args.with_ngram:
        references["ngram"] = make_engine(loaded, NgramProvider(), **policy)
    composite = None
    if getattr(args, "with_composite", False):  # this drafter and the lookup, the better candidate each round
        from verispec.drafting.composite import CompositeProvider

        composite = CompositeProvider([DSparkProvider(drafter), NgramProvider()])
        references["composite"] = make_engine(loaded, composite, **policy)
    if getattr(args, "against", None):  # another drafter (the shipped one, say) on the same prompts, same policy
        other = served_drafter(args.against, "--against")
        references["against"] = make_engine(loaded, DSparkProvider(other),
                                            **{**policy, "num_draft_tokens": other.block_size})
    temperatures = [float(t) for t in args.temperatures.split(",")]
    datasets = args.datasets.split(",")
    rows = []
    jobs = [(t, d, p) for t in temperatures for d in datasets for p in load_eval(eval_dir, d, args.per_dataset)]
    stats: dict = {}
    arms = {"plain": plain, "dspark": dspark, **references}
    with tqdm(total=len(jobs), desc="measure", unit="prompt", file=sys.stderr, disable=args.quiet) as bar:
        for temperature, dataset, text in jobs:
            ids = encode_user_text(loaded.tokenizer, text)
            # unseeded, as most clients send: seeded rows verify by matching, not speculative sampling
            params = SamplingParams(temperature=temperature)
            s = stats.setdefault((temperature, dataset), {"prompts": 0, "reached": [0] * g, "kept": [0] * g,
                                                          **{arm: _Tally() for arm in arms}})
            s["prompts"] += 1
            for arm, engine in arms.items():
                before = _positions(engine) if arm == "dspark" else None
                live = run_live(engine, ids, args.max_tokens, params, rounds=False)  # no trace on the clock
                s[arm].add(live)
                if before is not None:
                    for key, now, then in zip(("reached", "kept"), _positions(engine), before):
                        for j in range(min(g, len(now))):
                            s[key][j] += now[j] - then[j]
            bar.update(1)
    for (temperature, dataset), s in stats.items():
        plain_tps, dspark_tps = s["plain"].tok_s, s["dspark"].tok_s
        rows.append({
            "dataset": dataset, "temperature": temperature, "prompts": s["prompts"],
            "tau": s["dspark"].tau,
            "acceptance_by_position": [round(k / r, 3) if r else None for k, r in zip(s["kept"], s["reached"])],
            "tested_by_position": s["reached"], "kept_by_position": s["kept"],
            "drafted": s["dspark"].drafted, "accepted": s["dspark"].accepted,  # drafts verified, kept
            "plain_tok_s": round(plain_tps, 1), "dspark_tok_s": round(dspark_tps, 1),
            "speedup": round(dspark_tps / plain_tps, 3) if plain_tps else None,
        })
        for arm in references:
            tps = s[arm].tok_s
            rows[-1].update({f"{arm}_tau": s[arm].tau, f"{arm}_tok_s": round(tps, 1),
                             f"{arm}_speedup": round(tps / plain_tps, 3) if plain_tps else None})
    summary = {}
    for temperature in temperatures:
        mine = [r for r in rows if r["temperature"] == temperature]
        summary[str(temperature)] = {"tau_macro": round(sum(r["tau"] for r in mine) / len(mine), 3),
                                     "speedup_macro": round(sum(r["speedup"] or 0 for r in mine) / len(mine), 3)}
        for arm in references:
            summary[str(temperature)][f"{arm}_speedup_macro"] = round(
                sum(r[f"{arm}_speedup"] or 0 for r in mine) / len(mine), 3)
            summary[str(temperature)][f"{arm}_tau_macro"] = round(sum(r[f"{arm}_tau"] for r in mine) / len(mine), 3)
    target = {"dtype": str(loaded.model.dtype).removeprefix("torch."), "plan": plan_summary(loaded),
              "verify_schedule": policy["verify_schedule"], "fixed_draft": bool(args.fixed_draft)}
    if composite is not None:  # how often the composite paid for the drafter's round, and whose drafts it verified
        target["composite"] = composite.stats()
    if "against" in references:
        target["against"] = str(args.against)
    report = _markdown(rows, summary, args, g, target, list(references))
    out = report_folder(args.drafter, args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(report)
    (out / "measure.json").write_text(json.dumps({"rows": rows, "summary": summary, "target": target}, indent=2))
    _plot(rows, temperatures, out)
    print(report)
    print(json.dumps({"bench": "dspark_measure", "drafter": str(args.drafter), "max_tokens": args.max_tokens,
                      "per_dataset": args.per_dataset, "target": target, "rows": rows, "summary": summary}))
    return 0


def _positions(engine) -> tuple[list[int], list[int]]:
    """Per draft position, the engine's running counts of the slots the target tested (sent
    by the verify schedule, the drafts before them kept) and kept: a proposal's slots past
    what the schedule sent were never tested, so they count nowhere."""
    return list(engine.drafting.reached_at), list(engine.drafting.accepted_at)


class _Tally:
    """One engine's decoding over a dataset: tokens, decode time, rounds and tokens emitted."""

    def __init__(self):
        self.tokens, self.seconds, self.rounds, self.emitted = 0, 0.0, 0, 0.0
        self.drafted = self.accepted = 0

    def add(self, live) -> None:
        self.tokens += live.tokens
        self.seconds += live.decode_s
        if live.speculation:
            self.drafted += live.speculation["drafted"]
            self.accepted += live.speculation["accepted"]
            self.rounds += live.speculation["rounds"]
            self.emitted += live.speculation["mean_accepted_length"] * live.speculation["rounds"]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float:
        return round(self.emitted / self.rounds, 3) if self.rounds else 1.0


REFERENCE_LABELS = {"ngram": "n-gram", "composite": "composite"}


def _label(arm: str, target: dict) -> str:
    return f"against {Path(target['against']).name}" if arm == "against" else REFERENCE_LABELS[arm]


def _markdown(rows, summary, args, g, target: dict, references: list[str]) -> str:
    policy = ("full proposals every round" if args.fixed_draft else "the cost-based draft length") + \
        f", verify schedule {target['verify_schedule']}"
    labels = [_label(a, target) for a in references]
    lines = [f"DSpark drafter {args.drafter}: {args.per_dataset} prompts per dataset, max_tokens {args.max_tokens}, "
             f"one request at a time, plain and DSpark interleaved in the same run, {policy}; the target as served "
             f"({target['dtype']}, {target['plan']})", "",
             "| dataset | T | tau | " + " | ".join(f"acc@{j + 1}" for j in range(g))
             + " | plain tok/s | DSpark tok/s | speedup |" + "".join(f" {x} tau | {x} speedup |" for x in labels),
             "|---|---|---|" + "---|" * g + "---|---|---|" + "---|---|" * len(labels)]
    for r in rows:
        acc = " | ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_by_position"])
        line = (f"| {r['dataset']} | {r['temperature']:g} | {r['tau']:.2f} | {acc} | {r['plain_tok_s']:.1f} | "
                f"{r['dspark_tok_s']:.1f} | {r['speedup']:.2f}x |")
        line += "".join(f" {r[f'{a}_tau']:.2f} | {r[f'{a}_speedup']:.2f}x |" for a in references)
        lines.append(line)
    lines.append("")
    for t, s in summary.items():
        others = ", ".join(f"{_label(a, target)} {s[f'{a}_speedup_macro']:.2f}x" for a in references)
        lines.append(f"T={float(t):g}: macro tau {s['tau_macro']:.2f}, macro speedup {s['speedup_macro']:.2f}x"
                     + (f" ({others})" if others else ""))
    if "composite" in target:
        c = target["composite"]
        asked = c["asked"].get("dspark", 0)
        lines.append(f"composite: the drafter was asked for {asked} of {c['rows']} drafting rows "
                     f"({asked / max(1, c['rows']):.0%}); verified candidates {c['chosen']}")
    return "\n".join(lines) + "\n"


def _plot(rows, temperatures, out: Path) -> None:
    from verispec.plots import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        acc = [a if a is not None else float("nan") for a in r["acceptance_by_position"]]
        axes[0].plot(range(1, len(acc) + 1), acc, marker="o",
                     linestyle="-" if r["temperature"] == 0 else "--", label=f"{r['dataset']} T={r['temperature']:g}")
    axes[0].set_xlabel("draft position")
    axes[0].set_ylabel("P(accepted | earlier drafts accepted)")
    axes[0].set_title("acceptance by position")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=7)
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    width = 0.8 / len(temperatures)
    for k, t in enumerate(temperatures):
        taus = [next((r["tau"] for r in rows if r["dataset"] == d and r["temperature"] == t), 0) for d in datasets]
        axes[1].bar([i + k * width for i in range(len(datasets))], taus, width, label=f"T={t:g}")
    axes[1].set_xticks([i + width * (len(temperatures) - 1) / 2 for i in range(len(datasets))], datasets)
    axes[1].set_ylabel("tau (tokens per target forward)")
    axes[1].set_title("tau by dataset")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(out / "measure.png", dpi=100)
    plt.close(fig)
