"""Hugging Face Hub repos as model folders: safetensors and tokenizer files only.

``hub_snapshot`` downloads a repo with ``huggingface_hub.snapshot_download`` restricted to
config, safetensors, tokenizer and template files, so pickled ``.bin``/``.pt`` weights are
never fetched, and turns every failure into one ModelNotFoundError line that says why
(gated, missing, offline, ...). tests/test_registry.py checks it with a monkeypatched
``snapshot_download``: the allow patterns, the refusal of a repo without safetensors, and
the offline and not-found messages.
"""

from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from verispec.models.catalog import did_you_mean, registry_hint
from verispec.models.registry_errors import ModelNotFoundError

__all__ = ["hub_snapshot"]


def hub_snapshot(repo_id: str, progress: bool) -> Path:
    """Download a Hub repo's config, safetensors and tokenizer files; return the snapshot folder."""
    import huggingface_hub

    kwargs = {} if progress else {"tqdm_class": _SilentTqdm}
    try:
        folder = Path(huggingface_hub.snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt"],
            **kwargs))
    except Exception as e:  # any failure becomes one line; the full chain is not useful here
        raise ModelNotFoundError(
            f"cannot resolve model {repo_id!r}: not a registry name{did_you_mean(repo_id)} "
            f"({registry_hint()}); not a local path; "
            f"Hugging Face Hub download failed: {_describe_hub_error(e)}") from None
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"Hub repo {repo_id} has no config.json (not a transformers model)")
    if not any(folder.glob("*.safetensors")):
        raise ModelNotFoundError(f"Hub repo {repo_id} has no .safetensors weights "
                                 "(verispec never downloads pickled .bin/.pt weights)")
    return folder


class _SilentTqdm(tqdm):
    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _describe_hub_error(e: Exception) -> str:
    from huggingface_hub import errors

    first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if isinstance(e, errors.GatedRepoError):
        return "the repo is gated: accept its terms on huggingface.co and log in (hf auth login)"
    if isinstance(e, errors.RepositoryNotFoundError):
        return "no such repo (or it is private and you are not logged in)"
    if isinstance(e, errors.RevisionNotFoundError):
        return "no such revision"
    if isinstance(e, errors.OfflineModeIsEnabled):
        return "offline mode is enabled (HF_HUB_OFFLINE) and the repo is not in the local Hub cache"
    if isinstance(e, errors.LocalEntryNotFoundError):
        detail = first_line.removeprefix("Got: ")
        return f"no connection to the Hub and no cached copy ({detail})"
    if isinstance(e, errors.HFValidationError):
        return "not a valid Hub repo id"
    return f"{type(e).__name__}: {first_line}"
