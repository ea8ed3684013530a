"""The DSpark drafter shipped for the embedded default model (src/verispec/drafters/):
it fits the model it was trained for, fits the size budget, carries calibrated
thresholds, is what `--speculate dspark` uses (the default model's default speculation is
the measured faster n-gram lookup), and changes no token: greedy outputs, batched with
joins, equal plain decoding in float32."""

from __future__ import annotations

import pytest
import torch

from verispec.cli import main
from tests.shipped_drafters import check_fits, staggered_greedy
from verispec.models.loader import load_model
from verispec.models.tokenizer import encode_chat
from verispec.drafting.factory import BUNDLED_DRAFTERS, build_drafter, shipped_dspark
from verispec.models.catalog import REGISTRY

pytestmark = pytest.mark.real_model
SHIPPED = BUNDLED_DRAFTERS["smollm2-135m-instruct"]
PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_folder):
    return load_model(str(smollm2_folder), dtype=torch.float32)


def test_the_shipped_drafter_fits_its_model_and_the_size_budget(smollm2_folder):
    config = check_fits(SHIPPED, smollm2_folder, "LlamaDSparkModel", 32)
    # calibrate wrote one threshold per draft position
    assert isinstance(config["confidence_threshold"], list) and len(config["confidence_threshold"]) == config["block_size"]


def test_the_default_speculation_is_the_measured_choice_and_no_draft_turns_it_off(smollm2):
    """With no flag the default model speculates as its catalog entry says (n-gram: it measured
    faster than the shipped drafter, README "Speculation by default"); `--speculate dspark`
    still gives the shipped drafter."""
    from verispec.drafting.dspark.source import DSparkProvider
    from verispec.drafting.ngram import NgramProvider

    assert REGISTRY["smollm2-135m-instruct"].speculation == "ngram"
    assert isinstance(build_drafter(smollm2, None, None, torch.float32), NgramProvider)
    assert build_drafter(smollm2, None, None, torch.float32, no_draft=True) is None
    assert isinstance(build_drafter(smollm2, "dspark", None, torch.float32), DSparkProvider)
    assert isinstance(shipped_dspark(smollm2, torch.float32), DSparkProvider)


def _run(loaded, drafter, limits):
    prompts = [encode_chat(loaded.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    return staggered_greedy(loaded, drafter, prompts, limits)


def test_the_shipped_drafter_changes_no_token(smollm2):
    limits = [80, 96, 64]
    plain = _run(smollm2, None, limits)
    spec = _run(smollm2, shipped_dspark(smollm2, torch.float32), limits)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert sum(r.speculation["accepted"] for r in spec) > 0, "the drafter's proposals were accepted"


def test_generate_speculates_by_default_and_with_the_shipped_drafter_unless_told_no_draft(smollm2_folder, capsys):
    args = ["generate", "-m", "smollm2-135m-instruct", "--max-tokens", "48", "--temperature", "0", "--dtype", "float32",
            PROMPTS[0]]
    outs = {}
    for name, extra in (("default", []), ("dspark", ["--speculate", "dspark"]), ("plain", ["--no-draft"])):
        assert main([*args[:-1], *extra, args[-1]]) == 0
        outs[name] = capsys.readouterr()
    assert "spec:" in outs["default"].err and "spec:" in outs["dspark"].err and "spec:" not in outs["plain"].err
    assert outs["default"].out == outs["dspark"].out == outs["plain"].out


def test_seeded_sampling_with_it_gives_plain_decodings_tokens(smollm2_folder, capsys):
    """Seeded rows verify by matching: the same tokens as plain seeded sampling, run after run."""
    args = ["generate", "-m", "smollm2-135m-instruct", "--max-tokens", "48", "-t", "0.9", "--seed", "7",
            "--dtype", "float32", "--quiet-stats", PROMPTS[1]]
    outs = []
    for extra in ([], ["--no-draft"], []):
        assert main([*args[:-1], *extra, args[-1]]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2] and outs[0].strip()
