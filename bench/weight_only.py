"""Weight-only quantized linears on this CPU: which library kernel reads fewer bytes fast?

Before writing kernels of its own, verispec measured the maintained options on the
shapes of SmolLM2-135M (qkv 960x576, gate_up 3072x576, down 576x1536, lm_head
49152x576) at 1 row and 9 rows, weights cycled through enough copies to come from
memory as in a decode step:

* PyTorch's own weight-only ops: `torch._weight_int8pack_mm` (int8 per output channel)
  and `torch.ops.aten._weight_int4pack_mm_for_cpu` (int4 in groups of 32);
* torchao's CPU layouts (`quantize_` with Int8WeightOnlyConfig / Int4WeightOnlyConfig),
  when torchao is importable (it is not a verispec dependency: put it on PYTHONPATH, e.g.
  `pip install --target /tmp/tao --no-deps torchao`);
* oneDNN's packed bf16 linear (verispec's previous kernel) and bf16 F.linear;
* verispec's kernels (kernels/qlinear.cpp): bf16dot, q8_0 / q4_1 with VNNI.

Reports microseconds per call and the effective GB/s of the bytes each format stores,
against the machine's read bandwidth (the ceiling), as a table and one JSON line.

    .venv/bin/python bench/weight_only.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
MEMORY = 64 * 2**20


def bandwidth() -> float:
    x = torch.ones(128 * 1024 * 1024)
    best = min(_timed(lambda: x.sum()) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(make, weight: torch.Tensor, rows: int, stored_bytes: int) -> tuple[float, float]:
    copies = max(1, min(24, MEMORY // max(1, stored_bytes)))
    fns = [make(weight.clone()) for _ in range(copies)]
    x = torch.randn(rows, weight.shape[1])
    for fn in fns[:2]:
        fn(x)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for fn in fns:
            fn(x)
        best = min(best, (time.perf_counter() - t) / copies)
    return best * 1e6, stored_bytes / best / 1e9


def candidates():
    from verispec import kernels
    from verispec.models.linear import pack_weight, packed_linear
    from verispec.models.quant import interleave4, interleave16_blocks, quantize

    out = {}

    def bf16_packed(w):
        p = pack_weight(w.bfloat16())
        return lambda x: packed_linear(x.bfloat16(), p)

    out["oneDNN bf16 (packed)"] = (bf16_packed, 2.0)
    out["F.linear bf16"] = (lambda w: (lambda x, wb=w.bfloat16(): torch.nn.functional.linear(x.bfloat16(), wb)), 2.0)

    def int8pack(w):
        scale = w.abs().amax(1) / 127
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return lambda x: torch._weight_int8pack_mm(x.bfloat16(), q, scale.bfloat16())

    out["torch int8 weight-only"] = (int8pack, 1.0)

    def int4pack(w):
        n, k = w.shape
        g = w.reshape(n, -1, 32)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        zeros = lo + 8 * scale  # the op's zero point convention: w = (q - 8) * scale + zero
        sz = torch.stack([scale, zeros], -1).transpose(0, 1).contiguous().bfloat16()
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, sz)

    out["torch int4 weight-only"] = (int4pack, 0.5 + 4 / 32)
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

        def ao(config):
            def make(w):
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).bfloat16()
                lin.weight.data.copy_(w.bfloat16())
                quantize_(lin, config)
                return lambda x: lin(x.bfloat16())
            return make

        out["torchao int8 weight-only"] = (ao(Int8WeightOnlyConfig()), 1.0)
        out["torchao int4 weight-only"] = (ao(Int4WeightOnlyConfig(group_size=32)), 0.5 + 4 / 32)
    except Exception as e:  # noqa: BLE001 - not installed, or no CPU layout in this version
        out["torchao"] = (None, str(e).splitlines()[0][:80])
    if kernels.available():
        mod = kernels.load()
        if mod.bf16dot():
            out["verispec bf16dot"] = (lambda w: (lambda x, b=interleave4(w): mod.bf16_linear(
                x.bfloat16(), b, None, w.shape[0], False)), 2.0)
        if mod.int8dot():
            for fmt, size in (("q8_0", 34 / 32), ("q4_1", 20 / 32)):
                out[f"verispec {fmt}-i8"] = (lambda w, fmt=fmt: (lambda x, b=interleave16_blocks(
                    quantize(w, fmt), fmt): mod.qlinear16(x, b, None, kernels.FORMATS[fmt], w.shape[0])), size)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from verispec.models.kernel_plan import cpu_name

    bw = bandwidth()
    rows = []
    print(f"weight-only linears on {cpu_name()}, {args.threads} threads; read bandwidth {bw:.1f} GB/s")
    print(f"{'kernel':<26} {'shape':<12} {'us @1':>8} {'GB/s @1':>8} {'of bw':>6} {'us @9':>8}")
    for name, (make, size) in candidates().items():
        if make is None:
            print(f"{name:<26} not run: {size}")
            continue
        for role, (n, k) in SHAPES.items():
            w = torch.randn(n, k) * 0.05
            try:
                t1, g1 = measure(make, w, 1, int(n * k * size))
                t9, _ = measure(make, w, 9, int(n * k * size))
            except Exception as e:  # noqa: BLE001 - a kernel that refuses a shape: report it
                print(f"{name:<26} {role:<12} failed: {str(e).splitlines()[0][:60]}")
                continue
            print(f"{name:<26} {role:<12} {t1:8.1f} {g1:8.1f} {g1 / bw:6.0%} {t9:8.1f}")
            rows.append({"kernel": name, "role": role, "us_1": round(t1, 1), "gb_s_1": round(g1, 1),
                         "us_9": round(t9, 1)})
    print(json.dumps({"bench": "weight_only", "cpu": cpu_name(), "bandwidth_gb_s": round(bw, 1), "rows": rows}))


if __name__ == "__main__":
    main()
