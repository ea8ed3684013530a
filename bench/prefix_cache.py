"""Prefix-cache benchmark: ShareGPT conversations replayed turn by turn by concurrent users.

Each user replays one ShareGPT conversation (its human turns, each cut to --max-chars; the
assistant turns are the model's own answers, so every prompt starts with the previous
turn's prompt and answer, as a chat client sends them), `--users` users at once, greedy,
`--max-tokens` per answer. The same conversations in the same order run against
`verispec serve` with the prefix cache (the default) and with `--no-prefix-cache`, in the
same run, one server after the other. Measured per arm: TTFT p50 of first turns and of
later turns (at the first SSE content event), prompt tokens the server computed
(/stats prefill_tokens) against prompt tokens sent, the cache's hit rate, and the
per-stream decode tok/s (median) — the cache must not slow decoding down.

    .venv/bin/python bench/prefix_cache.py                    # default model, 4 users x 4 turns
    .venv/bin/python bench/prefix_cache.py -m gemma3-270m --users 4 --turns 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from verispec.bench.loadgen import quantile
from verispec.data.sharegpt import conversations
from verispec.models.kernel_plan import cpu_name
from verispec.server.launch import live_server


def pick_conversations(users: int, turns: int, max_chars: int) -> list[list[str]]:
    """The first `users` conversations with at least `turns` human turns (each cut)."""
    out = []
    for conv in conversations():
        human = [(t.get("value") or "").strip()[:max_chars] for t in conv.get("conversations") or []
                 if t.get("from") == "human"]
        if len(human) >= turns and all(human[:turns]):
            out.append(human[:turns])
            if len(out) == users:
                return out
    raise SystemExit(f"ShareGPT has fewer than {users} conversations with {turns} human turns")


def replay(base: str, model: str, turns: list[str], max_tokens: int, results: list, errors: list) -> None:
    history = []
    with httpx.Client(timeout=600) as client:
        for index, text in enumerate(turns):
            history.append({"role": "user", "content": text})
            body = {"model": model, "messages": history, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            start, first, answer, usage = time.perf_counter(), None, [], None
            try:
                with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        usage = chunk.get("usage") or usage
                        for c in chunk.get("choices") or []:
                            piece = (c.get("delta") or {}).get("content") or ""
                            if piece and first is None:
                                first = time.perf_counter()
                            answer.append(piece)
            except httpx.HTTPError as e:
                errors.append(f"turn {index}: {e}")
                return
            end = time.perf_counter()
            tokens = usage["completion_tokens"] if usage else 0
            results.append({"turn": index, "ttft": (first or end) - start, "prompt_tokens": usage["prompt_tokens"]
                            if usage else 0, "tokens": tokens,
                            "tok_s": (tokens - 1) / (end - first) if first and tokens > 1 and end > first else None})
            history.append({"role": "assistant", "content": "".join(answer)})


def run_arm(name: str, flags: list[str], args, convs: list[list[str]], log_dir: Path) -> dict:
    with live_server("-m", args.model, "--served-model-name", "m", *flags, log=log_dir / f"{name}.log") as base:
        before = httpx.get(base + "/stats").json()
        results, errors = [], []
        threads = [threading.Thread(target=replay, args=(base, "m", turns, args.max_tokens, results, errors))
                   for turns in convs]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        after = httpx.get(base + "/stats").json()
    first = [r["ttft"] for r in results if r["turn"] == 0]
    later = [r["ttft"] for r in results if r["turn"] > 0]
    rates = [r["tok_s"] for r in results if r["tok_s"]]
    sent = sum(r["prompt_tokens"] for r in results)
    prefix = after.get("prefix_cache") or {}
    return {"arm": name, "requests": len(results), "errors": errors, "wall_s": round(wall, 1),
            "ttft_first_p50_ms": round(1000 * quantile(first, 0.5)) if first else None,
            "ttft_later_p50_ms": round(1000 * quantile(later, 0.5)) if later else None,
            "ttft_later_p95_ms": round(1000 * quantile(later, 0.95)) if later else None,
            "prompt_tokens": sent, "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
            "hit_rate": prefix.get("hit_rate"), "cache_mb": round(prefix.get("bytes", 0) / 2**20, 1),
            "decode_tok_s": round(statistics.median(rates), 1) if rates else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("-m", "--model", default="smollm2-135m-instruct")
    p.add_argument("--users", type=int, default=4, help="concurrent users (default 4)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    p.add_argument("--max-chars", type=int, default=600, help="characters kept of each human turn (default 600)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (default 64)")
    args = p.parse_args()
    convs = pick_conversations(args.users, args.turns, args.max_chars)
    log_dir = Path(tempfile.mkdtemp(prefix="verispec-prefix-bench-"))
    rows = [run_arm("cache on", [], args, convs, log_dir), run_arm("cache off", ["--no-prefix-cache"], args, convs,
                                                                   log_dir)]
    on, off = rows
    cpu = cpu_name()
    print(f"{args.model}: {args.users} users x {args.turns} ShareGPT turns (<= {args.max_chars} chars), "
          f"max_tokens {args.max_tokens}, greedy, on {cpu}")
    print(f"{'arm':<10} {'TTFT turn1':>10} {'TTFT later p50':>14} {'p95':>7} {'prompt tok':>10} {'computed':>9} "
          f"{'hit rate':>8} {'cache MB':>8} {'decode tok/s':>12}")
    for r in rows:
        print(f"{r['arm']:<10} {r['ttft_first_p50_ms']:>10} {r['ttft_later_p50_ms']:>14} {r['ttft_later_p95_ms']:>7} "
              f"{r['prompt_tokens']:>10} {r['prefill_tokens']:>9} {r['hit_rate'] or 0:>8.1%} {r['cache_mb']:>8} "
              f"{r['decode_tok_s']:>12}")
    speedup = off["ttft_later_p50_ms"] / on["ttft_later_p50_ms"] if on["ttft_later_p50_ms"] else None
    print(f"later turns: TTFT p50 {speedup:.2f}x lower with the cache; prefill tokens computed "
          f"{on['prefill_tokens']} vs {off['prefill_tokens']}; decode {on['decode_tok_s']} vs {off['decode_tok_s']} tok/s")
    for r in rows:
        if r["errors"]:
            print(f"{r['arm']}: errors: {r['errors'][:3]}", file=sys.stderr)
    print(json.dumps({"bench": "prefix_cache", "model": args.model, "users": args.users, "turns": args.turns,
                      "cpu": cpu, "ttft_later_speedup": round(speedup, 2) if speedup else None, "rows": rows}))


if __name__ == "__main__":
    main()
