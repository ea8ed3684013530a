"""`verispec serve`: load a model, start the engine loop and the OpenAI-compatible server."""

from __future__ import annotations

import logging
import os
import re
import sys

from verispec.errors import UserError

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'4GB', '512MiB', '1.5g', '1073741824' -> bytes (a bare number is bytes; GB is 10^9)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise UserError(f"cannot read {text!r} as a size: use bytes or a unit, e.g. 4GB, 512MiB, 2G")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UserError(f"the size must be positive, got {text!r}")
    return value


def _size_arg(text: str) -> int:
    """parse_bytes for argparse: a bad size is argparse's usage error (exit 2), not a traceback."""
    import argparse

    try:
        return parse_bytes(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_kernel_args(p) -> None:
    g = p.add_argument_group("kernels (chosen by measurement on this machine, cached: `verispec profile` shows them)")
    g.add_argument("--kernels", choices=["auto", "invariant", "fastest", "onednn"], default="auto",
                   help="auto: batch-invariant kernels wherever every matrix has one (then speculation is "
                        "token-identical to plain decoding in any dtype; `verispec profile` shows what that costs), "
                        "else the fastest; invariant / fastest force either (fastest may change greedy tokens under "
                        "speculation or batching at near-ties); onednn: PyTorch's kernels only")
    g.add_argument("--quant", choices=["auto", "none", "q8_0", "q4_1"], default="auto",
                   help="weight format: auto = per matrix the smallest format that reproduces the model's weights "
                        "exactly (a GGUF's own q4_1 / q8_0 tensors), else the dtype; q8_0 / q4_1: those exact "
                        "formats, and this one for every other matrix (a different, lossy model); none keeps the dtype")


def add_serve_args(p) -> None:
    p.add_argument("--model", "-m", default=None, help="model name, folder, .gguf or hub id (default: smollm2-135m-instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("VERISPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VERISPEC_API_KEY, else none; "
                        "an empty key is refused rather than read as no key)")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: the -m value)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="activations (and unquantized weights) dtype; auto = the one whose kernel plan measures "
                        "faster on this machine (verispec profile shows it)")
    add_kernel_args(p)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    g = p.add_argument_group("batching and memory")
    g.add_argument("--kv-budget", type=_size_arg, default=None, metavar="SIZE",
                   help="KV cache for all running requests, e.g. 4GB (default: half the free RAM, 80%% of free GPU memory); "
                        "requests queue when it is full, and one that can never fit gets a 400")
    g.add_argument("--max-batch", type=int, default=None, metavar="N", help="most requests decoding at once (default 32)")
    g.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prompt tokens prefilled per step while others decode (default 128): smaller keeps streams "
                        "smoother, larger gives a faster first token")
    g.add_argument("--max-model-len", type=int, default=None, metavar="N", help="cap the context window (default: the model's)")
    g.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                   help="what a request that sets no max_tokens may generate (default 2048; also capped by what is left "
                        "of the context and by the KV budget)")
    g.add_argument("--prefix-cache", type=_size_arg, default=None, metavar="SIZE",
                   help="KV of finished requests kept for later prompts that start with the same tokens (a chat's next "
                        "turn): those tokens are not prefilled again (default: a quarter of the KV budget, which it "
                        "counts against; entries are evicted before a request would wait)")
    g.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt in full")
    g.add_argument("--max-body-bytes", type=_size_arg, default=None, metavar="SIZE", help="largest request body (default 8MiB)")
    g.add_argument("--grammar-cache", type=_size_arg, default=None, metavar="SIZE",
                   help="structured output: compiled grammars kept for reuse across requests (default 64MiB; the "
                        "least recently used go first)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="server log level")


def run_serve(args) -> int:
    import torch

    from verispec.engine.engine import Engine, EngineConfig
    from verispec.models.loader import load_for_serving, resolve_dtype
    from verispec.models.registry import DEFAULT_MODEL, display_name
    from verispec.models.tokenizer import generation_defaults
    from verispec.server.app import ServerConfig, create_app
    from verispec.server.errors import DEFAULT_MAX_BODY_BYTES
    from verispec.drafting.factory import build_drafter, engine_options

    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key (or $VERISPEC_API_KEY) is empty: an empty key would let every request in; "
                        "give a real key, or unset it to serve without one")
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise UserError(f"--default-max-tokens must be at least 1, got {args.default_max_tokens}")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(
        kv_budget=args.kv_budget,
        prefix_cache=not args.no_prefix_cache,
        prefix_cache_bytes=args.prefix_cache,
        **{k: v for k, v in (("max_rows", args.max_batch), ("prefill_chunk", args.prefill_chunk),
                             ("max_model_len", args.max_model_len)) if v is not None},
        **engine_options(args),
    )
    model = args.model or DEFAULT_MODEL
    loaded = load_for_serving(model, args.dtype, args.kernels, args.quant)
    drafter = build_drafter(loaded, args.speculate, args.draft_model, drafter_dtype(args.dtype), args.confidence_threshold,
                            args.no_draft)
    engine = Engine(loaded.model, loaded.tokenizer, loaded.stop_ids, config, drafter=drafter)
    name = args.served_model_name or display_name(model)
    server_config = ServerConfig(
        model_name=name,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
        generation_defaults=generation_defaults(loaded.folder, loaded.name),
        aliases=tuple(a for a in (model, loaded.name) if a != name),
        **({"grammar_cache_bytes": args.grammar_cache} if args.grammar_cache is not None else {}),
        **({"default_max_tokens": args.default_max_tokens} if args.default_max_tokens is not None else {}),
    )
    app = create_app(engine, server_config, manage_engine=False)
    print(
        f"verispec: serving {name!r} ({loaded.model.dtype}, {plan_summary(loaded)}, context {engine.max_model_len}, KV budget "
        f"{engine.kv_budget / 2**30:.2f} GiB, up to {config.max_rows} rows"
        + (f", speculation: {engine.drafting.provider.describe()}" if engine.drafting.active else "")
        + f") on http://{args.host}:{args.port}/v1"
        + (" (API key required)" if server_config.api_key else ""),
        file=sys.stderr,
        flush=True,
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return serve_forever(engine, app, args.host, args.port, args.log_level)


def plan_summary(loaded) -> str:
    plan = getattr(loaded.model, "kernel_plan", None)
    if plan is None:
        return "PyTorch kernels"
    formats = sorted(set(plan.formats.values()))
    if plan.key.get("mode") == "onednn":  # pinned by --kernels onednn, not chosen for speed
        kind = "PyTorch-only (--kernels onednn)"
    else:
        kind = "batch-invariant" if plan.invariant else "fastest"
    return f"weights {'/'.join(formats)}, {kind} kernels"


def drafter_dtype(dtype: str):
    """Drafters keep PyTorch's kernels: bfloat16 where the hardware runs it natively."""
    from verispec.models.loader import resolve_dtype

    return resolve_dtype(dtype)


def serve_forever(engine, app, host: str, port: int, log_level: str) -> int:
    """HTTP in a background thread, the engine loop on this (the main) thread: the thread
    that loaded the model keeps its OpenMP team, which decodes ~1.8x faster here than a
    second thread would (see Engine.start). Ctrl-C or SIGTERM stops both."""
    import signal
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5))
    http = threading.Thread(target=server.run, name="verispec-http", daemon=True)
    http.start()
    previous = signal.signal(signal.SIGTERM, lambda *_: engine.stop())
    try:
        engine.run_forever(keep_running=http.is_alive)
    except KeyboardInterrupt:
        print("\nverispec: shutting down", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.should_exit = True
        engine.shutdown()
        http.join(10)
    if not server.started:
        raise UserError(f"the HTTP server could not start on {host}:{port} (is the port in use?)")
    return 0
