"""The DSpark drafter shipped for gemma3-270m (src/verispec/drafters/gemma3-270m): it fits
the model and the 48 MB budget (its Markov embedding over the draft vocabulary), carries
calibrated confidences, is what `--speculate dspark` and `--speculate composite` use for
the model (its default stays n-gram lookup, which measured faster: README "Speculation by
default"), and changes no token. Oracle: plain greedy decoding of the same prompts, rows
joining a running batch, alone and inside the composite."""

from __future__ import annotations

import pytest
import torch

from verispec.drafting.composite import CompositeProvider
from verispec.drafting.dspark.source import DSparkProvider
from verispec.drafting.factory import BUNDLED_DRAFTERS, build_drafter, shipped_dspark
from verispec.drafting.ngram import NgramProvider
from tests.shipped_drafters import check_fits, staggered_greedy
from verispec.models.catalog import REGISTRY
from verispec.models.loader import load_model, read_config
from verispec.models.tokenizer import encode_user_text

pytestmark = pytest.mark.real_model
SHIPPED = BUNDLED_DRAFTERS["gemma3-270m"]
# completions, as its eval prompts are used for a base model; the second repeats itself, as gemma's greedy text does
PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]


@pytest.fixture(scope="module")
def gemma(gemma_folder):
    return load_model(str(gemma_folder), dtype=torch.float32)


def test_the_gemma3_drafter_fits_its_model_and_the_size_budget(gemma_folder):
    config = check_fits(SHIPPED, gemma_folder, "Gemma3DSparkModel", 48)
    assert config["markov_vocab"] == "draft" and config["draft_vocab_size"] < read_config(gemma_folder)["vocab_size"]
    assert isinstance(config["confidence_temperature"], list) and len(config["confidence_temperature"]) == \
        config["block_size"]  # STS-calibrated: the composite compares its confidences with the lookup's


def test_gemma3_serves_its_drafter_when_asked_and_the_measured_lookup_by_default(gemma):
    assert REGISTRY["gemma3-270m"].speculation == "ngram"
    assert isinstance(build_drafter(gemma, None, None, torch.float32), NgramProvider)
    assert isinstance(build_drafter(gemma, "dspark", None, torch.float32), DSparkProvider)
    composite = build_drafter(gemma, "composite", None, torch.float32)
    assert isinstance(composite, CompositeProvider)
    assert [type(p) for p in composite.providers] == [DSparkProvider, NgramProvider]
    assert build_drafter(gemma, None, None, torch.float32, no_draft=True) is None


def test_a_catalog_entry_may_name_the_composite_as_its_default(gemma, monkeypatch):
    """Where a drafter measures faster with the lookup than either alone, the catalog says
    "composite" and serving builds both with no flag."""
    import dataclasses

    monkeypatch.setitem(REGISTRY, "gemma3-270m", dataclasses.replace(REGISTRY["gemma3-270m"], speculation="composite"))
    default = build_drafter(gemma, None, None, torch.float32)
    assert isinstance(default, CompositeProvider)
    assert [type(p) for p in default.providers] == [DSparkProvider, NgramProvider]
    with pytest.raises(ValueError, match="not ngram, dspark, composite or None"):
        dataclasses.replace(REGISTRY["gemma3-270m"], speculation="draft-model")


def _run(loaded, drafter, limits):
    return staggered_greedy(loaded, drafter, [encode_user_text(loaded.tokenizer, p) for p in PROMPTS], limits)


def test_the_gemma3_drafter_changes_no_token_alone_or_in_the_composite(gemma):
    limits = [64, 72, 56]
    plain = [r.token_ids for r in _run(gemma, None, limits)]
    alone = _run(gemma, shipped_dspark(gemma, torch.float32), limits)
    assert [r.token_ids for r in alone] == plain
    assert sum(r.speculation["accepted"] for r in alone) > 0, "the drafter's proposals were accepted"
    composite = build_drafter(gemma, "composite", None, torch.float32)
    both = _run(gemma, composite, limits)
    assert [r.token_ids for r in both] == plain
    assert composite.asked[0] > 0 and composite.chosen[1] > 0
