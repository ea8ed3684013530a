"""`verispec generate`: one prompt, streamed to the terminal, with a closing stats line."""

from __future__ import annotations

import json
import sys

import torch

from verispec.errors import UserError
from verispec.engine.generate import GenerationStats
from verispec.engine.request import RequestOutput, TokenInfo
from verispec.engine.sampling import SamplingParams


# what an unset sampling flag falls back to when the model recommends nothing: greedy
CLI_FALLBACK = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}


def sampling_params_from_args(args, recommended: dict | None = None) -> SamplingParams:
    """The flags the user set; for the others the model's recommended sampling
    (generation_config.json or the catalog), else greedy."""
    recommended = recommended or {}

    def pick(name: str):
        value = getattr(args, name)
        return value if value is not None else recommended.get(name, CLI_FALLBACK[name])

    return SamplingParams(
        temperature=pick("temperature"),
        top_k=int(pick("top_k")),
        top_p=pick("top_p"),
        min_p=pick("min_p"),
        repetition_penalty=pick("repetition_penalty"),
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=parse_logit_bias(args.logit_bias),
        seed=args.seed,
        logprobs=args.logprobs,
    )


def build_prompt(args, loaded) -> list[int]:
    from verispec.models.tokenizer import encode_chat, encode_prompt, has_chat_template

    tokenizer = loaded.tokenizer
    text = args.prompt
    if args.messages is None and text == "-":
        if sys.stdin.isatty():
            raise UserError("no prompt given (pass it as an argument, or pipe it on stdin)")
        text = sys.stdin.read()
    use_chat = args.chat or args.system is not None or args.messages is not None
    if not args.raw and not use_chat:
        use_chat = has_chat_template(tokenizer)
    if use_chat:
        messages = read_messages(args.messages) if args.messages else []
        if args.system is not None:
            messages.insert(0, {"role": "system", "content": args.system})
        if args.messages is None or text != "-":
            messages.append({"role": "user", "content": text})
        ids = encode_chat(tokenizer, messages)
    else:
        ids = encode_prompt(tokenizer, text)
    if not ids:
        raise UserError("the prompt is empty")
    return ids


def constraint_from_args(args):
    """The structured-output flags as a Constraint (None: free text)."""
    import json
    from pathlib import Path

    from verispec.grammar.constraint import Constraint

    def inline_or_file(value: str) -> str:
        path = Path(value)
        if len(value) < 4096 and "\n" not in value and path.is_file():
            return path.read_text()
        return value

    if args.json_schema is not None:
        text = inline_or_file(args.json_schema)
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--json-schema is neither a file nor valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise UserError("--json-schema must be a JSON schema (an object)")
        return Constraint.json_schema(schema)
    if args.json:
        return Constraint.json_object()
    if args.regex is not None:
        return Constraint.regex(args.regex)
    if args.choice is not None:
        if any(not c for c in args.choice):
            raise UserError("--choice values must not be empty")
        return Constraint.choice(args.choice)
    if args.grammar is not None:
        return Constraint.grammar(inline_or_file(args.grammar))
    return None


def compile_grammar(constraint, loaded):
    from verispec.grammar.guard import compile_guarded
    from verispec.grammar.llguidance_backend import LLGuidanceBackend
    from verispec.grammar.constraint import GrammarError

    try:
        return compile_guarded(LLGuidanceBackend(loaded.tokenizer, loaded.model.args.vocab_size, loaded.stop_ids), constraint)
    except GrammarError as e:  # an invalid constraint, or a tokenizer the backend cannot use
        raise UserError(str(e)) from None


def check_context(n_prompt: int, max_tokens: int, context: int) -> int:
    """The number of new tokens that fit; the prompt itself must leave room for one."""
    if n_prompt >= context:
        raise UserError(f"the prompt is {n_prompt} tokens; the model's context window is {context} tokens")
    return min(max_tokens, context - n_prompt)


def run_generate(args) -> int:
    from verispec.engine.engine import Engine, EngineConfig
    from verispec.engine.request import GenerationRequest
    from verispec.models.loader import load_for_serving
    from verispec.serve_cli import drafter_dtype
    from verispec.models.registry import DEFAULT_MODEL
    from verispec.models.tokenizer import generation_defaults
    from verispec.drafting.factory import build_drafter, engine_options

    sampling_params_from_args(args)  # flag mistakes before the model loads
    spec_options = engine_options(args)
    constraint = constraint_from_args(args)
    if args.max_tokens <= 0:
        raise UserError(f"--max-tokens must be positive, got {args.max_tokens}")
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_for_serving(args.model or DEFAULT_MODEL, args.dtype, args.kernels, args.quant)
    params = sampling_params_from_args(args, generation_defaults(loaded.folder, loaded.name))
    prompt = build_prompt(args, loaded)
    max_new = check_context(len(prompt), args.max_tokens, loaded.model.args.max_position_embeddings)
    grammar = compile_grammar(constraint, loaded) if constraint is not None else None

    # the same engine as the server, driven inline for one request
    drafter = build_drafter(loaded, args.speculate, args.draft_model, drafter_dtype(args.dtype), args.confidence_threshold,
                            args.no_draft)
    engine = Engine(loaded.model, loaded.tokenizer, loaded.stop_ids, EngineConfig(max_rows=1, **spec_options),
                    drafter=drafter)
    tokens: list[TokenInfo] = []
    final: list[RequestOutput] = []
    out = sys.stdout

    def sink(delta: RequestOutput) -> None:
        out.write(delta.text)
        out.flush()
        tokens.extend(delta.tokens)
        if delta.finished:
            final.append(delta)

    engine.submit(GenerationRequest(prompt, max_new, params, grammar=grammar), sink)
    engine.run_until_idle()
    out.write("\n")
    out.flush()
    done = final[0]
    if done.error:
        raise UserError(f"generation failed: {done.error}")
    if params.logprobs is not None:
        print_logprobs(loaded.tokenizer, tokens)
    if not args.quiet_stats:
        stats = GenerationStats(len(prompt), done.completion_tokens, done.time_to_first_token or 0.0,
                                done.decode_time or 0.0, done.finish_reason)
        print(format_stats(stats, done.speculation), file=sys.stderr)
    return 0


def print_logprobs(tokenizer, tokens: list[TokenInfo]) -> None:
    for info in tokens:
        alts = "  ".join(f"{tokenizer.decode([t])!r}:{lp:.3f}" for t, lp in info.top)
        print(f"{tokenizer.decode([info.token])!r:>16} {info.logprob:8.3f}   {alts}", file=sys.stderr)


def format_stats(s: GenerationStats, speculation: dict | None = None) -> str:
    drafting = ""
    if speculation:
        forced = (f" (grammar-forced {speculation['forced_accepted']}/{speculation['forced_drafted']})"
                  if speculation.get("forced_drafted") else "")
        drafting = (f" | spec: {speculation['accepted']}/{speculation['drafted']} drafts accepted{forced}, "
                f"{speculation['mean_accepted_length']:.2f} tok/round")
    return (
        f"[prompt {s.prompt_tokens} tok | TTFT {s.prefill_s * 1000:.0f} ms ({s.prefill_tok_s:.0f} tok/s prefill) | "
        f"{s.generated_tokens} tok at {s.decode_tok_s:.1f} tok/s decode{drafting} | finish: {s.finish_reason}]"
    )


def parse_logit_bias(items: list[str]) -> dict[int, float]:
    bias = {}
    for item in items:
        token, sep, value = item.partition(":")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise UserError(f"--logit-bias expects ID:BIAS, got {item!r}") from None
        if not sep:
            raise UserError(f"--logit-bias expects ID:BIAS, got {item!r}")
    return bias


def read_messages(path: str) -> list[dict]:
    try:
        messages = json.loads(open(path).read())
    except FileNotFoundError:
        raise UserError(f"--messages: no such file: {path}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--messages: {path} is not valid JSON ({e})") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise UserError("--messages: expected a JSON list of {\"role\": ..., \"content\": ...} objects")
    return messages
