"""From command-line choices to a draft provider (`--speculate`, `--draft-model`,
`--no-draft`), and the drafters that ship with verispec for its embedded models."""

from __future__ import annotations

from pathlib import Path

from verispec.errors import UserError
from verispec.engine.draft import MAX_DRAFT_TOKENS, DraftProvider

SPECULATE_CHOICES = ("ngram", "dspark", "composite", "none")
# embedded model -> its trained DSpark drafter, shipped in the package (README, "The default drafter")
BUNDLED_DRAFTERS = {name: Path(__file__).resolve().parents[1] / "drafters" / name
                    for name in ("smollm2-135m-instruct", "gemma3-270m")}


def named_drafter(spec: str, option: str) -> Path:
    """A drafter the training tools take (`--init-from`, `measure --drafter`): a shipped
    drafter's name, a checkpoint folder, or a train run folder (its newest checkpoint)."""
    from verispec.drafting.dspark.checkpoint import newest_checkpoint

    folder = BUNDLED_DRAFTERS.get(spec) or newest_checkpoint(Path(spec))
    if not (folder / "config.json").is_file():
        raise UserError(f"{option} {spec}: no drafter there (a folder with config.json, a train run folder, "
                        f"or one of {', '.join(sorted(BUNDLED_DRAFTERS))})")
    return folder


def embedded_name(target) -> str | None:
    """The registry name of an embedded model being served, or None."""
    from verispec.models import registry

    for name in registry.REGISTRY:
        if target.name == name or Path(target.folder).resolve() == registry._model_folder(name).resolve():
            return name
    return None


def default_speculation(model: str | None) -> str | None:
    """What an embedded model (by registry name) speculates with by default: its catalog
    entry's measured choice, "ngram", "dspark" or "composite"; None for any other model."""
    from verispec.models.catalog import REGISTRY

    entry = REGISTRY.get(model or "")
    return entry.speculation if entry is not None else None


def bundled_drafter(target) -> Path | None:
    """The shipped drafter for this target, if it is an embedded model that has one."""
    folder = BUNDLED_DRAFTERS.get(embedded_name(target) or "")
    return folder if folder is not None and (folder / "config.json").is_file() else None


def build_drafter(target, speculate: str | None, draft_model: str | None, dtype,
                  confidence_threshold: float | None = None, no_draft: bool = False) -> DraftProvider | None:
    """`target` is the LoadedModel being served. None: no speculation. With no choice made,
    an embedded model speculates as its catalog entry says (`no_draft` turns that off)."""
    if no_draft and (draft_model or speculate not in (None, "none")):
        raise UserError("--no-draft turns speculation off; it cannot go with --speculate or --draft-model")
    if speculate == "composite":
        return composite_drafter(target, draft_model, dtype, confidence_threshold)
    if draft_model and speculate not in (None, "none", "dspark"):
        raise UserError("choose one of --speculate and --draft-model (or --speculate composite to use both)")
    if draft_model:
        return load_drafter(target, draft_model, dtype, confidence_threshold)
    if speculate is None and not no_draft:
        speculate = default_speculation(embedded_name(target))
        if speculate == "composite":
            return composite_drafter(target, None, dtype, confidence_threshold)
    if speculate == "dspark":
        return shipped_dspark(target, dtype, confidence_threshold)
    if speculate in (None, "none"):
        return None
    if speculate == "ngram":
        from verispec.drafting.ngram import NgramProvider

        return NgramProvider()
    raise UserError(f"unknown --speculate {speculate!r}; choose one of {', '.join(SPECULATE_CHOICES)}")


def shipped_dspark(target, dtype, confidence_threshold: float | None = None) -> DraftProvider:
    """The DSpark drafter that ships for this embedded model (whatever the default is)."""
    shipped = bundled_drafter(target)
    if shipped is None:
        raise UserError("--speculate dspark: this model ships no DSpark drafter; give --draft-model (a DeepSpec-format "
                        "folder or hub id, or a run trained with `verispec dspark train`)")
    return load_drafter(target, str(shipped), dtype, confidence_threshold, label="the shipped drafter")


def composite_drafter(target, draft_model: str | None, dtype, confidence_threshold: float | None = None):
    """`--speculate composite`: the model drafter (--draft-model, else the shipped one) and
    n-gram lookup for every row, the better candidate verified each round."""
    from verispec.drafting.composite import CompositeProvider
    from verispec.drafting.ngram import NgramProvider

    if draft_model:
        model = load_drafter(target, draft_model, dtype, confidence_threshold)
    elif bundled_drafter(target) is None:
        raise UserError("--speculate composite needs a drafter: this model ships none, give --draft-model")
    else:
        model = shipped_dspark(target, dtype, confidence_threshold)
    return CompositeProvider([model, NgramProvider()])


def load_drafter(target, name: str, dtype, confidence_threshold: float | None = None,
                 label: str | None = None) -> DraftProvider:
    """What `--draft-model` names, by what its files are: a DSpark drafter (DeepSpec format), a
    Gemma 4 assistant (transformers' gemma4_assistant: it borrows the target's KV) or a smaller
    model with the target's tokenizer; anything else is refused with a reason."""
    from verispec.models.registry import display_name, resolve_model
    from verispec.drafting.dspark.checkpoint import draft_kind
    from verispec.drafting.dspark.config import DraftCheckpointError

    from verispec.drafting.dspark.checkpoint import newest_checkpoint

    run = Path(name).expanduser()  # a training run folder means its newest checkpoint
    folder = resolve_model(str(newest_checkpoint(run)) if run.is_dir() else name)
    try:
        kind = draft_kind(folder)
        if kind == "dspark":
            from verispec.drafting.dspark.checkpoint import load_dspark
            from verispec.drafting.dspark.source import DSparkProvider

            drafter = load_dspark(folder, target=target, dtype=dtype, device=target.model.device, int8="auto")
            return DSparkProvider(drafter, f"DSpark {label or display_name(name)}", confidence_threshold)
        if kind == "gemma4_assistant":
            from verispec.drafting.gemma4_assistant import AssistantMismatchError, load_assistant

            if confidence_threshold is not None:
                raise UserError("--confidence-threshold applies to DSpark drafters only")
            try:
                return load_assistant(target, folder, dtype, f"gemma4 assistant {label or display_name(name)}")
            except AssistantMismatchError as e:
                raise UserError(f"--draft-model {name}: {e}") from None
    except DraftCheckpointError as e:
        raise UserError(f"--draft-model {name}: {e}") from None
    if confidence_threshold is not None:
        raise UserError("--confidence-threshold applies to DSpark drafters only")
    return load_draft_model(target, str(folder), dtype, label=label or display_name(name))


def load_draft_model(target, name: str, dtype, label: str | None = None) -> DraftProvider:
    from verispec.models.loader import load_model
    from verispec.drafting.two_model import TwoModelProvider, check_same_tokenizer

    draft = load_model(name, dtype=dtype)
    try:
        check_same_tokenizer(target.tokenizer, draft.tokenizer, target.model.args.vocab_size, draft.model.args.vocab_size)
    except ValueError as e:
        raise UserError(f"--draft-model {name}: {e}") from None
    return TwoModelProvider(draft.model, max_draft=MAX_DRAFT_TOKENS, label=f"draft model {label or name}")


def engine_options(args) -> dict:
    """EngineConfig fields from the speculation flags."""
    options = {"adaptive_draft": not args.fixed_draft, "forced_drafts": not getattr(args, "no_forced_drafts", False)}
    if getattr(args, "verify_schedule", None):
        options["verify_schedule"] = args.verify_schedule
    threshold = getattr(args, "confidence_threshold", None)
    if threshold is not None and not 0 <= threshold < 1:
        raise UserError(f"--confidence-threshold must be in [0, 1), got {threshold}")
    if args.num_draft_tokens is not None:
        if not 1 <= args.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise UserError(f"--num-draft-tokens must be in 1..{MAX_DRAFT_TOKENS}, got {args.num_draft_tokens}")
        options["num_draft_tokens"] = args.num_draft_tokens
    return options
