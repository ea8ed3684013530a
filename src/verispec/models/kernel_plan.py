"""Which kernel computes each matrix and the attention: chosen by measurement, per machine.

At the first start for a (model shapes, dtype, quantization, CPU, torch, threads) the
candidates of every matrix role (qkv, o_proj, gate_up, down, lm_head; models/linear.py
lists the kernels) are timed at the row counts the engine issues, 1 (a decode step) and
a verify block (`VERIFY_ROWS`), on as many copies of the weight as it takes to read it
from memory rather than from cache, as a decode step does; the attention kernels
likewise. The choice is cached as JSON in `<cache>/profiles/` and reused until
something in that key changes (`verispec profile --refresh` measures again).

What is chosen:

* **Quantization** (`quant="auto"`, the default): per role, the smallest weight format
  (q4_1, then q8_0) that reproduces the model's float32 weights *exactly*: a GGUF's own
  q4_1 / q8_0 tensors requantize to the same bytes (SmolLM2-135M: every layer q4_1, the
  tied lm_head q8_0), so those kernels compute the source model itself, in fewer bytes.
  Roles no format reproduces stay in the model's dtype. `quant="q8_0"` / `"q4_1"`
  quantize those roles to that format too (lossless roles keep their exact format): a
  lossy, different model, whose perplexity bench/quant_quality.py measures;
  `quant="none"` keeps the dtype everywhere.
* **Kernels**: per role the fastest candidate by t(1 row) + t(verify rows). In
  `mode="auto"` only batch-invariant kernels (verispec's own) are candidates whenever
  every role and the attention have one, whatever they cost against the fastest of any
  kernels (the note says how much): a row's logits then do not depend on what else is in
  the forward, so speculative decoding is token-identical to plain decoding in this
  dtype. (Until PLAN_VERSION 3 a 5% budget applied; on an Intel AMX host invariance
  measured +6.2%, all of it the invariant attention at 9 rows, the fastest plan was
  chosen, and greedy speculative output diverged from plain decoding there.)
  `mode="invariant"` / `"fastest"` force either; `"onednn"` is the PyTorch-only plan
  (oneDNN-packed weights, SDPA attention), what a machine without a C++ compiler gets.
* **dtype** (`preferred_dtype`, what `--dtype auto` serves): bfloat16 or float32, a
  batch-invariant plan first, then whichever measures faster (on the Intel AMX host
  Gemma-3's float32 plan measured faster but has no invariant kernel for its float32
  matrices, and served speculation there could change tokens). PLAN_VERSION 4: the
  int8-activation kernels are `-i8` (VNNI or AVX2) and a bf16 model has `bf16rows` where
  AVX512-BF16 is missing, so an AVX2-only host has an invariant plan for both models.
  PLAN_VERSION 5: a bf16 matrix may take `bf16amx` where the CPU has AMX (batch-invariant
  too; a 9-row verify block costs it ~1.2 single rows where bf16dot's costs ~2.5: on the
  Intel AMX host, what Gemma-3's verify forwards paid most for). PLAN_VERSION 6: where
  AMX-INT8 runs, a role given an `-i8` kernel is timed again on both of its paths (VNNI
  and AMX tiles, bit-equal) at `AMX_ROWS` row counts, and from the smallest count at which
  the tiles are faster there and at every larger count timed, its calls run on AMX
  (`q8_0-i8:R`; models/linear.py). The choice changes no result, only the price of a
  many-row call: Gemma-3's q8_0 lm_head, two fifths of a 4-row step's time here.
  PLAN_VERSION 7: a bf16 matrix may take `bf16cols` on AVX-512 (16-column tiles, no
  horizontal sums; batch-invariant): on the Xeon without AVX512-BF16 it beat bf16rows at
  1 and 9 rows on every Gemma-3 matrix (docs/kernels.md). PLAN_VERSION 8: `bf16cols` runs
  on AVX2 too, with the AVX-512 pass's bits (two 8-lane halves a tile): on an AVX2 EPYC it
  beat bf16rows on every Gemma-3 matrix at 1 and 9 rows, and an AVX2 host now serves the
  same bits as an AVX-512 one where both take it.

Checked by tests/test_kernel_plan.py (a plan is cached and reused, invalidated by its key;
forced modes; lossless quantization found exactly where it exists) and, end to end, by
tests/test_invariance.py.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from verispec.models import profiles
from verispec.models.linear import BF16_KERNELS, Linear, amx_allowed, kernel_runs

PLAN_VERSION = 8
VERIFY_ROWS = 9  # a verify block: 8 drafts + the pending token (the engine's default)
AMX_ROWS = (1, 2, 3, 4, 6, 8, 9, 12, 16)  # row counts an -i8 role's two paths are timed at
MEMORY_BYTES = 48 * 2**20  # weight copies per timing, so a decode-like read comes from DRAM
MAX_COPIES = 24
MODES = ("auto", "invariant", "fastest", "onednn")
QUANTS = ("auto", "none", "q8_0", "q4_1")
INVARIANT = {"bf16dot", "bf16amx", "bf16rows", "bf16cols", "q8_0", "q4_1", "q8_0-i8", "q4_1-i8"}  # by construction (kernels/qlinear.cpp)


@dataclass
class KernelPlan:
    linear: dict[str, str]  # role -> kernel
    attention: str  # "invariant" | "sdpa"
    invariant: bool  # every kernel batch-invariant: logits do not depend on the batch
    formats: dict[str, str] = field(default_factory=dict)  # role -> weight format
    timings: dict = field(default_factory=dict)  # role -> kernel -> {"1": us, "V": us}
    attention_timings: dict = field(default_factory=dict)
    key: dict = field(default_factory=dict)
    note: str = ""
    step_us: float = 0.0  # what the plan's kernels add up to per decode + verify step, for choosing a dtype
    amx_timings: dict = field(default_factory=dict)  # -i8 role -> rows -> [VNNI us, AMX-INT8 us]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "KernelPlan":
        return cls(**data)

    def describe(self) -> str:
        kernels = ", ".join(f"{r}={k}" for r, k in self.linear.items())
        return f"{kernels}; attention={self.attention}; {'batch-invariant' if self.invariant else 'not batch-invariant'}"


# -- what the machine is ------------------------------------------------------------------


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16",
              "amx_int8", "avx_vnni")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in have]
    except OSError:
        pass
    return []


def plan_key(model, dtype: torch.dtype, quant: str, mode: str) -> dict:
    from verispec import kernels

    digest = kernels.build_id()
    shapes = {role: [list(shape) for shape in sorted(set(found))] for role, found in _role_shapes(model).items()}
    return {"version": PLAN_VERSION, "cpu": cpu_name(), "flags": cpu_flags(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."), "quant": quant,
            "mode": mode, "shapes": shapes, "kernels": digest, "amx": amx_allowed(),
            "attention": [model.args.num_heads, model.args.num_kv_heads, model.args.head_dim,
                          list(model.args.layer_head_dims), list(model.args.layer_kv_heads)]}


def _role_shapes(model) -> dict[str, list[torch.Size]]:
    out = {}
    for role, layers in model.linears().items():
        out[role] = [torch.Size([layer.out_features, layer.in_features]) for layer in layers]
    return out


def profile_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return profiles.profile_path(f"{digest}.json")


# -- measuring ----------------------------------------------------------------------------


def _copies(weight: torch.Tensor, kernel: str, dtype: torch.dtype) -> list[Linear]:
    n = max(1, min(MAX_COPIES, MEMORY_BYTES // max(1, weight.numel() * weight.element_size())))
    out = []
    for _ in range(n):
        layer = Linear(weight.shape[1], weight.shape[0])
        layer.weight = torch.nn.Parameter(weight.to(dtype if kernel in ("aten", "onednn", *BF16_KERNELS) else torch.float32)
                                          .clone(), requires_grad=False)
        if not layer.use(kernel):
            return []
        out.append(layer)
    return out


def _time_calls(layers: list[Linear], rows: int, dtype: torch.dtype, passes: int) -> float:
    """Microseconds per call of `rows` rows, the best pass over every copy (read from memory)."""
    x = torch.randn(rows, layers[0].in_features).to(dtype)
    for layer in layers[:2]:
        layer(x)
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        for layer in layers:
            layer(x)
        best = min(best, (time.perf_counter() - t) / len(layers))
    return round(best * 1e6, 1)


@torch.inference_mode()
def time_linear(weight: torch.Tensor, kernel: str, dtype: torch.dtype, rows=(1, VERIFY_ROWS), passes: int = 3) -> dict:
    """Microseconds per call at each row count, cycling through copies (read from memory)."""
    layers = _copies(weight, kernel, dtype)
    return {"1" if m == 1 else "V": _time_calls(layers, m, dtype, passes) for m in rows} if layers else {}


@torch.inference_mode()
def time_amx_paths(weight: torch.Tensor, kernel: str, dtype: torch.dtype, passes: int = 3) -> dict[int, list[float]]:
    """An -i8 kernel's two paths, VNNI and AMX-INT8 tiles, at each of AMX_ROWS:
    {rows: [VNNI us, AMX us]}; {} where AMX-INT8 does not run."""
    vnni, amx = _copies(weight, kernel, dtype), _copies(weight, f"{kernel}:1", dtype)
    if not vnni or not amx or not amx[0].amx_from:
        return {}
    return {m: [_time_calls(vnni, m, dtype, passes), _time_calls(amx, m, dtype, passes)] for m in AMX_ROWS}


def amx_threshold(timings: dict) -> int:
    """The smallest row count from which the AMX path was faster at every count timed (0: none)."""
    start = 0
    for m in sorted(timings, key=int):
        vnni, amx = timings[m]
        start = (start or int(m)) if amx < vnni else 0
    return start


@torch.inference_mode()
def time_attention(model, kernel: str, keys: int = 256, passes: int = 5) -> dict:
    import torch.nn.functional as F

    a = model.args
    out = {}
    for n in (1, VERIFY_ROWS):
        q = torch.randn(n, a.num_heads, a.head_dim)
        k = torch.randn(a.num_kv_heads, keys, a.head_dim)
        v = torch.randn(a.num_kv_heads, keys, a.head_dim)
        mask = None if n == 1 else torch.arange(keys)[None, :] <= torch.arange(keys - n, keys)[:, None]
        if kernel == "invariant":
            from verispec import kernels

            mod = kernels.load()

            def call():
                return mod.attention(q, k, v, mask, 0.125)
        else:
            qs, ks, vs = q.transpose(0, 1)[None], k[None], v[None]

            def call():
                return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=0.125, enable_gqa=True)
        call()
        best = float("inf")
        for _ in range(passes):
            t = time.perf_counter()
            for _ in range(20):
                call()
            best = min(best, (time.perf_counter() - t) / 20)
        out["1" if n == 1 else "V"] = round(best * 1e6, 1)
    return out


def _score(t: dict) -> float:
    return t.get("1", float("inf")) + t.get("V", float("inf"))


def lossless_formats(model) -> dict[str, str]:
    """Per role, the smallest format (q4_1, then q8_0) that reproduces every weight of the
    role exactly (needs the float32 weights); roles without one are left out."""
    from verispec.models.quant import dequantize, quantize

    found = {}
    for role, layers in model.linears().items():
        weights = [layer.weight for layer in layers if layer.weight.numel()]
        if not weights or any(w.dtype != torch.float32 or w.shape[1] % 32 for w in weights):
            continue
        for fmt in ("q4_1", "q8_0"):
            if all(torch.equal(dequantize(quantize(w, fmt), fmt, w.shape[1]), w) for w in weights):
                found[role] = fmt
                break
    return found


def candidates(dtype: torch.dtype, fmt: str | None) -> list[str]:
    if fmt is not None:
        return [k for k in (f"{fmt}-i8", fmt) if kernel_runs(k, dtype)]
    base = ["bf16amx", "bf16dot", "bf16cols", "bf16rows", "onednn", "aten"] if dtype == torch.bfloat16 else ["onednn", "aten"]
    return [k for k in base if kernel_runs(k, dtype)]


def measure_plan(model, dtype: torch.dtype, quant: str = "auto", mode: str = "auto",
                 formats: dict[str, str] | None = None) -> KernelPlan:
    """Time the candidates of every role and choose (the model's Linears still hold their
    float weights; `formats` are the roles' weight formats, from lossless_formats when
    quant is "auto")."""
    from verispec import kernels

    roles = model.linears()
    if quant in ("q8_0", "q4_1"):  # lossless formats where one exists, the asked one for the rest
        formats = {**{role: quant for role, layers in roles.items() if layers and layers[0].in_features % 32 == 0},
                   **(formats or {})}
    elif quant == "none":
        formats = {}
    formats = dict(formats or {}) if mode != "onednn" else {}  # PyTorch's kernels run the dtype's weights only
    timings: dict[str, dict] = {}
    for role, layers in roles.items():
        if not layers:
            continue
        weight = layers[0].weight.detach()
        timings[role] = {}
        for kernel in candidates(dtype, formats.get(role)) if layers[0].in_features % 32 == 0 else ["onednn", "aten"]:
            t = time_linear(weight, kernel, dtype)
            if t:
                timings[role][kernel] = t
    have_kernels = kernels.available()
    attention = {"sdpa": time_attention(model, "sdpa")}
    if have_kernels and all(model.args.head_dim_at(i) % 16 == 0 for i in range(model.args.num_layers)):
        attention["invariant"] = time_attention(model, "invariant")

    def best(role, allowed):
        options = {k: t for k, t in timings[role].items() if allowed(k)}
        return min(options, key=lambda k: _score(options[k])) if options else None

    counts = {role: len(layers) for role, layers in roles.items()}

    def total(choice, att):
        return sum(counts[r] * _score(timings[r][k]) for r, k in choice.items()) + \
            model.args.num_layers * _score(attention[att])

    fastest = {r: best(r, lambda k: True) for r in timings}
    fastest_att = min(attention, key=lambda a: _score(attention[a]))
    invariant = {r: best(r, lambda k: k in INVARIANT) for r in timings}
    # gemma4's per-layer embeddings and routed experts multiply outside the planned roles (on
    # token subsets that depend on the batch, for experts): no plan makes such a model invariant
    unplanned = bool(model.args.per_layer_input or model.args.moe)
    can_invariant = all(invariant.values()) and "invariant" in attention and not unplanned
    cost = (total(invariant, "invariant") / total(fastest, fastest_att) - 1) if can_invariant else None
    if mode == "onednn":
        choice, att = {r: "onednn" if "onednn" in timings[r] else "aten" for r in timings}, "sdpa"
        note = "PyTorch-only kernels (--kernels onednn; weights in the dtype, whatever --quant says)"
    elif mode == "invariant" or (mode == "auto" and can_invariant):
        if not can_invariant:
            from verispec.errors import UserError

            if unplanned:
                raise UserError("no batch-invariant plan for this model: its per-layer embeddings or routed experts "
                                "multiply outside the planned matrices; use --kernels auto or fastest")
            raise UserError("no batch-invariant kernel runs here for every matrix (verispec's kernels need a C++ "
                            "compiler and inputs a multiple of 32); use --kernels auto or fastest")
        choice, att = invariant, "invariant"
        note = f"batch-invariant kernels, {cost:+.1%} against the fastest of any kernels"
    else:
        choice, att = fastest, fastest_att
        note = ("fastest kernels" + (f" (--kernels fastest): batch invariance would cost {cost:+.1%}"
                                     if cost is not None else ": no batch-invariant plan runs here"))
    # matrices outside the plan (gemma4's) keep a model from being invariant even when the
    # fastest kernels of every role happen to be invariant ones (bf16amx often is on AMX)
    is_invariant = all(k in INVARIANT for k in choice.values()) and att == "invariant" and not unplanned
    used = {r: formats.get(r, str(dtype).removeprefix("torch.")) if choice[r] in INVARIANT - {"bf16dot", "bf16amx"}
            else str(dtype).removeprefix("torch.") for r in choice}
    step_us = round(total(choice, att), 1)
    choice, amx = dict(choice), {}  # -i8 roles: from how many rows their calls run on AMX-INT8 tiles (bit-equal, so any choice is safe)
    for role, kernel in choice.items():
        if kernel.endswith("-i8") and (paths := time_amx_paths(roles[role][0].weight.detach(), kernel, dtype)):
            amx[role] = {str(m): t for m, t in paths.items()}
            if start := amx_threshold(amx[role]):
                choice[role] = f"{kernel}:{start}"
    return KernelPlan(choice, att, is_invariant, used, timings, attention, {}, note, step_us, amx)


def plan_for(model, dtype: torch.dtype, quant: str = "auto", mode: str = "auto", refresh: bool = False,
             progress: bool = False) -> KernelPlan:
    """The cached plan for this model and machine, measured first if there is none."""
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {', '.join(MODES)}, got {mode!r}")
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    key = plan_key(model, dtype, quant, mode)
    path = profile_path(key)
    if path.is_file() and not refresh:
        try:
            plan = KernelPlan.from_json(json.loads(path.read_text()))
            if plan.key == key:
                return plan
        except (ValueError, TypeError, KeyError):
            pass
    if progress:
        import sys

        print("verispec: measuring this machine's kernels for this model (once; cached)...", file=sys.stderr, flush=True)
    formats = lossless_formats(model) if quant != "none" else None
    plan = measure_plan(model, dtype, quant, mode, formats)
    plan.key = key
    profiles.save_profile(path, plan.to_json(), indent=1)
    return plan


def format_plan(plan: KernelPlan) -> str:
    """The table `verispec profile` prints."""
    lines = [f"{'role':<9} {'kernel':<12} {'1 row us':>9} {f'{VERIFY_ROWS} rows us':>10}  chosen"]
    for role, options in plan.timings.items():
        for kernel, t in sorted(options.items(), key=lambda kv: _score(kv[1])):
            mark = "*" if plan.linear.get(role, "").partition(":")[0] == kernel else ""
            lines.append(f"{role:<9} {kernel:<12} {t.get('1', float('nan')):>9.1f} {t.get('V', float('nan')):>10.1f}  {mark}")
    for kernel, t in plan.attention_timings.items():
        mark = "*" if plan.attention == kernel else ""
        lines.append(f"{'attention':<9} {kernel:<12} {t.get('1', float('nan')):>9.1f} {t.get('V', float('nan')):>10.1f}  {mark}")
    for role, t in plan.amx_timings.items():
        start = plan.linear.get(role, "").partition(":")[2]
        lines.append(f"{role} on AMX-INT8 tiles {f'from {start} rows' if start else 'never'} (bit-equal to VNNI); "
                     "rows: VNNI / AMX us: " + ", ".join(f"{m}: {v:.0f} / {a:.0f}" for m, (v, a) in t.items()))
    lines.append(f"formats: {', '.join(f'{r}={f}' for r, f in plan.formats.items())}")
    lines.append(f"-> {plan.note}; {'batch-invariant' if plan.invariant else 'not batch-invariant'}")
    return "\n".join(lines)


def preferred_dtype(plans: dict) -> "torch.dtype":
    """Of {dtype: KernelPlan}, the one `--dtype auto` serves: a batch-invariant plan first
    (speculation and batching then change no token), then the faster."""
    return min(plans, key=lambda d: (not plans[d].invariant, plans[d].step_us))
