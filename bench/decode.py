"""Decode benchmark: TTFT and decode tok/s of one request, per model, against the peers.

For each model (default: smollm2-135m-instruct and gemma3-270m), in the same run and on
the same weights:

* verispec as served (`load_for_serving`: the kernel plan measured for this machine,
  lossless weight formats, `--dtype auto`), the same with PyTorch's kernels only
  (oneDNN-packed bf16, SDPA: what verispec ran before its own kernels), bf16 with
  verispec's batch-invariant kernels and no quantization, and `--quant q8_0` / `q4_1`
  (every matrix no lossless format reproduces in that format: a lossy model,
  bench/quant_quality.py);
* HF transformers `generate` (bf16, sdpa attention) on the converted HF folder;
* llama.cpp through llama-cpp-python on the original GGUF (SmolLM2 Q4_1, Gemma-3
  Q4_K_M), when installed.

Runs are interleaved (every engine once per round, `--rounds` rounds) and the best round
per engine is reported, because this machine is shared and noisy: the best of several
is the least disturbed measurement of each, and ratios between engines are what count.
Each row also shows its memory-bandwidth ceiling: measured read bandwidth / the weight
bytes a decode step reads (per the engine's weight formats).

`--profile` adds a per-step breakdown of verispec's default engine (torch.profiler over
decode steps): matmuls, attention, norms and elementwise ops, sampling, and the rest
(Python and dispatch: wall time minus the ops).

    .venv/bin/python bench/decode.py                      # both models, 2 threads, 128 new tokens
    .venv/bin/python bench/decode.py --models smollm2-135m-instruct --rounds 5 --profile

The llama.cpp peer (optional) compiles from source in a few minutes; its default native
build can crash in AMX paths on some hosts, so build it portable with AVX-512:
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \\
      -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" .venv/bin/pip install llama-cpp-python
Prints a table per model and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
import sys

import torch

CHAT_PROMPT = (
    "You are reviewing a pull request that adds speculative decoding to an inference server. "
    "Explain, step by step, what a reviewer should check to be sure the change is lossless: "
    "how greedy verification works, how sampling verification keeps the target distribution, "
    "what must happen to the KV cache when drafted tokens are rejected, and which tests would "
    "prove it. Be concrete and thorough."
)
RAW_PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
              "combined movable metal type, oil-based ink and a screw press. In the decades that followed,")
BYTES_PER_WEIGHT = {"float32": 4.0, "bfloat16": 2.0, "q8_0": 34 / 32, "q4_1": 20 / 32}


def measure_bandwidth() -> float:
    """Read bandwidth in GB/s: a sum over a 512 MB float32 buffer (best of 5)."""
    x = torch.ones(128 * 1024 * 1024)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def weight_bytes(model, formats: dict[str, str] | None = None) -> int:
    """Bytes of weights a decode step reads: every matrix once, in its format, plus the
    lm_head (the whole vocabulary table; the embedding lookup reads one row)."""
    a = model.args
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    sizes = {"qkv": a.hidden_size * (q + 2 * kv), "o_proj": q * a.hidden_size,
             "gate_up": 2 * a.hidden_size * a.intermediate_size, "down": a.hidden_size * a.intermediate_size}
    dtype = str(model.dtype).removeprefix("torch.")
    formats = formats or {}
    total = sum(a.num_layers * n * BYTES_PER_WEIGHT[formats.get(r, dtype)] for r, n in sizes.items())
    total += a.vocab_size * a.hidden_size * BYTES_PER_WEIGHT[formats.get("lm_head", dtype)]
    return int(total)


def run_ours(loaded, prompt_ids, n_new):
    from verispec.engine.generate import GenerationStats, stream_generate

    stats = GenerationStats()
    for _ in stream_generate(loaded.model, prompt_ids, n_new, stop_ids=(), stats=stats):
        pass
    return stats.prefill_s, stats.decode_tok_s, stats.generated_tokens


class _StepClock:
    """A transformers LogitsProcessor that only records when each step's logits arrive."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def run_hf(model, prompt_ids, n_new):
    from transformers import LogitsProcessorList

    clock = _StepClock()
    ids = torch.tensor([prompt_ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                       do_sample=False, logits_processor=LogitsProcessorList([clock]), pad_token_id=0)
    ttft = clock.times[0] - t0
    return ttft, (len(clock.times) - 1) / (clock.times[-1] - clock.times[0]), len(clock.times)


def run_llamacpp(llm, prompt_ids, n_new):
    llm.reset()
    times = []
    t0 = time.perf_counter()
    for i, _tok in enumerate(llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True)):
        times.append(time.perf_counter())
        if i + 1 >= n_new:
            break
    return times[0] - t0, (len(times) - 1) / (times[-1] - times[0]), len(times)


@torch.inference_mode()
def step_breakdown(model, prompt_ids, steps: int = 32) -> dict[str, float]:
    """Milliseconds per decode step by kind of work: verispec's matmul and attention
    kernels timed by wrapping their calls, PyTorch's ops by torch.profiler (self CPU
    time: norms, RoPE, residuals, casts, PyTorch's own matmuls and SDPA where the plan
    uses them), sampling, and the rest: Python and dispatch (wall time minus all that)."""
    from torch.profiler import ProfilerActivity, profile

    from verispec.engine.sampling import SamplingParams, process_logits, sample
    from verispec.models import decoder, linear
    from verispec.models.decoder import BatchKV

    timed = {"matmuls": 0.0, "attention": 0.0}
    inner_linear = linear.linear_forward

    def timed_linear(layer, x):
        t = time.perf_counter()
        y = inner_linear(layer, x)
        timed["matmuls"] += time.perf_counter() - t
        return y

    inner_attend = decoder.Decoder._attend_row

    def timed_attend(self, *a):
        t = time.perf_counter()
        y = inner_attend(self, *a)
        timed["attention"] += time.perf_counter() - t
        return y

    cache = model.new_cache()
    seq = cache.allocate(len(prompt_ids) + steps + 8)
    out = model(torch.tensor(prompt_ids), BatchKV([seq], [len(prompt_ids)]))
    params = [SamplingParams()]
    token = sample(process_logits(out.logits, params), params, [None])
    for _ in range(3):  # warm-up
        model(token, BatchKV([seq], [1]))
        seq.rollback(1)
    def run(n):
        nonlocal token
        for _ in range(n):
            out = model(token, BatchKV([seq], [1]))
            token = sample(process_logits(out.logits, params), params, [None])
            seq.rollback(1)

    # wall time and verispec's kernels without the profiler (its per-op cost would count as
    # dispatch), then PyTorch's ops under it, on the same steps
    linear.linear_forward, decoder.Decoder._attend_row = timed_linear, timed_attend
    try:
        t0 = time.perf_counter()
        run(steps)
        wall = (time.perf_counter() - t0) / steps * 1000
    finally:
        linear.linear_forward, decoder.Decoder._attend_row = inner_linear, inner_attend
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(steps)
    ops = {"torch matmuls": ("linear", "mm", "addmm", "matmul", "_linear_pointwise"),
           "torch attention": ("scaled_dot_product", "_flash_attention"),
           "sampling": ("argmax", "softmax", "multinomial", "topk", "sort")}
    totals = {"matmuls": timed["matmuls"] * 1000 / steps, "attention": timed["attention"] * 1000 / steps}
    other = 0.0
    for event in prof.key_averages():
        name = event.key.lower()
        ms = event.self_cpu_time_total / 1000 / steps
        kind = next((k for k, needles in ops.items() if any(n in name for n in needles)), None)
        if kind in ("torch matmuls", "torch attention"):
            continue  # inside the wrapped calls, counted there
        if kind == "sampling":
            totals["sampling"] = totals.get("sampling", 0.0) + ms
        elif name.startswith("aten::"):
            other += ms
    totals["norms, RoPE, residuals and other PyTorch ops"] = other
    accounted = sum(totals.values())
    return {**{k: round(v, 2) for k, v in totals.items()}, "python and dispatch": round(max(0.0, wall - accounted), 2),
            "step (wall)": round(wall, 2)}


def bench_model(name: str, args, bandwidth: float) -> dict:
    from verispec.errors import UserError
    from verispec.models.loader import load_for_serving, load_model
    from verispec.models.registry import model_gguf_path
    from verispec.models.tokenizer import encode_chat, encode_prompt, has_chat_template

    engines, loaded = {}, {}
    loaded["verispec"] = load_for_serving(name)
    loaded["verispec bf16, PyTorch kernels"] = load_model(name, dtype=torch.bfloat16)
    try:  # needs AVX512-BF16 (verispec's bf16dot kernel): hosts without it skip the row
        loaded["verispec bf16 invariant"] = load_model(name, dtype=torch.bfloat16, kernels="invariant", quant="none")
    except UserError as e:
        print(f"skipped 'verispec bf16 invariant': {e}", file=sys.stderr)
    for quant in ("q8_0", "q4_1"):
        loaded[f"verispec --quant {quant}"] = load_for_serving(name, quant=quant, progress=False)
    tokenizer = loaded["verispec"].tokenizer
    chat = has_chat_template(tokenizer)
    prompt_ids = encode_chat(tokenizer, [{"role": "user", "content": CHAT_PROMPT}]) if chat \
        else encode_prompt(tokenizer, RAW_PROMPT)
    for label, lm in loaded.items():
        engines[label] = lambda lm=lm: run_ours(lm, prompt_ids, args.new_tokens)
    bytes_of = {label: weight_bytes(lm.model, getattr(getattr(lm.model, "kernel_plan", None), "formats", None))
                for label, lm in loaded.items()}
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(loaded["verispec"].folder), dtype=torch.bfloat16,
                                                  attn_implementation="sdpa").eval()
        engines["transformers bf16"] = lambda: run_hf(hf, prompt_ids, args.new_tokens)
        bytes_of["transformers bf16"] = weight_bytes(loaded["verispec bf16, PyTorch kernels"].model)
    gguf_label = None
    if not args.skip_llamacpp:
        try:
            from llama_cpp import Llama

            path = model_gguf_path(name)
            gguf_label = "llama.cpp " + ("Q4_1" if "smollm2" in name else "Q4_K_M")
            llm = Llama(str(path), n_threads=args.threads, n_ctx=1024, verbose=False)
            engines[gguf_label] = lambda: run_llamacpp(llm, prompt_ids, args.new_tokens)
            bytes_of[gguf_label] = path.stat().st_size  # every tensor of the file, near enough
        except ImportError:
            pass
    for run in engines.values():  # warm-up: first-call allocations, kernel choices
        run()
    best: dict[str, tuple[float, float, int]] = {}
    for _ in range(args.rounds):
        for label, run in engines.items():
            ttft, decode, n = run()
            if label not in best or decode > best[label][1]:
                best[label] = (ttft, decode, n)
    peer = best.get(gguf_label)
    plan = loaded["verispec"].model.kernel_plan
    print(f"\n{name}: prompt {len(prompt_ids)} tokens, {args.new_tokens} new, greedy, {args.threads} threads, "
          f"best of {args.rounds}; verispec = {str(loaded['verispec'].model.dtype).removeprefix('torch.')}, "
          f"{plan.describe()}")
    print(f"{'engine':<32} {'TTFT ms':>8} {'decode tok/s':>13} {'vs llama.cpp':>13} {'MB/token':>9} {'ceiling tok/s':>14} "
          f"{'of ceiling':>10}")
    rows = []
    for label, (ttft, decode, _n) in best.items():
        ceiling = bandwidth * 1e9 / bytes_of[label]
        ratio = decode / peer[1] if peer else float("nan")
        print(f"{label:<32} {ttft * 1000:8.0f} {decode:13.1f} {ratio:12.2f}x {bytes_of[label] / 1e6:9.0f} "
              f"{ceiling:14.1f} {decode / ceiling:9.0%}")
        rows.append({"engine": label, "ttft_ms": round(ttft * 1000, 1), "decode_tok_s": round(decode, 2),
                     "vs_llamacpp": round(ratio, 3) if peer else None, "mb_per_token": round(bytes_of[label] / 1e6, 1),
                     "ceiling_tok_s": round(ceiling, 1)})
    result = {"model": name, "prompt_tokens": len(prompt_ids), "rows": rows, "plan": plan.linear,
              "formats": plan.formats, "invariant": plan.invariant}
    if args.profile:
        breakdown = step_breakdown(loaded["verispec"].model, prompt_ids)
        print("per decode step (ms): " + ", ".join(f"{k} {v}" for k, v in breakdown.items()))
        result["step_breakdown_ms"] = breakdown
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print verispec's per-step breakdown too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from verispec.models.kernel_plan import cpu_name, cpu_flags

    bandwidth = measure_bandwidth()
    print(f"CPU: {cpu_name()} ({', '.join(cpu_flags())}); read bandwidth {bandwidth:.1f} GB/s")
    results = [bench_model(name, args, bandwidth) for name in args.models.split(",")]
    print(json.dumps({"bench": "decode", "cpu": cpu_name(), "threads": args.threads, "new_tokens": args.new_tokens,
                      "bandwidth_gb_s": round(bandwidth, 1), "models": results}))


if __name__ == "__main__":
    main()
