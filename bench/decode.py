"""Decode benchmark: prefill tok/s, TTFT and decode tok/s on SmolLM2-135M-Instruct.

Compares, in the same run and on the same weights: verispec (fp32, bf16), HF transformers
`generate` (fp32, bf16, sdpa attention) and llama.cpp via llama-cpp-python on the
original Q4_1 GGUF (when installed). Prints a table, the memory-bandwidth ceiling
(bytes read per token / measured bandwidth) and one JSON line.

Runs are interleaved (every engine once per round, `--rounds` rounds) and the best round
per engine is reported, because this machine is shared and noisy: the best of several
is the least disturbed measurement of each, and ratios between engines are what count.

    .venv/bin/python bench/decode.py                 # defaults: 2 threads, 128 new tokens
    .venv/bin/python bench/decode.py --rounds 5 --skip-llamacpp

The llama.cpp peer (optional) compiles from source in a few minutes; its default native
build can crash in AMX paths on some hosts, so build it portable with AVX-512:
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
      -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" .venv/bin/pip install llama-cpp-python
"""

from __future__ import annotations

import argparse
import json
import time

import torch

PROMPT = (
    "You are reviewing a pull request that adds speculative decoding to an inference server. "
    "Explain, step by step, what a reviewer should check to be sure the change is lossless: "
    "how greedy verification works, how sampling verification keeps the target distribution, "
    "what must happen to the KV cache when drafted tokens are rejected, and which tests would "
    "prove it. Be concrete and thorough."
)


def measure_bandwidth(threads: int) -> float:
    """Read bandwidth in GB/s: a sum over a 512 MB float32 buffer (best of 5)."""
    x = torch.ones(128 * 1024 * 1024)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def weight_bytes_per_token(args, dtype: torch.dtype) -> int:
    """Bytes of weights a decode step reads: every matrix once plus the lm_head (which
    reads the whole vocabulary table; the embedding lookup reads one row). Norms and
    the KV cache are a rounding error at these prompt lengths."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    per_layer = args.hidden_size * (q + 2 * kv) + q * args.hidden_size + 3 * args.hidden_size * args.intermediate_size
    elements = args.num_layers * per_layer + args.vocab_size * args.hidden_size
    return elements * (torch.finfo(dtype).bits // 8)


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
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
            pad_token_id=0,
        )
    ttft = clock.times[0] - t0
    decode = (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])
    return ttft, decode, len(clock.times)


def run_llamacpp(llm, prompt_ids, n_new):
    llm.reset()
    times = []
    t0 = time.perf_counter()
    for i, _tok in enumerate(llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True)):
        times.append(time.perf_counter())
        if i + 1 >= n_new:
            break
    ttft = times[0] - t0
    return ttft, (len(times) - 1) / (times[-1] - times[0]), len(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--skip-unpacked", action="store_true", help="skip our rows without oneDNN weight packing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from verispec.models.loader import load_model
    from verispec.models.registry import model_gguf_path
    from verispec.models.tokenizer import encode_chat

    engines = {}
    fp32 = load_model("smollm2-135m-instruct", dtype=torch.float32)
    bf16 = load_model("smollm2-135m-instruct", dtype=torch.bfloat16)
    prompt_ids = encode_chat(fp32.tokenizer, [{"role": "user", "content": PROMPT}])
    engines["verispec fp32"] = lambda: run_ours(fp32, prompt_ids, args.new_tokens)
    engines["verispec bf16"] = lambda: run_ours(bf16, prompt_ids, args.new_tokens)
    if not args.skip_unpacked:  # the same decoder on plain F.linear: what packing buys
        fp32_plain = load_model("smollm2-135m-instruct", dtype=torch.float32, pack=False)
        bf16_plain = load_model("smollm2-135m-instruct", dtype=torch.bfloat16, pack=False)
        engines["verispec fp32 F.linear"] = lambda: run_ours(fp32_plain, prompt_ids, args.new_tokens)
        engines["verispec bf16 F.linear"] = lambda: run_ours(bf16_plain, prompt_ids, args.new_tokens)
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            hf = AutoModelForCausalLM.from_pretrained(str(fp32.folder), dtype=dtype, attn_implementation="sdpa").eval()
            engines[f"transformers {name}"] = lambda hf=hf: run_hf(hf, prompt_ids, args.new_tokens)
    llamacpp_note = "not installed"
    if not args.skip_llamacpp:
        try:
            from llama_cpp import Llama

            llm = Llama(str(model_gguf_path("smollm2-135m-instruct")), n_threads=args.threads, n_ctx=1024, verbose=False)
            engines["llama.cpp Q4_1"] = lambda: run_llamacpp(llm, prompt_ids, args.new_tokens)
            llamacpp_note = "ok"
        except ImportError:
            pass

    for run in engines.values():  # warm-up: first-call allocations, oneDNN kernel choice
        run()
    best: dict[str, tuple[float, float, int]] = {}
    for _ in range(args.rounds):
        for name, run in engines.items():
            ttft, decode, n = run()
            if name not in best or decode > best[name][1]:
                best[name] = (ttft, decode, n)

    bandwidth = measure_bandwidth(args.threads)
    bytes_fp32 = weight_bytes_per_token(fp32.model.args, torch.float32)
    bytes_bf16 = weight_bytes_per_token(bf16.model.args, torch.bfloat16)
    ceiling = {"fp32": bandwidth * 1e9 / bytes_fp32, "bf16": bandwidth * 1e9 / bytes_bf16}

    n_prompt = len(prompt_ids)
    print(f"\nSmolLM2-135M-Instruct, prompt {n_prompt} tokens, {args.new_tokens} new, greedy, {args.threads} threads, best of {args.rounds}")
    print(f"{'engine':<20} {'TTFT ms':>8} {'prefill tok/s':>14} {'decode tok/s':>13} {'vs transformers':>16}")
    hf_best = max((v[1] for k, v in best.items() if k.startswith("transformers")), default=None)
    rows = []
    for name, (ttft, decode, n) in best.items():
        ratio = decode / hf_best if hf_best else float("nan")
        print(f"{name:<20} {ttft * 1000:8.0f} {n_prompt / ttft:14.0f} {decode:13.1f} {ratio:15.2f}x")
        rows.append({"engine": name, "ttft_ms": round(ttft * 1000, 1), "prefill_tok_s": round(n_prompt / ttft, 1),
                     "decode_tok_s": round(decode, 2), "vs_transformers": round(ratio, 3)})
    print(f"bandwidth {bandwidth:.1f} GB/s; bytes/token fp32 {bytes_fp32 / 1e6:.0f} MB -> ceiling {ceiling['fp32']:.1f} tok/s; "
          f"bf16 {bytes_bf16 / 1e6:.0f} MB -> ceiling {ceiling['bf16']:.1f} tok/s; llama.cpp: {llamacpp_note}")
    ours_best = max(v[1] for k, v in best.items() if k.startswith("verispec"))
    summary = {
        "bench": "decode",
        "model": "smollm2-135m-instruct",
        "threads": args.threads,
        "prompt_tokens": n_prompt,
        "new_tokens": args.new_tokens,
        "rows": rows,
        "bandwidth_gb_s": round(bandwidth, 1),
        "ceiling_tok_s": {k: round(v, 1) for k, v in ceiling.items()},
        "ours_best_decode_tok_s": round(ours_best, 2),
        "ours_vs_transformers_best": round(ours_best / hf_best, 3) if hf_best else None,
        "target_ratio": 1.3,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
