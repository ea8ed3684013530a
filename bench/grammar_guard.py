"""What it costs to compile a grammar so that it cannot take the server down.

Three ways to compile each constraint of tests/structured_cases.py (27 JSON schemas, 5
regexes, 3 choices, one Lark grammar) on the default model's tokenizer, cold (a fresh
compile each time, first mask included, as grammar/llguidance_backend.py does):

* direct:   backend.compile on the calling thread (what a crash takes down with it);
* thread:   grammar/guard.compile_guarded: the limits, then a fresh thread with a 64 MiB
            stack and a time budget (what verispec does);
* process:  a persistent worker process that compiles first (a crash or a hang kills
            only the worker), then the same compile in-process, because a compiled
            llguidance matcher cannot cross a process boundary.

Also the limit check alone, and, for scale, a bound-passing deep input (a 60-level
object nesting) under each. Prints a table and one JSON line.

    .venv/bin/python bench/grammar_guard.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from tests.structured_cases import ARITHMETIC_GRAMMAR, CHOICES, REGEXES, SCHEMAS  # noqa: E402
from verispec.grammar import limits  # noqa: E402
from verispec.grammar.guard import compile_guarded  # noqa: E402
from verispec.grammar.constraint import Constraint  # noqa: E402

WORKER = r"""
import json, sys
from verispec.grammar.llguidance_backend import LLGuidanceBackend
from verispec.grammar.constraint import Constraint
from verispec.models.tokenizer import load_tokenizer
backend = LLGuidanceBackend(load_tokenizer(sys.argv[1]), int(sys.argv[2]), [2])
print("ready", flush=True)
for line in sys.stdin:
    kind, text, strict = json.loads(line)
    try:
        backend.compile(Constraint(kind, text, strict))
        print("ok", flush=True)
    except Exception as e:
        print("error " + str(e).replace("\n", " "), flush=True)
"""


def cases() -> list[Constraint]:
    specs = [Constraint.json_schema(c.schema) for c in SCHEMAS]
    specs += [Constraint.regex(c.pattern) for c in REGEXES]
    specs += [Constraint.choice(c.choices) for c in CHOICES]
    return specs + [Constraint.grammar(ARITHMETIC_GRAMMAR)]


def deep(levels: int) -> Constraint:
    schema = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return Constraint.json_schema(schema)


def timed(fn, spec, repeats) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(spec)
        out.append((time.perf_counter() - start) * 1000)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None, help="model folder (default: the default model, pulled)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from verispec.grammar.llguidance_backend import LLGuidanceBackend
    from verispec.models.registry import pull
    from verispec.models.tokenizer import load_tokenizer

    folder = Path(args.tokenizer) if args.tokenizer else pull("smollm2-135m-instruct", progress=False)
    tokenizer = load_tokenizer(folder)
    vocab = 49152 if args.tokenizer is None else len(tokenizer)
    backend = LLGuidanceBackend(tokenizer, vocab, [2])

    start = time.perf_counter()
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(folder), str(vocab)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert worker.stdout.readline().strip() == "ready"
    worker_start_s = time.perf_counter() - start

    def in_worker(spec):
        worker.stdin.write(json.dumps([spec.kind, spec.text, spec.strict]) + "\n")
        worker.stdin.flush()
        reply = worker.stdout.readline()
        assert reply.startswith("ok"), reply
        backend.compile(spec)

    ways = {"direct": backend.compile, "thread": lambda s: compile_guarded(backend, s),
            "process": in_worker, "limits only": limits.check}
    specs = cases()
    results = {name: [] for name in ways}
    for spec in specs:
        for name, fn in ways.items():  # interleaved per case: the machine's drift hits every way alike
            results[name].extend(timed(fn, spec, args.repeats))
    deep_spec = deep(60)
    deep_ms = {name: statistics.median(timed(fn, deep_spec, args.repeats)) for name, fn in ways.items()}
    worker.stdin.close()
    worker.wait(10)

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"guarded grammar compiles: {len(specs)} constraints x {args.repeats}, SmolLM2 tokenizer, {cpu}; "
          f"worker process start {worker_start_s:.2f} s")
    print(f"{'way':<12} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'deep-60 ms':>11}  vs direct p50")
    direct = statistics.median(results["direct"])
    rows = {}
    for name, values in results.items():
        values = sorted(values)
        p50, p95 = statistics.median(values), values[int(0.95 * (len(values) - 1))]
        rows[name] = {"p50_ms": round(p50, 3), "p95_ms": round(p95, 3), "max_ms": round(values[-1], 3),
                      "deep60_ms": round(deep_ms[name], 3)}
        extra = "" if name == "limits only" else f"  {p50 / direct:.2f}x"
        print(f"{name:<12} {p50:>8.3f} {p95:>8.3f} {values[-1]:>8.3f} {deep_ms[name]:>11.3f}{extra}")
    print(json.dumps({"bench": "grammar_guard", "cpu": cpu, "cases": len(specs), "repeats": args.repeats,
                      "worker_start_s": round(worker_start_s, 3), "ways": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
