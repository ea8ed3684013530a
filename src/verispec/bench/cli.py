"""`verispec bench matrix`: the command line of the feature-matrix benchmark (matrix.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

MATRIX_EPILOG = """\
what runs:
  cells      lane (serial / batch4 / batch8 concurrent streaming clients) x workload (chat ~128
             tokens, long ~512, json extraction with real schemas; json runs with grammar off and
             on) x arm (none, ngram, dspark, default: one `verispec serve` per arm) x model
  peers      llama.cpp (its server on the same GGUF: plain, JSON-schema grammar) and
             llama.cpp-lookup (its prompt-lookup speculation), serial lane (--peer-batch adds
             the batch lanes, which measure its one-request-at-a-time queue); transformers
             (generate, serial plain cells); a peer that is not installed is reported as skipped
  metrics    aggregate and per-stream tok/s, TTFT p50/p95 (first SSE content event), tau and
             drafts verified per step, grammar cost, schema conformance, server peak RSS;
             median of --repeats runs; every ratio against the same run's verispec none cell
  gate       every grammar output of verispec is validated against its schema: anything below
             100% fails the run (exit 1) with the offending output shown

examples:
  verispec bench matrix                                   both embedded models, every cell, peers
  verispec bench matrix --quick                           one repeat, fewer tokens, 2 lanes: ~10 minutes
  verispec bench matrix -m smollm2-135m-instruct --arms none,ngram --lanes serial
  verispec bench matrix --skip batch8 --skip grammar      drop cells by lane, arm, workload, 'grammar'
  verispec bench matrix --skip 'ngram:batch4:*'           ... or by arm:lane:workload ('*' = any)
  verispec bench matrix --url http://127.0.0.1:8000 -m smollm2-135m-instruct   a running server
  verispec bench matrix -m ./my-model --draft-model ./my-drafter --peers none

output: matrix.md (the table), cells.jsonl (one JSON line per cell, also printed), matrix.json,
heatmap-MODEL.png and bars-MODEL.png in --out, and the servers' logs in --out/logs.
"""

# --quick: every arm, workload and grammar setting, and the two outer lanes (batch4 lies between
# them; on an AVX2 host the three lanes took 14.2 min for both models)
QUICK = {"repeats": 1, "prompts": 1, "max_tokens": {"chat": 64, "long": 128, "json": 256}, "lanes": "serial,batch8"}
LANES_DEFAULT = "serial,batch4,batch8"


def add_bench_parser(sub, formatter) -> None:
    bench = sub.add_parser("bench", help="benchmarks: `verispec bench matrix` (every feature combination vs peers)",
                           description="Benchmarks that start their own servers and compare against peers in the "
                                       "same run.")
    kinds = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    m = kinds.add_parser("matrix", help="every combination of batching, grammar and speculation, per model and "
                                        "workload, against peers",
                         description="The feature-matrix benchmark: for each model, every cell of lane x workload "
                                     "x grammar x speculation arm, against verispec started once per arm (or a "
                                     "running server with --url), with peers in the same run.",
                         epilog=MATRIX_EPILOG, formatter_class=formatter)
    m.add_argument("--model", "-m", action="append", default=None,
                   help="a model -m accepts (repeatable; default: smollm2-135m-instruct and gemma3-270m)")
    m.add_argument("--arms", default="none,ngram,dspark,default", help="verispec arms (default: all four)")
    m.add_argument("--peers", default="llama.cpp,llama.cpp-lookup,transformers",
                   help="peers to run beside verispec ('none' for none; default: all three)")
    m.add_argument("--lanes", default=LANES_DEFAULT, help="lanes (default: serial,batch4,batch8; --quick: serial,batch8)")
    m.add_argument("--workloads", default="chat,long,json", help="workloads (default: chat,long,json)")
    m.add_argument("--grammar", default="off,on", help="grammar settings for the json workload (default: off,on)")
    m.add_argument("--skip", action="append", default=[], metavar="CELLS",
                   help="skip cells: an arm, lane or workload name, 'grammar', or arm:lane:workload with '*'")
    m.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is reported (default 3)")
    m.add_argument("--prompts", type=int, default=4,
                   help="prompts per workload (default 4: one per eval set for chat); a lane sends at least as many "
                        "requests as it has clients")
    m.add_argument("--max-tokens", action="append", default=[], metavar="WORKLOAD=N",
                   help="max_tokens of a workload (defaults: chat=128, long=512, json=256)")
    m.add_argument("--quick", action="store_true",
                   help="1 repeat, 1 prompt per workload (lanes still send one request per client), chat 64 / long "
                        "128 tokens, lanes serial and batch8: both models in about 10 minutes")
    m.add_argument("--peer-batch", action="store_true",
                   help="also run llama.cpp's batch lanes: llama-cpp-python's server answers one request at a time, "
                        "so they measure its queue (slowly: they double a full run's peer time); off by default")
    m.add_argument("--draft-model", default=None, help="the dspark arm's drafter (default: the one shipped for the model)")
    m.add_argument("--url", default=None, help="measure a running verispec server instead of starting one per arm")
    m.add_argument("--threads", type=int, default=2, help="threads for every engine and peer (default 2)")
    m.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="verispec's --dtype")
    m.add_argument("--serve-args", default="", help="extra `verispec serve` flags for every verispec arm")
    m.add_argument("--eval-dir", default=None,
                   help="folder of mt-bench.jsonl, gsm8k.jsonl, humaneval.jsonl, mbpp.jsonl (default: "
                        "../shared/eval-prompts above this checkout)")
    m.add_argument("--out", default=None, help="output folder (default: a new folder under the temp dir)")
    m.add_argument("--no-plots", action="store_true", help="no PNGs")
    m.add_argument("--settle", type=float, default=120.0, metavar="SECONDS",
                   help="with nothing else on the CPU, wait up to this long for a high load average (work that just "
                        "ended) to fall before the preflight judges the machine (default 120)")


def run_bench(args) -> int:
    from verispec.errors import UserError

    if args.bench_command != "matrix":
        raise UserError("choose a benchmark: verispec bench matrix (see verispec bench matrix --help)")
    opts = matrix_options(args)
    from verispec.bench.matrix import conformance_failures, markdown, run_matrix, write_outputs

    result = run_matrix(opts)
    for row in result["rows"]:
        print(json.dumps(row))
    written = write_outputs(result, opts.out, plots=opts.plots)
    print(markdown(result))
    print(f"written: {', '.join(str(p) for p in written)}", file=sys.stderr)
    failures = conformance_failures(result)
    if failures:
        for r in failures:
            print(f"CONFORMANCE FAILED: {r['model']} {r['arm']} {r['lane']} {r['workload']}: "
                  f"{100 * r['conformance']:.1f}% valid", file=sys.stderr)
            for line in r["invalid"]:
                print(f"  {line}", file=sys.stderr)
        return 1
    return 0


def matrix_options(args):
    from verispec.bench.matrix import ARMS, LANES, Options, default_out
    from verispec.bench.peers import PEER_ARMS
    from verispec.bench.workloads import WORKLOADS
    from verispec.data.eval_prompts import default_eval_dir
    from verispec.errors import UserError

    def names(text: str, known, what: str) -> list[str]:
        chosen = [x.strip() for x in text.split(",") if x.strip() and x.strip() != "none"] \
            if what == "peer" else [x.strip() for x in text.split(",") if x.strip()]
        unknown = [x for x in chosen if x not in known]
        if unknown:
            raise UserError(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(known)}")
        return chosen

    quick = QUICK if args.quick else {}
    max_tokens = dict(quick.get("max_tokens", {}))
    for item in args.max_tokens:
        name, _, value = item.partition("=")
        if name not in WORKLOADS or not value.isdigit() or int(value) < 1:
            raise UserError(f"--max-tokens takes WORKLOAD=N with a workload of {', '.join(WORKLOADS)}, got {item!r}")
        max_tokens[name] = int(value)
    grammar = {"off": False, "on": True}
    settings = names(args.grammar, tuple(grammar), "grammar setting")
    repeats = quick.get("repeats", args.repeats) if args.repeats == 3 else args.repeats
    prompts = quick.get("prompts", args.prompts) if args.prompts == 4 else args.prompts
    if repeats < 1 or prompts < 1 or args.threads < 1:
        raise UserError("--repeats, --prompts and --threads must be at least 1")
    eval_dir = Path(args.eval_dir) if args.eval_dir else default_eval_dir()
    if eval_dir is None or not eval_dir.is_dir():
        raise UserError("no eval prompts found: pass --eval-dir (a folder of mt-bench.jsonl, gsm8k.jsonl, ...)")
    models = args.model or ["smollm2-135m-instruct", "gemma3-270m"]
    if args.url and len(models) != 1:
        raise UserError("--url measures one running server: name its model once with -m")
    skip = set(args.skip)
    return Options(
        models=models,
        arms=names(args.arms, ARMS, "arm"),
        peers=[] if args.url else names(args.peers, PEER_ARMS, "peer"),
        lanes=names(quick.get("lanes", args.lanes) if args.lanes == LANES_DEFAULT else args.lanes, tuple(LANES), "lane"),
        workloads=names(args.workloads, WORKLOADS, "workload"),
        grammar=[grammar[s] for s in settings],
        repeats=repeats, prompts=prompts, max_tokens=max_tokens, threads=args.threads, draft_model=args.draft_model,
        eval_dir=eval_dir, out=Path(args.out) if args.out else default_out(), url=args.url.rstrip("/") if args.url else None,
        skip=skip, serve_args=args.serve_args.split(), plots=not args.no_plots, dtype=args.dtype,
        settle_s=max(0.0, args.settle), peer_batch=args.peer_batch)
