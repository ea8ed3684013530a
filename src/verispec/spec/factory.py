"""From command-line choices to a draft provider (`--speculate`, `--draft-model`)."""

from __future__ import annotations

from verispec.errors import UserError
from verispec.spec.source import DraftProvider

SPECULATE_CHOICES = ("ngram", "none")


def build_drafter(target, speculate: str | None, draft_model: str | None, dtype) -> DraftProvider | None:
    """`target` is the LoadedModel being served. None: no speculation."""
    if draft_model and speculate not in (None, "none"):
        raise UserError("choose one of --speculate and --draft-model")
    if draft_model:
        return load_draft_model(target, draft_model, dtype)
    if speculate in (None, "none"):
        return None
    if speculate == "ngram":
        from verispec.spec.ngram import NgramProvider

        return NgramProvider()
    raise UserError(f"unknown --speculate {speculate!r}; choose one of {', '.join(SPECULATE_CHOICES)}")


def load_draft_model(target, spec: str, dtype) -> DraftProvider:
    from verispec.models.loader import load_model
    from verispec.spec.two_model import TwoModelProvider, check_same_tokenizer

    draft = load_model(spec, dtype=dtype)
    try:
        check_same_tokenizer(target.tokenizer, draft.tokenizer, target.model.args.vocab_size, draft.model.args.vocab_size)
    except ValueError as e:
        raise UserError(f"--draft-model {spec}: {e}") from None
    return TwoModelProvider(draft.model, max_draft=63, label=f"draft model {spec}")


def engine_options(args) -> dict:
    """EngineConfig fields from the speculation flags."""
    options = {"adaptive_draft": not args.fixed_draft}
    if args.num_draft_tokens is not None:
        if not 1 <= args.num_draft_tokens <= 63:
            raise UserError(f"--num-draft-tokens must be in 1..63, got {args.num_draft_tokens}")
        options["num_draft_tokens"] = args.num_draft_tokens
    return options
