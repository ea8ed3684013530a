"""Verify scheduling arms on the shared eval prompts, at several concurrencies and temperatures.

A catalog model (`--model`, default SmolLM2-135M-Instruct) in the served plan, `--prompts`
prompts from each of the four eval sets (../shared/eval-prompts; through the chat template
where the model has one, as completions for a base model), `--max-tokens` new tokens each,
a closed loop of C concurrent requests inside one engine (a new request joins as soon as
one finishes; the engine streams every token; no HTTP, which bench/serve_load.py
measures), every arm in the same run, at T = 0 and T = 1 (at T > 0 the rest of the
model's recommended sampling too, what a request that sets only the temperature gets:
SmolLM2's top-p 0.9, Gemma 3's top-k 64 and top-p 0.95):

    none              no speculation
    ngram             n-gram lookup, the per-row cost policy (verispec's default for n-gram)
    ngram-strict      n-gram, Algorithm 1 strict (engine/verify_schedule.py)
    ngram-production  n-gram, Algorithm 1 production form
    dspark-fixed3/7   the shipped DSpark drafter, 3 / 7 drafts verified every round
    dspark-threshold  the shipped drafter with its calibrated thresholds and the cost
                      policy (what `verispec serve` runs today)
    dspark-strict     the shipped drafter, Algorithm 1 strict (a row drafts where what its
                      rounds have kept pays for them: engine/draft_length.py)
    dspark-strict-rate  the same, a row's drafting decided by the acceptance-rate model alone
                      (before 2026-12-06's stage 25)
    dspark-production the shipped drafter, Algorithm 1 production form
    composite-strict  the shipped drafter and n-gram for every row, the better candidate
                      each round (drafting/composite.py), Algorithm 1 strict (served)
    composite-strict-promised  composite-strict with a sampled row's paid-source gain as its
                      confidences promise it, not corrected by what verification kept (before
                      stage 26 of docs/dspark-campaign.md)
    composite-production  the same, Algorithm 1 production form

Reported per arm, concurrency and temperature: aggregate tok/s (all generated tokens over
the run's wall time), per-stream tok/s (a request's tokens over its own decode time,
mean), tau (tokens per target forward of speculating rows) and verify tokens per request
per step (drafts sent to verification per row-round). A table, one JSON line, and
bench_scheduler.png (aggregate tok/s against concurrency, one line per arm). Says which
CPU it ran on.

Noise. A closed loop of exactly 16 prompts at 16 streams is one wave: its wall time is its
longest request's, so a cell moves with how many tokens the others happened to stop at
(at T = 1, 1,024 to 1,468 of 1,536 tokens over three runs of the same arm on gemma3).
`--per-stream K` gives each concurrency C at least K * C requests (more prompts from
each set, in the sets' order), so the loop stays full until its tail and a cell measures
the concurrency it names; `--repeats R` runs every cell R times, the arms interleaved in
each round, and reports the mean (and each run's value in the JSON line).

    .venv/bin/python bench/scheduler.py                       # 2 prompts per set, 96 tokens
    .venv/bin/python bench/scheduler.py --model gemma3-270m --arms none,ngram-strict,composite-strict \
        --prompts 4 --per-stream 4 --repeats 3               # the run that chooses a default
    .venv/bin/python bench/scheduler.py --prompts 12 --max-tokens 192 --arms none,ngram,dspark-strict
    .venv/bin/python bench/scheduler.py --model gemma3-270m --arms none,ngram-strict,dspark-strict,composite-strict
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

ARMS = ("none", "ngram", "ngram-strict", "ngram-production", "dspark-fixed3", "dspark-fixed7", "dspark-threshold",
        "dspark-strict", "dspark-strict-rate", "dspark-production", "composite-strict", "composite-strict-promised",
        "composite-production")


def make_arm(loaded, arm: str, step_costs=None):
    from verispec.drafting.factory import build_drafter, shipped_dspark
    from verispec.drafting.ngram import NgramProvider
    from verispec.engine.engine import Engine, EngineConfig

    config = {"kv_budget": 2**32, "max_rows": 32}
    drafter = None
    if arm.startswith("ngram"):
        drafter = NgramProvider()
    elif arm.startswith("dspark"):
        drafter = shipped_dspark(loaded, torch.bfloat16)
    elif arm.startswith("composite"):
        drafter = build_drafter(loaded, "composite", None, torch.bfloat16)
    if arm.startswith("dspark-fixed"):
        config.update(adaptive_draft=False, num_draft_tokens=int(arm.removeprefix("dspark-fixed")))
        drafter.threshold = 0.0  # every drafted token goes to verification
    if arm.endswith("-promised"):
        drafter.judge_by_kept = False
        arm = arm.removesuffix("-promised")
    if arm.endswith("-rate"):
        config["judge_paid_by_yield"] = False
        arm = arm.removesuffix("-rate")
    if arm.endswith("-strict") or arm.endswith("-production"):
        config["verify_schedule"] = arm.rsplit("-", 1)[1]
    return Engine(loaded.model, loaded.tokenizer, loaded.stop_ids, EngineConfig(**config), drafter=drafter,
                  step_costs=step_costs)


def closed_loop(engine, prompts: list[list[int]], concurrency: int, max_tokens: int, params) -> dict:
    from verispec.engine.request import Collector, GenerationRequest

    class Sink(Collector):
        done = False

        def __call__(self, out):
            super().__call__(out)
            self.done = self.done or out.finished

    queue = list(prompts)
    live: list[Sink] = []
    done = []
    start = time.perf_counter()
    while queue or live:
        while queue and len(live) < concurrency:
            c = Sink()
            engine.submit(GenerationRequest(queue.pop(0), max_tokens, params), c)
            live.append(c)
        engine.step()
        finished = [c for c in live if c.done]
        for c in finished:
            live.remove(c)
            done.append(c.result(0))
    wall = time.perf_counter() - start
    tokens = sum(r.completion_tokens for r in done)
    streams = [max(0, r.completion_tokens - 1) / r.decode_time for r in done if r.decode_time]
    rounds = sum(r.speculation["rounds"] for r in done if r.speculation)
    emitted = sum(r.speculation["mean_accepted_length"] * r.speculation["rounds"] for r in done if r.speculation)
    drafted = sum(r.speculation["drafted"] for r in done if r.speculation)
    return {"agg_tok_s": tokens / wall, "stream_tok_s": sum(streams) / len(streams) if streams else 0.0,
            "tau": emitted / rounds if rounds else 1.0, "verify_per_round": drafted / rounds if rounds else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default="smollm2-135m-instruct", help="catalog model (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per eval set (four sets)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--png", default="bench_scheduler.png")
    ap.add_argument("--per-stream", type=int, default=0, metavar="K",
                    help="at concurrency C run at least K*C requests (more prompts per set); 0: --prompts per set "
                         "at every concurrency")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every cell, arms interleaved; the table shows means")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from spec import workloads

    from verispec.engine.sampling import SamplingParams
    from verispec.models.kernel_plan import cpu_name
    from verispec.models.loader import load_for_serving

    from verispec.models.registry import REGISTRY

    if args.model not in REGISTRY:
        raise SystemExit(f"unknown model {args.model!r}; the catalog has {', '.join(REGISTRY)}")
    loaded = load_for_serving(args.model, progress=False)
    recommended = dict(REGISTRY[args.model].sampling)
    if args.prompts < 1 or args.per_stream < 0 or args.repeats < 1:
        raise SystemExit("--prompts and --repeats must be at least 1, --per-stream at least 0")
    concurrencies = [int(x) for x in args.concurrency.split(",")]
    per_set = {c: max(args.prompts, -(-args.per_stream * c // 4)) for c in concurrencies}
    most = max(per_set.values())
    pool = workloads(loaded.tokenizer, most, ["eval"])["eval"]  # `most` of each set, the sets in turn
    per_set_pool = [pool[i:i + most] for i in range(0, len(pool), most)]

    def prompts_for(c: int) -> list[list[int]]:  # the first n of every set, the sets in turn
        return [p for chunk in per_set_pool for p in chunk[:per_set[c]]]

    prompts = prompts_for(min(concurrencies))
    arms = args.arms.split(",")
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}; known: {', '.join(ARMS)}")
    from verispec.engine.step_costs import step_costs_for

    costs = step_costs_for(loaded.model)[0]  # one SPS table for every arm, so none prices its steps apart
    engines = {arm: make_arm(loaded, arm, costs) for arm in arms}
    for engine in engines.values():  # warm-up
        closed_loop(engine, prompts[:1], 1, 8, SamplingParams())
    rows = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        params = SamplingParams() if temperature == 0 else SamplingParams(**{**recommended, "temperature": temperature})
        for c in concurrencies:
            runs = {arm: [] for arm in engines}
            for _ in range(args.repeats):
                for arm, engine in engines.items():  # interleaved: every arm at this point before the next
                    runs[arm].append(closed_loop(engine, prompts_for(c), c, args.max_tokens, params))
            for arm, results in runs.items():
                mean = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
                rows.append({"temperature": temperature, "concurrency": c, "arm": arm, "requests": len(prompts_for(c)),
                             **{k: round(v, 2) for k, v in mean.items()},
                             "runs_agg_tok_s": [round(r["agg_tok_s"], 2) for r in results]})
            base = next((r["agg_tok_s"] for r in rows if r["arm"] == "none" and r["temperature"] == temperature
                         and r["concurrency"] == c), None)
            for row in rows:
                if row["temperature"] == temperature and row["concurrency"] == c and base:
                    row["vs_none"] = round(row["agg_tok_s"] / base, 3)
    plan = getattr(loaded.model, "kernel_plan", None)
    print(f"\n{args.model} ({plan.describe() if plan else 'PyTorch kernels'}), eval prompts "
          f"({', '.join(f'{len(prompts_for(c))} at {c}' for c in concurrencies)} streams), max_tokens {args.max_tokens}, "
          f"closed loop per concurrency, mean of {args.repeats} run(s) a cell, {args.threads} threads on {cpu_name()}")
    w = max(19, max(len(a) for a in arms) + 1)  # the arm column, as wide as its longest name
    print(f"{'T':>3}{'conc':>5} {'arm':<{w}}{'agg tok/s':>10}{'vs none':>8}{'stream':>8}{'tau':>6}{'verify/rnd':>11}"
          + ("  runs (agg tok/s)" if args.repeats > 1 else ""))
    for r in rows:
        print(f"{r['temperature']:>3.0f}{r['concurrency']:>5} {r['arm']:<{w}}{r['agg_tok_s']:>10.1f}"
              f"{r.get('vs_none', 0):>7.2f}x{r['stream_tok_s']:>8.1f}{r['tau']:>6.2f}{r['verify_per_round']:>11.2f}"
              + (f"  {' / '.join(f'{v:.1f}' for v in r['runs_agg_tok_s'])}" if args.repeats > 1 else ""))
    means = {}
    for arm in engines:
        cells = [r["vs_none"] for r in rows if r["arm"] == arm and "vs_none" in r]
        if cells:
            means[arm] = round(sum(cells) / len(cells), 3)
    if means:  # the rule that chooses an embedded model's default source (README, "Speculation by default")
        print(f"mean vs none over {len(rows) // len(engines)} cells: "
              + ", ".join(f"{arm} {m:.3f}x" for arm, m in means.items()))
    print(json.dumps({"bench": "scheduler", "model": args.model, "cpu": cpu_name(), "threads": args.threads,
                      "prompts_per_set": args.prompts, "per_stream": args.per_stream, "repeats": args.repeats,
                      "max_tokens": args.max_tokens, "mean_vs_none": means, "rows": rows}))
    _plot(rows, Path(args.png))


def _plot(rows: list[dict], png: Path) -> None:
    from verispec.plots import pyplot

    plt = pyplot()
    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.5), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for arm in dict.fromkeys(r["arm"] for r in rows):
            pts = [(r["concurrency"], r["agg_tok_s"]) for r in rows if r["arm"] == arm and r["temperature"] == t]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=arm,
                    linestyle="--" if arm == "none" else "-")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("aggregate tok/s")
        ax.set_title(f"T = {t:g}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    print(f"plot: {png}", file=sys.stderr)


if __name__ == "__main__":
    main()
