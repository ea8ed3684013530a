"""The DeepSpec oracle's tiny Qwen3 target (a real HF folder: bf16 safetensors, a
word-level tokenizer, transformers 5.x config spelling) loads through our loader and
decodes like transformers. Read-only from tests/fixtures/deepspec-tiny (a copy of ../shared/oracles/deepspec-tiny); the DSpark
drafter side of that fixture belongs to the DSpark issue."""

from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures import oracle
from tests.tiny_models import reference_greedy
from verispec.engine.generate import greedy_batch
from verispec.models.loader import load_model

FIXTURE = oracle()


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        str(FIXTURE / "target"), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompts = [json.loads(line)["prompt_ids"] for line in (FIXTURE / "prompts.jsonl").read_text().splitlines()]
    return load_model(str(FIXTURE / "target"), dtype=torch.float32, progress=False), reference, prompts


def test_config_and_stop_ids(target):
    loaded, _, _ = target
    args = loaded.model.args
    assert (args.model_type, args.num_layers, args.qk_norm, args.tie_word_embeddings) == ("qwen3", 6, True, False)
    assert args.rope_global.theta == 1e6
    assert loaded.stop_ids == [0]


def test_greedy_matches_transformers_on_fixture_prompts(target):
    loaded, reference, prompts = target
    prompts = prompts[:6]
    for prompt, got in zip(prompts, greedy_batch(loaded.model, prompts, 32)):
        assert got == reference_greedy(reference, prompt, 32)
