"""Chunked prefill: how a long prompt arriving mid-decode affects running streams.

Four requests are decoding when a ~3,000-token prompt arrives. For each prefill chunk
size (tokens of prompt per engine step while others decode) this prints the long
request's time to first token and the longest stall the running streams see between two
tokens. "unchunked" prefills the whole prompt in one step, which is what an engine
without chunked prefill does. This is what chose the default `--prefill-chunk`.

    .venv/bin/python bench/prefill_interleave.py [--dtype bfloat16] [--chunks 64,128,256,512]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def run(loaded, chunk: int, short: list[int], long: list[int], streams: int) -> dict:
    from verispec.engine.engine import Engine, EngineConfig
    from verispec.engine.request import GenerationRequest

    engine = Engine(loaded.model, loaded.tokenizer, [], EngineConfig(prefill_chunk=chunk, idle_prefill_chunk=chunk))
    for _ in range(streams):
        engine.submit(GenerationRequest(short, 400), lambda out: None)
    for _ in range(10):  # the streams are decoding
        engine.step()
    got_first = []
    t0 = time.perf_counter()
    engine.submit(GenerationRequest(long, 1), lambda out: got_first.append(time.perf_counter()) if out.finished else None)
    steps = []
    while not got_first:
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    engine.shutdown()
    return {"chunk": chunk, "ttft_ms": round((got_first[0] - t0) * 1000), "max_stall_ms": round(max(steps) * 1000),
            "steps": len(steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--chunks", default="64,128,256,512")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from verispec.models.loader import load_model
    from verispec.models.tokenizer import encode_chat

    loaded = load_model("smollm2-135m-instruct", dtype=getattr(torch, args.dtype))
    short = encode_chat(loaded.tokenizer, [{"role": "user", "content": "Write a long story about a dragon."}])
    text = "Summarize this text. " + "The quick brown fox jumps over the lazy dog. " * 300
    long = encode_chat(loaded.tokenizer, [{"role": "user", "content": text}])
    chunks = [int(c) for c in args.chunks.split(",")]
    rows = [run(loaded, c, short, long, args.streams) for c in chunks]
    rows.append({**run(loaded, len(long), short, long, args.streams), "chunk": "unchunked"})
    decode = run(loaded, 1, short, short[:8], args.streams)["max_stall_ms"]

    print(f"\nSmolLM2-135M {args.dtype}, {args.streams} streams decoding, a {len(long)}-token prompt arrives; "
          f"a plain decode step of the streams takes ~{decode} ms")
    print(f"{'prefill chunk':>14}{'long TTFT':>12}{'max stall':>12}{'steps':>7}")
    for r in rows:
        print(f"{r['chunk']:>14}{r['ttft_ms']:>9} ms{r['max_stall_ms']:>9} ms{r['steps']:>7}")
    print(json.dumps({"bench": "prefill_interleave", "dtype": args.dtype, "prompt_tokens": len(long),
                      "streams": args.streams, "decode_step_ms": decode, "rows": rows}))


if __name__ == "__main__":
    main()
