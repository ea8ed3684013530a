"""Structured output benchmark: what a grammar costs, in every lane, in one run.

Model: SmolLM2-135M-Instruct (bf16 by default, the serving default), greedy, 2 threads,
in-process engines: plain-unforced (no speculation at all), plain (the default without a
drafter: only the tokens a grammar forces are verified as drafts), n-gram speculation,
the shipped DSpark drafter with and without forced-token drafts (without: the drafter's
own acceptance under grammars, which decides whether drafts need masking too). Prompts: the
conformance cases of tests/structured_cases.py (27 JSON schemas, 5 regexes, 3 choices,
one grammar), each asking for its format.

For each engine and lane (serial: one request at a time; concurrent: groups of 4
different constraints at once), every prompt runs twice, interleaved: with its grammar,
and without one with max_tokens set to the constrained answer's length and EOS ignored,
so both arms decode the same number of tokens at the same context lengths. Reported:

* decode tok/s with and without the grammar (serial: tokens after the first / time after
  the first token; concurrent: all tokens / wall time), and their ratio;
* grammar share: seconds spent in the grammar (mask walks over every verify position,
  consuming emitted tokens, applying the masks) / decode seconds of the constrained arm,
  timed inside the engine: the overhead itself, free of the content difference between
  the arms (the two arms write different text, and a speculative lane drafts JSON
  better or worse than prose, so the tok/s ratio of a speculative lane mixes the
  grammar's cost with a change of tau);
* tau (tokens per target forward) with and without the grammar, and by constraint kind
  (JSON schema, regex, choice, grammar: does a drafter's acceptance collapse on tight
  grammars?);
* compile time per constraint, cold (empty cache) vs cached.

Target: grammar overhead <= 5% of decode tok/s in every lane (the grammar share; the
ratio is printed next to it).

    .venv/bin/python bench/structured.py [--cases 36] [--dtype bfloat16] [--engines plain-unforced,plain,ngram,dspark-unforced,dspark]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.structured_cases import ARITHMETIC_GRAMMAR, CHOICES, GRAMMAR_PROMPT, REGEXES, SCHEMAS  # noqa: E402

TARGET_OVERHEAD = 0.05
MAX_TOKENS = 160


def cases():
    from verispec.grammar.constraint import Constraint

    out = [(c.name, Constraint.json_schema(c.schema), c.prompt) for c in SCHEMAS]
    out += [(c.name, Constraint.regex(c.pattern), c.prompt) for c in REGEXES]
    out += [(c.name, Constraint.choice(c.choices), c.prompt) for c in CHOICES]
    out.append(("arithmetic", Constraint.grammar(ARITHMETIC_GRAMMAR), GRAMMAR_PROMPT))
    return out


class GrammarClock:
    """Seconds spent in grammar work inside the engine: the mask walk of every step
    (engine/grammar_masks.py), each emitted token's consume, and the whole logits
    processing of every step that applies a mask (an upper bound: it includes work a
    sampled row does anyway; a greedy row without a mask skips it)."""

    def __init__(self):
        from verispec.engine import runner
        from verispec.grammar import llguidance_backend

        self.seconds = 0.0
        walk, consume, process = runner.step_masks, llguidance_backend.LLGuidanceMatcher.consume, runner.process_logits

        def timed_walk(*a, **k):
            t = time.perf_counter()
            try:
                return walk(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t

        def timed_consume(matcher, token):
            t = time.perf_counter()
            try:
                return consume(matcher, token)
            finally:
                self.seconds += time.perf_counter() - t

        def timed_process(*a, **k):
            if k.get("grammar_mask", a[4] if len(a) > 4 else None) is None:
                return process(*a, **k)
            t = time.perf_counter()
            try:
                return process(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t

        runner.step_masks = timed_walk
        runner.process_logits = timed_process
        llguidance_backend.LLGuidanceMatcher.consume = timed_consume


def build_engines(loaded, names, dtype):
    from verispec.engine.engine import Engine, EngineConfig
    from verispec.drafting.factory import build_drafter, shipped_dspark

    engines = {}
    for name in names:
        base, _, suffix = name.partition("-")
        if base not in ("plain", "ngram", "dspark") or suffix not in ("", "unforced"):
            raise SystemExit(f"unknown engine {name!r}")
        drafter = {"plain": lambda: None,
                   "ngram": lambda: build_drafter(loaded, "ngram", None, dtype),
                   "dspark": lambda: shipped_dspark(loaded, dtype)}[base]()
        if base == "dspark" and drafter is None:
            raise SystemExit("the default model has no shipped DSpark drafter")
        config = EngineConfig(kv_budget=2**32, forced_drafts=suffix != "unforced")
        engines[name] = Engine(loaded.model, loaded.tokenizer, loaded.stop_ids, config, drafter=drafter)
    return engines


class Arm:
    def __init__(self):
        self.tokens = 0
        self.seconds = 0.0
        self.rounds = 0
        self.emitted = 0.0
        self.grammar_s = 0.0

    def add_spec(self, r):
        if r.speculation:
            self.rounds += r.speculation["rounds"]
            self.emitted += r.speculation["mean_accepted_length"] * r.speculation["rounds"]

    @property
    def tok_s(self):
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self):
        return self.emitted / self.rounds if self.rounds else 1.0


def run_serial(engine, prompts, grammars, clock, by_kind=None):
    from verispec.engine.request import GenerationRequest

    with_g, without = Arm(), Arm()
    for prompt, grammar in zip(prompts, grammars):
        g0 = clock.seconds
        r = engine.generate(GenerationRequest(prompt, MAX_TOKENS, grammar=grammar))
        with_g.grammar_s += clock.seconds - g0
        n = len(r.token_ids)
        with_g.tokens += max(0, r.completion_tokens - 1)
        with_g.seconds += r.decode_time or 0.0
        with_g.add_spec(r)
        if by_kind is not None:
            by_kind.setdefault(grammar.constraint.kind, Arm()).add_spec(r)
        u = engine.generate(GenerationRequest(prompt, max(1, n), ignore_eos=True))
        without.tokens += max(0, u.completion_tokens - 1)
        without.seconds += u.decode_time or 0.0
        without.add_spec(u)
    return with_g, without


def run_group(engine, requests):
    from verispec.engine.request import Collector

    collectors = []
    start = time.perf_counter()
    for req in requests:
        collectors.append(Collector())
        engine.submit(req, collectors[-1])
    engine.run_until_idle()
    return [c.result(0) for c in collectors], time.perf_counter() - start


def run_concurrent(engine, prompts, grammars, clock, width=4):
    from verispec.engine.request import GenerationRequest

    with_g, without = Arm(), Arm()
    for i in range(0, len(prompts), width):
        ps, gs = prompts[i : i + width], grammars[i : i + width]
        g0 = clock.seconds
        results, wall = run_group(engine, [GenerationRequest(p, MAX_TOKENS, grammar=g) for p, g in zip(ps, gs)])
        with_g.grammar_s += clock.seconds - g0
        with_g.tokens += sum(r.completion_tokens for r in results)
        with_g.seconds += wall
        for r in results:
            with_g.add_spec(r)
        lengths = [max(1, len(r.token_ids)) for r in results]
        results, wall = run_group(engine, [GenerationRequest(p, n, ignore_eos=True) for p, n in zip(ps, lengths)])
        without.tokens += sum(r.completion_tokens for r in results)
        without.seconds += wall
        for r in results:
            without.add_spec(r)
    return with_g, without


def compile_times(backend, specs):
    from verispec.grammar.cache import GrammarCache

    cache = GrammarCache(backend)
    cold, cached = [], []
    for spec in specs:
        t = time.perf_counter()
        cache.get(spec)
        cold.append((time.perf_counter() - t) * 1e3)
    for spec in specs:
        t = time.perf_counter()
        cache.get(spec)
        cached.append((time.perf_counter() - t) * 1e3)
    return cold, cached, cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=36, help="how many conformance cases to run (default: all 36)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="plain-unforced,plain,ngram,dspark-unforced,dspark",
                    help="plain, ngram or dspark (the shipped drafter); -unforced: without forced-token drafts "
                         "(plain-unforced is no speculation at all; dspark-unforced shows the drafter's own "
                         "acceptance under grammars)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from verispec.grammar.llguidance_backend import LLGuidanceBackend
    from verispec.models.loader import load_model
    from verispec.models.tokenizer import encode_chat

    dtype = getattr(torch, args.dtype)
    loaded = load_model("smollm2-135m-instruct", dtype=dtype)
    chosen = cases()[: args.cases]
    t = time.perf_counter()
    backend = LLGuidanceBackend(loaded.tokenizer, loaded.model.args.vocab_size, loaded.stop_ids)
    setup_s = time.perf_counter() - t
    cold, cached, cache = compile_times(backend, [spec for _, spec, _ in chosen])
    grammars = [cache.get(spec) for _, spec, _ in chosen]
    prompts = [encode_chat(loaded.tokenizer, [{"role": "user", "content": p}]) for _, _, p in chosen]
    engines = build_engines(loaded, args.engines.split(","), dtype)
    clock = GrammarClock()
    for engine in engines.values():  # warm-up, both arms
        run_serial(engine, prompts[:2], grammars[:2], clock)

    rows, kinds = [], {}
    for lane, run in (("serial", run_serial), ("concurrent-4", run_concurrent)):
        for name, engine in engines.items():
            if lane == "serial":
                with_g, without = run(engine, prompts, grammars, clock, kinds.setdefault(name, {}))
            else:
                with_g, without = run(engine, prompts, grammars, clock)
            ratio = with_g.tok_s / without.tok_s if without.tok_s else 0.0
            share = with_g.grammar_s / with_g.seconds if with_g.seconds else 0.0
            rows.append({"lane": lane, "engine": name, "tok_s_grammar": round(with_g.tok_s, 1),
                         "tok_s_free": round(without.tok_s, 1), "ratio": round(ratio, 3),
                         "grammar_share": round(share, 4), "tau_grammar": round(with_g.tau, 2),
                         "tau_free": round(without.tau, 2), "tokens": with_g.tokens,
                         "meets_target": share <= TARGET_OVERHEAD})

    print(f"\nSmolLM2-135M-Instruct {args.dtype}, greedy, {args.threads} threads, {len(chosen)} constraints "
          f"(llguidance; tokenizer index {setup_s:.2f} s once)")
    print(f"compile per constraint: cold p50 {statistics.median(cold):.2f} ms, max {max(cold):.2f} ms; "
          f"cached p50 {statistics.median(cached) * 1e3:.1f} us, max {max(cached) * 1e3:.1f} us")
    print(f"{'lane':<13}{'engine':<17}{'tok/s grammar':>14}{'tok/s free':>11}{'ratio':>7}{'grammar share':>14}"
          f"{'tau grammar':>12}{'tau free':>9}{'<=5%':>6}")
    for r in rows:
        print(f"{r['lane']:<13}{r['engine']:<17}{r['tok_s_grammar']:>14.1f}{r['tok_s_free']:>11.1f}{r['ratio']:>7.2f}"
              f"{r['grammar_share'] * 100:>13.2f}%{r['tau_grammar']:>12.2f}{r['tau_free']:>9.2f}"
              f"{'yes' if r['meets_target'] else 'NO':>6}")
    kind_names = sorted({k for per in kinds.values() for k in per})
    print("tau by constraint kind (serial, with the grammar): " + ", ".join(
        f"{k} x{sum(1 for _, spec, _ in chosen if spec.kind == k)}" for k in kind_names))
    print(f"{'engine':<17}" + "".join(f"{k:>13}" for k in kind_names))
    for name, per in kinds.items():
        print(f"{name:<17}" + "".join(f"{per[k].tau:>13.2f}" if k in per else f"{'-':>13}" for k in kind_names))
    print(json.dumps({"bench": "structured", "model": "smollm2-135m-instruct", "dtype": args.dtype,
                      "threads": args.threads, "constraints": len(chosen), "backend": backend.name,
                      "tokenizer_setup_s": round(setup_s, 3),
                      "compile_ms": {"cold_p50": round(statistics.median(cold), 3), "cold_max": round(max(cold), 3),
                                     "cached_p50": round(statistics.median(cached), 5),
                                     "cached_max": round(max(cached), 5)},
                      "target_overhead": TARGET_OVERHEAD, "rows": rows,
                      "tau_by_kind": {name: {k: round(a.tau, 2) for k, a in per.items()} for name, per in kinds.items()}}))


if __name__ == "__main__":
    main()
