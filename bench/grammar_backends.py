"""Which grammar backend verispec uses: llguidance vs xgrammar, measured on this machine.

For each backend, on the default model's tokenizer and the conformance cases of
tests/structured_cases.py (27 JSON schemas, 5 regexes, 3 choices, one grammar):

* install weight: the installed bytes of the backend and of the packages only it pulls
  in (torch and transformers, which verispec needs anyway, are not counted);
* import + tokenizer setup time (once per server);
* compile time per constraint, cold (what the first request with a new schema waits);
* mask time per token: replaying the same token sequences through both backends (each
  sequence is a seeded random walk through llguidance's masks, preferring to finish),
  timing "fill the next-token bitmask" and "accept the token";
* feature coverage: which cases compile (a backend that rejects a schema feature fails
  the case).

Run it where both are installed (xgrammar drags in triton, ~1 GB, so it is not a
verispec dependency; a scratch venv does):

    python -m venv /tmp/xg && /tmp/xg/bin/pip install torch==2.13.0 transformers llguidance xgrammar jsonschema
    /tmp/xg/bin/python bench/grammar_backends.py --tokenizer ~/.cache/verispec/models/smollm2-135m-instruct

Prints a table and one JSON line. A backend that is not installed is reported as such.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # runs from a scratch venv without verispec installed

from tests.structured_cases import ARITHMETIC_GRAMMAR, CHOICES, REGEXES, SCHEMAS  # noqa: E402
from verispec.grammar.llguidance_backend import JSON_OPTIONS  # noqa: E402  the server's own JSON options
from verispec.grammar.constraint import Constraint  # noqa: E402

# what each backend pulls in beyond verispec's own dependencies
EXCLUSIVE_DISTS = {"llguidance": ["llguidance"], "xgrammar": ["xgrammar", "apache-tvm-ffi", "triton", "ninja"]}
# compact JSON in both backends (JSON_OPTIONS is the server's choice: flexible whitespace
# lets a small model loop on newlines inside an object until max_tokens)
XGRAMMAR_ARITHMETIC = r'''
root ::= expr "=" number
expr ::= number op number (op number)? (op number)?
op ::= "+" | "-" | "*" | "/"
number ::= [0-9] | [0-9] [0-9] | [0-9] [0-9] [0-9]
'''


def installed_bytes(dists: list[str]) -> int:
    total = 0
    for name in dists:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        for f in dist.files or []:
            path = Path(dist.locate_file(f))
            if path.is_file():
                total += path.stat().st_size
    return total


def constraints() -> list[tuple[str, str, object]]:
    """(name, kind, spec) for every case: kind is json, regex or grammar."""
    out = [(c.name, "json", c.schema) for c in SCHEMAS]
    out += [(c.name, "regex", c.pattern) for c in REGEXES]
    out += [("choice_" + c.name, "regex", Constraint.choice(c.choices).choice_regex()) for c in CHOICES]
    out.append(("arithmetic", "grammar", None))
    return out


class Llg:
    name = "llguidance"

    def __init__(self, hf_tokenizer):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(hf_tokenizer)
        self.vocab = self.tok.vocab_size

    def compile(self, kind, spec):
        M = self.llg.LLMatcher
        grammar = {"json": lambda: M.grammar_from_json_schema(spec, defaults=JSON_OPTIONS),
                   "regex": lambda: M.grammar_from_regex(spec),
                   "grammar": lambda: M.grammar_from_lark(ARITHMETIC_GRAMMAR)}[kind]()
        matcher = M(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def new_mask(self):
        return self.lt.allocate_token_bitmask(1, self.vocab)

    def fill(self, matcher, mask):
        self.lt.fill_next_token_bitmask(matcher, mask, 0)

    def accept(self, matcher, token) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()

    def eos(self):
        return self.tok.eos_token


class Xgr:
    name = "xgrammar"

    def __init__(self, hf_tokenizer):
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer)
        # cache off: every compile below is a cold one
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self.vocab = self.info.vocab_size

    def compile(self, kind, spec):
        c = self.compiler
        compiled = {"json": lambda: c.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(", ", ": ")),
                    "regex": lambda: c.compile_regex(spec),
                    "grammar": lambda: c.compile_grammar(XGRAMMAR_ARITHMETIC)}[kind]()
        return self.xgr.GrammarMatcher(compiled)

    def new_mask(self):
        return self.xgr.allocate_token_bitmask(1, self.vocab)

    def fill(self, matcher, mask):
        matcher.fill_next_token_bitmask(mask, 0)

    def accept(self, matcher, token) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


def allowed_tokens(mask, vocab: int) -> list[int]:
    import torch

    bits = (mask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return [t for t in bits.reshape(-1)[:vocab].nonzero().flatten().tolist()]


def random_walk(llg: Llg, kind, spec, rng: random.Random, limit: int) -> list[int]:
    """A token sequence the grammar accepts: random allowed tokens, EOS as soon as it is
    allowed (half the time), so walks end."""
    try:
        m = llg.compile(kind, spec)
    except ValueError:
        return []  # reported as a compile failure by measure()
    mask, seq = llg.new_mask(), []
    eos = llg.eos()
    while len(seq) < limit and not m.is_stopped():
        llg.fill(m, mask)
        allowed = allowed_tokens(mask, llg.vocab)
        if eos in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            break
        allowed = [t for t in allowed if t != eos] or allowed
        # prefer short tokens' neighbourhood: uniform over the allowed set
        token = rng.choice(allowed)
        m.consume_token(token)
        seq.append(token)
    return seq


def measure(backend, cases, walks, hf) -> dict:
    compile_ms, fill_us, accept_us, failures = {}, [], [], []
    for (name, kind, spec), seq in zip(cases, walks):
        t = time.perf_counter()
        try:
            matcher = backend.compile(kind, spec)
        except Exception as e:  # noqa: BLE001 - a feature the backend lacks
            failures.append(f"{name}: {str(e).splitlines()[0][:80]}")
            continue
        compile_ms[name] = (time.perf_counter() - t) * 1e3
        mask = backend.new_mask()
        for i, token in enumerate(seq):
            t = time.perf_counter()
            backend.fill(matcher, mask)
            t1 = time.perf_counter()
            ok = backend.accept(matcher, token)
            accept_us.append((time.perf_counter() - t1) * 1e6)
            fill_us.append((t1 - t) * 1e6)
            if not ok:
                failures.append(f"{name}: rejected {hf.decode([token])!r} (id {token}) after {hf.decode(seq[:i])!r}, "
                                "which llguidance allowed")
                break
    return {"compile_ms": compile_ms, "fill_us": fill_us, "accept_us": accept_us, "failures": failures}


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="a model folder with tokenizer.json (the default model's)")
    ap.add_argument("--walk-tokens", type=int, default=120, help="longest replayed token sequence per case")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    t = time.perf_counter()
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(args.tokenizer)
    print(f"transformers tokenizer: {time.perf_counter() - t:.2f} s", file=sys.stderr)
    backends, setup = [], {}
    for cls, module in ((Llg, "llguidance"), (Xgr, "xgrammar")):
        t = time.perf_counter()
        try:
            backends.append(cls(hf))
        except ImportError:
            print(f"{module}: not installed", file=sys.stderr)
            continue
        setup[cls.name] = time.perf_counter() - t
    if not backends or backends[0].name != "llguidance":
        sys.exit("llguidance is needed (its masks generate the replayed token sequences)")

    cases = constraints()
    rng = random.Random(args.seed)
    walks = [random_walk(backends[0], kind, spec, rng, args.walk_tokens) for _, kind, spec in cases]
    results = {b.name: measure(b, cases, walks, hf) for b in backends}

    rows = []
    print(f"\n{len(cases)} constraints, {sum(map(len, walks))} replayed tokens")
    print(f"{'backend':<11} {'install MB':>10} {'setup s':>8} {'compile ms p50':>15} {'p95':>7} {'max':>7} "
          f"{'mask us p50':>12} {'p95':>7} {'accept us':>10} {'compiled':>9}")
    for b in backends:
        r = results[b.name]
        c = list(r["compile_ms"].values())
        row = {
            "backend": b.name, "install_mb": installed_bytes(EXCLUSIVE_DISTS[b.name]) / 1e6, "setup_s": setup[b.name],
            "compile_ms_p50": statistics.median(c) if c else None, "compile_ms_p95": pct(c, 0.95),
            "compile_ms_max": max(c) if c else None, "mask_us_p50": pct(r["fill_us"], 0.5),
            "mask_us_p95": pct(r["fill_us"], 0.95), "accept_us_p50": pct(r["accept_us"], 0.5),
            "compiled": f"{len(c)}/{len(cases)}", "failures": r["failures"],
        }
        rows.append(row)
        print(f"{b.name:<11} {row['install_mb']:>10.1f} {row['setup_s']:>8.2f} {row['compile_ms_p50']:>15.2f} "
              f"{row['compile_ms_p95']:>7.2f} {row['compile_ms_max']:>7.2f} {row['mask_us_p50']:>12.1f} "
              f"{row['mask_us_p95']:>7.1f} {row['accept_us_p50']:>10.1f} {row['compiled']:>9}")
        for f in r["failures"]:
            print(f"    {b.name} failed: {f}")
    print(json.dumps({"bench": "grammar_backends", "rows": rows}))


if __name__ == "__main__":
    main()
