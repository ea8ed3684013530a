"""What the lm_head costs inside a verify forward: the price a lazy head could save.

A verify block of n tokens (the pending token and n - 1 drafts) runs the target over all n
and, today, its lm_head at all n positions. Verification reads position j's logits only if
every draft before j was kept, so a head computed a prefix at a time would skip most rows of a
big-vocabulary head (gemma3-270m: 262,144 rows, half the model's weights). This times, on the
served plan, one forward of n tokens after a 64-token context with the head at all n positions
and at only the first k, and prints each as milliseconds and as plain decode steps (one token,
head at one position). Median of --repeats, in rounds over the cases.

    .venv/bin/python bench/verify_head.py [--model gemma3-270m] [--sizes 4,8] [--repeats 25]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", "-m", default="gemma3-270m")
    ap.add_argument("--sizes", default="4,8", help="verify block sizes (tokens)")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from verispec.models.decoder import BatchKV
    from verispec.models.kernel_plan import cpu_name
    from verispec.models.loader import load_for_serving

    model = load_for_serving(args.model, progress=False).model
    sizes = [int(s) for s in args.sizes.split(",")]
    cases = [("plain step", 1, 1)]
    for n in sizes:
        cases += [(f"verify {n}, head at {k}", n, k) for k in sorted({n, 2, 1}, reverse=True) if k <= n]
    cache = model.new_cache()
    seq = cache.allocate(64 + max(sizes) + 1)
    ids = torch.randint(0, model.args.vocab_size, (64 + max(sizes),))
    times = {c: [] for c in cases}
    with torch.inference_mode():
        model(ids[:64], BatchKV([seq], [64]))
        for _ in range(args.repeats):
            for case in cases:
                _, n, k = case
                at = torch.arange(k)
                t = time.perf_counter()
                model(ids[64 : 64 + n], BatchKV([seq], [n]), logits_at=at)
                times[case].append(time.perf_counter() - t)
                seq.rollback(n)
    ms = {c: statistics.median(ts) * 1e3 for c, ts in times.items()}
    step = ms[cases[0]]
    print(f"{args.model}, served plan, {args.threads} threads on {cpu_name()}, context 64, median of {args.repeats}")
    print(f"{'forward':<22}{'ms':>8}{'steps':>8}")
    rows = []
    for case in cases:
        label, n, k = case
        print(f"{label:<22}{ms[case]:>8.2f}{ms[case] / step:>8.2f}")
        rows.append({"tokens": n, "head_positions": k, "ms": round(ms[case], 3), "steps": round(ms[case] / step, 3)})
    print(json.dumps({"bench": "verify_head", "model": args.model, "cpu": cpu_name(), "threads": args.threads,
                      "rows": rows}))


if __name__ == "__main__":
    main()
