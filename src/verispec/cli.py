"""`verispec` command line: serve, generate, pull, models.

User mistakes (unknown model, missing files, bad sampling values, a prompt longer than
the context window) end with one line on stderr and exit code 2 — never a traceback.
Set VERISPEC_DEBUG=1 to see the traceback anyway.
"""

from __future__ import annotations

import argparse
import os
import sys

from verispec.errors import UserError

DEFAULT_PROMPT_HELP = "the prompt text ('-' or omitted: read stdin)"

EPILOG = """\
examples:
  verispec serve                                            OpenAI-compatible server on 127.0.0.1:8000
  verispec serve --port 8080 --api-key secret --kv-budget 4GB
  verispec generate "Give me three tips for writing clear code."          chat prompt, default model
  verispec generate --system "Answer in French." "Hi"      with a system message
  verispec generate --raw "The capital of France is"       plain completion, no template
  verispec generate -m gemma3-270m --raw --max-tokens 64 "Once upon a time"
  verispec generate --temperature 0.8 --top-p 0.95 --seed 7 "Tell me a story"
  verispec generate --speculate ngram "Repeat this paragraph, fixing typos: ..."
  verispec generate --json-schema person.json "Describe a person"  output validates against a schema
  verispec generate --choice yes --choice no "Is water wet?"     exactly one of the choices
  verispec serve --draft-model ./smaller-same-tokenizer-model
  verispec models                                           list the embedded models
  verispec pull gemma3-270m                                 fetch + convert once
  verispec bench matrix --quick                             every feature combination vs peers, ~10 min

models (-m): an embedded model name (see `verispec models`), a Hugging Face folder
(config.json + *.safetensors + tokenizer), a .gguf file, or a hub id when online.
"""




def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (unset flags: the model's recommended sampling, e.g. temperature 0.2 / "
                             "top-p 0.9 for smollm2-135m-instruct; greedy for a model that recommends none)")
    g.add_argument("--temperature", "-t", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (1 = off)")
    g.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p x the top probability (0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=None, help="CTRL-style penalty (1 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty, -2..2")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty, -2..2")
    g.add_argument(
        "--logit-bias", action="append", default=[], metavar="ID:BIAS", help="add BIAS (-100..100) to token ID; repeatable"
    )
    g.add_argument("--seed", type=int, default=None, help="reproducible sampling (default: a fresh random seed)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N", help="print each token's logprob and N alternatives")


def _add_structured_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output (one of; the output is guaranteed to match)").add_mutually_exclusive_group()
    g.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="a JSON schema: inline JSON or a file path; the output validates against it")
    g.add_argument("--json", action="store_true", help="any JSON object")
    g.add_argument("--regex", default=None, help="the output fully matches this regex")
    g.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="the output is exactly one of these; repeat for each choice")
    g.add_argument("--grammar", default=None, metavar="LARK",
                   help="a grammar in llguidance's Lark syntax (inline or a file path); start rule: start")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    from verispec.engine.verify_schedule import MODES as VERIFY_MODES, SERVED as SERVED_SCHEDULE

    g = p.add_argument_group("speculative decoding (lossless: the same tokens at temperature 0, the same distribution above)")
    g.add_argument("--speculate", choices=["ngram", "dspark", "composite", "none"], default=None,
                   help="ngram: draft by prompt lookup (no weights; pays on edits, summaries, code); dspark: the DSpark "
                        "drafter that ships with an embedded model (or --draft-model's); composite: the model drafter "
                        "(--draft-model, else the shipped one) and n-gram lookup for every row, the candidate with the "
                        "larger expected gain verified each round; none: off. Unset: what measured fastest for an "
                        "embedded model (smollm2-135m-instruct: ngram), none for other models")
    g.add_argument("--no-draft", action="store_true",
                   help="no speculation at all (turns off an embedded model's default speculation)")
    g.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="a DSpark drafter (DeepSpec-format folder or hub id, detected from its files), or a smaller "
                        "model with the same tokenizer (name, folder, .gguf or hub id)")
    g.add_argument("--confidence-threshold", type=float, default=None, metavar="T",
                   help="DSpark: end each proposal before the first position whose confidence is below T "
                        "(default: the checkpoint's, else 0 = keep all)")
    g.add_argument("--num-draft-tokens", type=int, default=None, metavar="N",
                   help="most draft tokens a request verifies per step (default 8); fewer are drafted when they do not pay")
    g.add_argument("--fixed-draft", action="store_true",
                   help="always draft --num-draft-tokens (turn off the cost-based draft length policy)")
    g.add_argument("--verify-schedule", choices=list(VERIFY_MODES), default=SERVED_SCHEDULE,
                   help="how many drafted tokens each request verifies per step: strict (default: DSpark's Algorithm 1 "
                        "as printed, maximize expected tokens x measured steps/s across the step's rows, stopping at "
                        "the first draft that does not pay), production (its global-search form: the token budget from "
                        "two steps ago spent on this step's most confident drafts), cost (each row's own cost-based "
                        "draft length; what verispec did before). Chosen by bench/scheduler.py: for the default n-gram "
                        "source strict and cost are tied and production is below both (README, Verify scheduling)")
    g.add_argument("--no-forced-drafts", action="store_true",
                   help="structured output: decode the tokens a grammar forces (JSON punctuation, property names) one "
                        "step each instead of verifying them as drafts (same output, more steps; for A/B runs)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verispec",
        description="Lossless speculative-decoding LLM inference on PyTorch.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="generate text from a prompt, streaming to the terminal",
        description="Generate text, streaming it to stdout; a stats line goes to stderr.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("prompt", nargs="?", default="-", help=DEFAULT_PROMPT_HELP)
    gen.add_argument("--model", "-m", default=None, help="model name, folder, .gguf or hub id (default: smollm2-135m-instruct)")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--chat", action="store_true", help="render the prompt with the chat template (default when the model has one)")
    mode.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    gen.add_argument("--system", default=None, help="system message (implies --chat)")
    gen.add_argument("--messages", default=None, metavar="FILE", help="a JSON list of {role, content} messages (implies --chat)")
    gen.add_argument("--max-tokens", "-n", type=int, default=256, help="maximum new tokens (default 256)")
    gen.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="weights dtype; auto = bfloat16 where the CPU/GPU runs it natively, else float32 (float32 is the exact reference)",
    )
    gen.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    from verispec.serve_cli import add_kernel_args

    add_kernel_args(gen)
    gen.add_argument("--quiet-stats", action="store_true", help="do not print the closing stats line")
    _add_sampling_args(gen)
    _add_structured_args(gen)
    add_spec_args(gen)

    serve = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (continuous batching)",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics and /stats; "
        "requests share one continuously batched engine loop and are admitted by KV memory budget.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from verispec.serve_cli import add_serve_args

    add_serve_args(serve)
    add_spec_args(serve)

    from verispec.dspark_cli import add_dspark_parser

    add_dspark_parser(sub, argparse.RawDescriptionHelpFormatter)

    from verispec.bench.cli import add_bench_parser

    add_bench_parser(sub, argparse.RawDescriptionHelpFormatter)

    prof = sub.add_parser("profile", help="show (or measure again) this machine's kernel choices and SPS table",
                          description="The kernels verispec chose for each matrix of a model on this machine, with "
                                      "their measured times at 1 row and a verify block, and where the choice is "
                                      "cached; then the SPS table of the served plan (a target forward's time and "
                                      "steps per second by its token count, what speculation's draft length and "
                                      "verify schedule weigh drafts against). The first serve or generate measures "
                                      "them too.")
    prof.add_argument("--model", "-m", default=None, help="model (default: smollm2-135m-instruct)")
    prof.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    prof.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    prof.add_argument("--refresh", action="store_true", help="measure again instead of using the cached choice")
    add_kernel_args(prof)

    sub.add_parser("models", help="list the embedded models and whether they are cached")
    pull = sub.add_parser("pull", help="fetch and convert an embedded model into the cache")
    pull.add_argument("name", nargs="?", default=None, help="model name (default: smollm2-135m-instruct)")
    pull.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from verispec.allocator import keep_large_blocks

    keep_large_blocks()  # before the model loads: every large tensor after it can reuse freed blocks
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line for user mistakes, see _is_user_error
        if os.environ.get("VERISPEC_DEBUG") or not _is_user_error(e):
            raise
        print(f"verispec: error: {e}", file=sys.stderr)
        return 2


def _is_user_error(e: Exception) -> bool:
    from verispec.models.kv_cache import CacheError
    from verispec.models.config import UnsupportedModelError
    from verispec.models.config import ModelFilesError
    from verispec.models.registry import RegistryError

    return isinstance(e, (UserError, ValueError, CacheError, UnsupportedModelError, ModelFilesError, RegistryError, OSError))


def _dispatch(args) -> int:
    from verispec.models import registry

    if args.command == "models":
        return registry.cmd_models()
    if args.command == "pull":
        return registry.cmd_pull(args.name or registry.DEFAULT_MODEL, progress=not args.quiet)
    if args.command == "generate":
        from verispec.generate_cli import run_generate

        return run_generate(args)
    if args.command == "serve":
        from verispec.serve_cli import run_serve

        return run_serve(args)
    if args.command == "profile":
        return run_profile(args)
    if args.command == "dspark":
        from verispec.dspark_cli import run_dspark

        return run_dspark(args)
    if args.command == "bench":
        from verispec.bench.cli import run_bench

        return run_bench(args)
    raise UserError(f"unknown command {args.command!r}")


def run_profile(args) -> int:
    import torch

    from verispec.models import kernel_plan
    from verispec.models.config import from_hf_config, read_config
    from verispec.models.loader import build_model, convert_state_dict, read_tensors, resolve_dtype
    from verispec.models.registry import DEFAULT_MODEL, resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model(args.model or DEFAULT_MODEL)
    margs = from_hf_config(read_config(folder))
    model = build_model(margs, convert_state_dict(margs, read_tensors(folder), torch.float32), torch.float32, pack=False)
    model.ensure_lm()
    dtypes = [torch.bfloat16, torch.float32] if args.dtype == "auto" else [resolve_dtype(args.dtype)]
    plans = {d: kernel_plan.plan_for(model, d, args.quant, args.kernels, refresh=args.refresh, progress=True)
             for d in dtypes}
    chosen = kernel_plan.preferred_dtype(plans)
    print(f"{args.model or DEFAULT_MODEL} on {kernel_plan.cpu_name()} ({torch.get_num_threads()} threads, "
          f"torch {torch.__version__})")
    for dtype, plan in plans.items():
        mark = " (chosen: --dtype auto)" if len(plans) > 1 and dtype == chosen else ""
        print(f"\n{str(dtype).removeprefix('torch.')}{mark}: {plan.step_us / 1000:.2f} ms of kernels per decode + "
              f"verify step; cached in {kernel_plan.profile_path(plan.key)}")
        print(kernel_plan.format_plan(plan))
    _print_sps(args, folder, chosen)
    return 0


def _print_sps(args, folder, dtype) -> None:
    """The SPS table of the served plan (what the verify scheduler weighs drafts against),
    and whether a forward's cost depends on how many rows its tokens span."""
    from verispec.engine import step_costs
    from verispec.models.loader import load_folder

    model = load_folder(folder, dtype=dtype, kernels=args.kernels, quant=args.quant)
    costs, info = step_costs.step_costs_for(model, refresh=args.refresh)
    print(f"\nSPS table of the served plan ({info['source']}: {info['path']}): a target forward of B tokens")
    if info.get("implausible"):
        print(f"  measured {info['attempts']} times and still not sub-additive (a forward of a + b tokens cost more "
              f"than one of a and one of b: {info['implausible'][:3]}): other work on this machine? Not cached.")
    print(f"{'tokens':>7}{'ms':>9}{'steps/s':>9}{'vs 1':>7}")
    for r in costs.table():
        print(f"{r['tokens']:>7}{r['ms']:>9.2f}{r['steps_per_s']:>9.1f}{r['relative']:>6.2f}x")
    one = step_costs.measure(model, sizes=(8,), rows=1)[8]
    spread = step_costs.measure(model, sizes=(8,), rows=8)[8]
    print(f"8 tokens as one row's verify block: {one * 1e3:.2f} ms; as 8 rows of 1: {spread * 1e3:.2f} ms "
          f"({spread / one:.2f}x)")


if __name__ == "__main__":
    sys.exit(main())
