"""What a weight format and a kernel plan cost in quality: perplexity on held-out text.

A quantized model is a different model. For each model (default: smollm2-135m-instruct
and gemma3-270m) this scores held-out text teacher-forced under several ways of loading
it and reports perplexity and its change against float32 with PyTorch's kernels (the
exact reference: our GGUF conversions are float32 dequantizations of the file):

* `fp32 PyTorch`   the reference;
* `bf16 PyTorch`   bf16 weights and activations (oneDNN);
* `default`        what `verispec serve` loads (`--dtype auto --kernels auto --quant auto`:
                   lossless weight formats, int8 activations in the VNNI kernels);
* `bf16 invariant` bf16 on verispec's batch-invariant kernels, no quantization;
* `q8_0`, `q4_1`   every matrix requantized (lossy where the source was not in that format).

Text: ShareGPT assistant answers from conversations the drafter training does not use
(the last ones of the file), 256-token windows; the same tokens for every way.

    .venv/bin/python bench/quant_quality.py [--models ...] [--sequences 24]
Prints a table per model and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def held_out_texts(count: int) -> list[str]:
    from verispec.data.sharegpt import conversations

    answers = []
    for conv in conversations():
        for turn in conv.get("conversations") or []:
            if turn.get("from") == "gpt" and len(turn.get("value") or "") > 800:
                answers.append(turn["value"])
    return answers[-count:]  # the end of the file: datagen takes prompts from the start


@torch.inference_mode()
def perplexity(model, windows: list[list[int]]) -> float:
    from verispec.models.decoder import BatchKV

    nll, n = 0.0, 0
    for ids in windows:
        seq = model.new_cache().allocate(len(ids))
        logits = model(torch.tensor(ids), BatchKV([seq], [len(ids)]), logits_at=torch.arange(len(ids) - 1)).logits
        logp = torch.log_softmax(logits.double(), dim=-1)
        nll -= logp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
        n += len(ids) - 1
    return math.exp(nll / n)


def loaders(name: str) -> dict:
    from verispec.models.loader import load_for_serving, load_model

    return {
        "fp32 PyTorch": lambda: load_model(name, dtype=torch.float32, progress=False),
        "bf16 PyTorch": lambda: load_model(name, dtype=torch.bfloat16, progress=False),
        "default": lambda: load_for_serving(name, progress=False),
        "bf16 invariant": lambda: load_model(name, dtype=torch.bfloat16, kernels="invariant", quant="none",
                                             progress=False),
        "q8_0": lambda: load_model(name, dtype=torch.float32, kernels="auto", quant="q8_0", progress=False),
        "q4_1": lambda: load_model(name, dtype=torch.float32, kernels="auto", quant="q4_1", progress=False),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m")
    ap.add_argument("--sequences", type=int, default=24)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    texts = held_out_texts(args.sequences)
    results = []
    for name in args.models.split(","):
        rows, reference = [], None
        windows = None
        for label, load in loaders(name).items():
            t0 = time.perf_counter()
            try:
                loaded = load()
            except Exception as e:  # noqa: BLE001 - a plan this machine cannot run: say so, go on
                rows.append({"way": label, "error": str(e)[:120]})
                continue
            if windows is None:
                windows = [loaded.tokenizer.encode(t, add_special_tokens=False)[: args.window] for t in texts]
                windows = [w for w in windows if len(w) >= 32]
            ppl = perplexity(loaded.model, windows)
            reference = reference if reference is not None else ppl
            plan = getattr(loaded.model, "kernel_plan", None)
            rows.append({"way": label, "dtype": str(loaded.model.dtype).removeprefix("torch."),
                         "formats": sorted(set(plan.formats.values())) if plan else ["as dtype"],
                         "perplexity": round(ppl, 4), "delta_pct": round((ppl / reference - 1) * 100, 3),
                         "seconds": round(time.perf_counter() - t0, 1)})
            del loaded
        tokens = sum(len(w) - 1 for w in windows or [])
        print(f"\n{name}: perplexity on {len(windows or [])} held-out ShareGPT answers ({tokens} scored tokens)")
        print(f"{'way':<16} {'dtype':<9} {'weights':<20} {'perplexity':>10} {'vs fp32':>9}")
        for r in rows:
            if "error" in r:
                print(f"{r['way']:<16} not run: {r['error']}")
            else:
                print(f"{r['way']:<16} {r['dtype']:<9} {'/'.join(r['formats']):<20} {r['perplexity']:10.4f} "
                      f"{r['delta_pct']:+8.3f}%")
        results.append({"model": name, "tokens": tokens, "rows": rows})
    print(json.dumps({"bench": "quant_quality", "models": results}))


if __name__ == "__main__":
    main()
