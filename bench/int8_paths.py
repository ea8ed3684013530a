"""What the AMX-INT8 path of verispec's int8 kernels buys, where the CPU has AMX.

The q8_0-i8 / q4_1-i8 kernels (kernels/qlinear.cpp) compute a call's integer dots either
with AVX-512 VNNI (eight vpdpbusd per row and block: the work grows with the rows) or on
AMX-INT8 tiles (one tile instruction per block for up to 16 rows), bit-equal either way.
The kernel plan (models/kernel_plan.py) measures, per role, the row count from which the
tiles are faster, and the served model switches there. This times, on the served plan,
whole forwards after a 64-token context: one row's verify blocks of n tokens (the head at
every position) and decode steps of R rows of one token each, with the int8 roles on the
plan's paths and on VNNI alone (the peer: the kernel before the tiles), interleaved in
rounds, median of --repeats; as milliseconds and as plain decode steps of the VNNI plan.

    .venv/bin/python bench/int8_paths.py [--model gemma3-270m] [--tokens 1,4,8] [--rows 4,8,16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Prints a table and one JSON line. Needs a CPU with AMX-INT8 for the "
                                        "'planned' column to differ from VNNI.")
    ap.add_argument("--model", "-m", default="gemma3-270m", help="catalog model (default %(default)s)")
    ap.add_argument("--tokens", default="1,4,8", help="one row's forward sizes in tokens (default %(default)s)")
    ap.add_argument("--rows", default="4,8,16", help="decode steps of this many rows, one token each")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from verispec.models.decoder import BatchKV
    from verispec.models.kernel_plan import cpu_name
    from verispec.models.loader import load_for_serving

    model = load_for_serving(args.model, progress=False).model
    int8 = [layer for layers in model.linears().values() for layer in layers if layer._isa == 3]
    planned = {id(layer): layer.amx_from for layer in int8}
    if not any(planned.values()):
        print(f"note: no int8 role of {args.model}'s plan runs on AMX-INT8 tiles here "
              f"({model.kernel_plan.describe()}): both columns time the VNNI path")
    tokens = [int(t) for t in args.tokens.split(",") if t]
    rows = [int(r) for r in args.rows.split(",") if r]
    cases = [(f"1 row x {n} token{'s' if n > 1 else ''}", 1, n) for n in tokens] + [(f"{r} rows x 1 token", r, 1) for r in rows]
    cache = model.new_cache()
    seqs = [cache.allocate(64 + max(tokens) + 1) for _ in range(max(rows + [1]))]
    ids = torch.randint(0, model.args.vocab_size, (64 + max(tokens),))
    paths = {"planned": lambda layer: planned[id(layer)], "vnni": lambda layer: 0}
    times = {(c, p): [] for c in cases for p in paths}
    with torch.inference_mode():
        for s in seqs:
            model(ids[:64], BatchKV([s], [64]))
        for _ in range(args.repeats):
            for path, amx_from in paths.items():
                for layer in int8:
                    layer.run_on_amx_from(amx_from(layer))
                for case in cases:
                    _, r, n = case
                    batch = seqs[:r]
                    x = ids[64 : 64 + n].repeat(r)
                    t = time.perf_counter()
                    model(x, BatchKV(batch, [n] * r), logits_at=torch.arange(r * n))
                    times[(case, path)].append(time.perf_counter() - t)
                    for s in batch:
                        s.rollback(n)
    for layer in int8:
        layer.run_on_amx_from(planned[id(layer)])
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    step = ms[(cases[0], "vnni")] if cases[0][1:] == (1, 1) else 1.0
    print(f"{args.model}, served plan ({model.kernel_plan.describe()}), {args.threads} threads on {cpu_name()}, "
          f"context 64, median of {args.repeats}; steps = plain decode steps of the VNNI plan")
    print(f"{'forward':<20}{'vnni ms':>9}{'steps':>7}{'planned ms':>12}{'steps':>7}{'planned/vnni':>14}")
    out = []
    for case in cases:
        label, r, n = case
        v, a = ms[(case, "vnni")], ms[(case, "planned")]
        print(f"{label:<20}{v:>9.2f}{v / step:>7.2f}{a:>12.2f}{a / step:>7.2f}{a / v:>13.2f}x")
        out.append({"rows": r, "tokens": n, "vnni_ms": round(v, 3), "planned_ms": round(a, 3)})
    print(json.dumps({"bench": "int8_paths", "model": args.model, "cpu": cpu_name(), "threads": args.threads,
                      "plan": model.kernel_plan.describe(), "cases": out}))


if __name__ == "__main__":
    main()
