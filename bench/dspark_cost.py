"""What one DSpark round costs on this machine, against one plain target decode step.

Target: SmolLM2-135M-Instruct (bf16 by default, 2 threads), or any model folder with --model
(a tiny Gemma 4 target: `--model tests/fixtures/deepspec-gemma4-tiny/target`, where the drafters
take DeepSeek's Gemma4 shape: global head size, one K = V head, v-norm, layer scalars). Drafters:
untrained, random weights, of the shapes we can train for it (issue #6); the default row is the
shape `verispec dspark train` uses by default (for a small-vocabulary target: full vocabulary,
rank 16, one and two layers, the DeepSpec oracle's shape the default). A round is split into
  backbone     one pass over the new context rows (3 per round, a typical accepted
               length + 1) and the block [anchor, MASK x (gamma - 1)]: fc + hidden_norm,
               the draft layers, the final norm
  base head    lm_head over the gamma block positions (the draft vocabulary)
  sequential   gamma steps of W1[prev] -> W2 bias -> argmax
  confidence   gamma confidence-head logits
  verify       the target forward of gamma + 1 tokens, minus the one plain step it replaces
and `round` is the real provider path (DSparkProvider.draft_batch) timed whole, Python and
all. By default the target is the plan `verispec serve` runs (`--plan served`: the kernels and
weight formats measured for this machine, `--dtype` ignored) and the drafters are loaded as
serving loads them (linears in q8_0 where that measures faster); `--plan dtype` times the
unquantized target in `--dtype` with oneDNN-packed float drafters, as before 2026-12-04.
Every cost is a fraction of one plain decode step of the target (best of N runs, same
process). The drafting side (round) must be <= 25% of a step at gamma 7 for a
trained drafter to pay on this CPU.

    .venv/bin/python bench/dspark_cost.py [--plan served|dtype] [--dtype bfloat16] [--gamma 7] [--repeats 30] [--model M]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

DEFAULT_SHAPE = {"layers": 1, "rank": 64, "draft_vocab": 16384}
SHAPES = [
    {"layers": 1, "rank": 64, "draft_vocab": 49152},
    DEFAULT_SHAPE,
    {"layers": 1, "rank": 64, "draft_vocab": 8192},
    {"layers": 2, "rank": 64, "draft_vocab": 16384},
    {"layers": 2, "rank": 64, "draft_vocab": 8192},  # gemma3's shipped shape, deepened (campaign stage 16)
    {"layers": 2, "rank": 128, "draft_vocab": 49152},
]
SMALL_VOCAB_SHAPES = [{"layers": 1, "rank": 16, "draft_vocab": None}, {"layers": 2, "rank": 16, "draft_vocab": None}]


def best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def build(loaded, shape: dict, gamma: int, dtype, taps: list[int], int8: str = "off"):
    from verispec.models.loader import read_config
    from verispec.drafting.dspark.config import DSparkConfig
    from verispec.drafting.dspark.model import DSparkDrafter

    vocab = loaded.model.args.vocab_size
    subset = shape["draft_vocab"] if shape["draft_vocab"] and shape["draft_vocab"] < vocab else None
    config = DSparkConfig.from_target(
        read_config(loaded.folder), num_draft_layers=shape["layers"], block_size=gamma, target_layer_ids=taps,
        mask_token_id=0, markov_rank=shape["rank"], draft_vocab_size=subset,
        markov_vocab="draft")  # as `dspark train` builds them (a full-vocabulary one costs the same, only MB more)
    torch.manual_seed(0)
    return DSparkDrafter(config).to(dtype).prepare_for_inference(int8=int8)


def trainable_mb(drafter) -> float:
    frozen = {"embed_tokens.weight", "lm_head.weight"}
    return sum(p.numel() for n, p in drafter.named_parameters() if n not in frozen) * 2 / 2**20


def measure(loaded, drafter, repeats: int, step_s: float, verify_s: float) -> dict:
    from verispec.engine.sampling import SamplingParams
    from verispec.drafting.dspark.source import DSparkProvider
    from verispec.engine.draft import SourceContext

    g = drafter.block_size
    width = drafter.fc.in_features
    features = torch.randn(3, width, dtype=drafter.dtype)
    history = torch.randn(200, width, dtype=drafter.dtype)

    def fresh_cache():
        cache = drafter.new_cache(512)
        drafter.draft_hidden([cache], [history], [1])
        return cache

    cache = fresh_cache()

    def backbone():
        cache.length = 200
        return drafter.draft_hidden([cache], [features], [1])

    h = backbone()
    base = drafter.base_logits(h)

    def sequential():
        prev = torch.tensor([1])
        for j in range(g):
            bias, _ = drafter.markov_head.step(drafter.markov_embedding(prev), h[:, j], None)
            prev = drafter.to_target_ids((base[:, j] + bias).float().argmax(dim=-1))

    prev_emb = drafter.markov_embedding(torch.tensor([1]))

    def confidence():
        for j in range(g):
            drafter.confidence(h[:, j], prev_emb)

    provider = DSparkProvider(drafter)
    source = provider.new_source(SourceContext([0] * 200, [0], SamplingParams(), 256))
    source.cache = fresh_cache()

    def whole_round():
        source.cache.length = 200
        source.pending = [features]
        provider.draft_batch([(source, 1, g)])

    with torch.inference_mode():
        parts = {
            "backbone": best_time(backbone, repeats),
            "base_head": best_time(lambda: drafter.base_logits(h), repeats),
            "sequential": best_time(sequential, repeats),
            "confidence": best_time(confidence, repeats),
            "round": best_time(whole_round, repeats),
        }
    fractions = {k: v / step_s for k, v in parts.items()}
    fractions["verify_extra"] = (verify_s - step_s) / step_s
    return fractions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default="served", choices=["served", "dtype"],
                    help="served: the target as `verispec serve` runs it (default); dtype: unquantized in --dtype")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="with --plan dtype")
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the target: a name -m accepts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from verispec.models.decoder import BatchKV
    from verispec.models.loader import load_for_serving, load_model
    from verispec.training.dspark.features import default_taps

    served = args.plan == "served"
    loaded = load_for_serving(args.model) if served else load_model(args.model, dtype=getattr(torch, args.dtype))
    dtype = loaded.model.dtype
    label = f"served plan ({str(dtype).removeprefix('torch.')})" if served else args.dtype
    model = loaded.model
    taps = default_taps(model.args.num_layers)  # what `verispec dspark train` taps by default
    small = model.args.vocab_size <= min(shape["draft_vocab"] for shape in SHAPES)
    shapes, default_shape = (SMALL_VOCAB_SHAPES, SMALL_VOCAB_SHAPES[1]) if small else (SHAPES, DEFAULT_SHAPE)
    seq = model.new_cache().allocate(1024)
    ids = torch.randint(0, model.args.vocab_size, (300,))
    with torch.inference_mode():
        model(ids[:200], BatchKV([seq], [200]))

        def step(n):
            def run():
                model(ids[200 : 200 + n], BatchKV([seq], [n]), logits_at=torch.arange(n), taps=taps)
                seq.rollback(n)
            return run

        step_s = best_time(step(1), args.repeats)
        verify_s = best_time(step(args.gamma + 1), args.repeats)

    rows = []
    for shape in shapes:
        drafter = build(loaded, shape, args.gamma, dtype, taps, int8="auto" if served else "off")
        fractions = measure(loaded, drafter, args.repeats, step_s, verify_s)
        rows.append({**shape, "draft_vocab": shape["draft_vocab"] or model.args.vocab_size,
                     "default": shape == default_shape, "trainable_mb": round(trainable_mb(drafter), 1),
                     "architecture": drafter.config.architecture, **{k: round(v, 3) for k, v in fractions.items()}})

    from verispec.models.kernel_plan import cpu_name

    print(f"\n{args.model} ({rows[0]['architecture']} drafters) {label}, gamma {args.gamma}, {args.threads} threads, "
          f"{cpu_name()}; one plain decode step "
          f"= {step_s * 1000:.2f} ms; verify of {args.gamma + 1} tokens = {verify_s / step_s:.2f} steps")
    print(f"{'layers':>6}{'rank':>6}{'draft vocab':>12}{'MB':>7}{'backbone':>10}{'base head':>10}{'sequential':>11}"
          f"{'confidence':>11}{'round':>8}{'verify+':>9}")
    for r in rows:
        mark = "  <- default" if r["default"] else ""
        print(f"{r['layers']:>6}{r['rank']:>6}{r['draft_vocab']:>12}{r['trainable_mb']:>7.1f}{r['backbone']:>9.0%}"
              f"{r['base_head']:>10.0%}{r['sequential']:>11.0%}{r['confidence']:>11.0%}{r['round']:>8.0%}"
              f"{r['verify_extra']:>9.0%}{mark}")
    default = next(r for r in rows if r["default"])
    if args.model == "smollm2-135m-instruct":
        print(f"drafting side (round) of the default shape: {default['round']:.0%} of a target step (target <= 25%)")
    else:
        per_layer = default["backbone"] / default["layers"] * model.args.num_layers
        print(f"drafting side (round) of the default shape: {default['round']:.0%} of a target step; a draft layer's "
              f"backbone share x the target's {model.args.num_layers} layers = {per_layer:.0%} of a step")
    print(json.dumps({"bench": "dspark_cost", "model": args.model, "cpu": cpu_name(), "plan": args.plan,
                      "dtype": str(dtype).removeprefix("torch."),
                      "gamma": args.gamma, "threads": args.threads,
                      "target_step_ms": round(step_s * 1000, 3), "verify_steps": round(verify_s / step_s, 3),
                      "rows": rows, "default_round_fraction": default["round"], "target_fraction": 0.25}))


if __name__ == "__main__":
    main()
