"""The embedded default models against transformers (the oracle) on the same weights.

The reference is transformers loading the original GGUF itself (its own dequantizer and
its own modeling code, float32, eager attention). Ours is the registry's converted folder
(our dequantizer, our loader, our decoder). Greedy tokens must be identical: SmolLM2 for
128 tokens on 3 chat prompts, Gemma-3-270M for 64 tokens on 3 prompts, one longer than
its 512-token sliding window (so the ring wraps during prefill and decode). Our three
prompts run as one batch (rows of different lengths), the reference one by one.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import extend_logits, reference_greedy
from verispec.engine.generate import greedy_batch
from verispec.models.loader import load_model
from verispec.models.tokenizer import encode_chat, encode_prompt

pytestmark = pytest.mark.real_model

SMOL_PROMPTS = [
    "Write a detailed, step-by-step explanation of how a bicycle works.",
    "List ten fun facts about octopuses, with a sentence on each.",
    "Write a short story about a robot who learns to paint.",
]

_LONG_TEXT = (
    "The history of the printing press begins long before Gutenberg. Woodblock printing "
    "spread across East Asia for centuries, and movable type made of ceramic, wood and "
    "metal appeared in China and Korea. In Europe, the combination of a screw press, "
    "oil-based ink, and a hand mould for casting metal type made printing fast and cheap. "
    "Books that had taken months to copy by hand could now be produced by the hundred. "
)
GEMMA_PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    " ".join(f"Chapter {i}. {_LONG_TEXT}" for i in range(1, 8)) + "\nIn summary, the printing press",
]


def _reference(gguf_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _reference_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def smol(smollm2_folder, smollm2_gguf):
    return load_model(str(smollm2_folder), progress=False), smollm2_gguf


@pytest.fixture(scope="module")
def gemma(gemma_folder, gemma_gguf):
    return load_model(str(gemma_folder), progress=False), gemma_gguf


def test_smollm2_chat_prompt_tokens_match_transformers(smol):
    loaded, gguf_path = smol
    ref_tok = _reference_tokenizer(gguf_path)
    for prompt in SMOL_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ours = encode_chat(loaded.tokenizer, messages)
        expected = ref_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
        assert ours == list(expected)
        bos = loaded.tokenizer.bos_token_id
        assert bos is None or ours[:2] != [bos, bos], "BOS doubled: template text already carries it"


def test_smollm2_greedy_128_tokens_match_transformers(smol):
    loaded, gguf_path = smol
    reference = _reference(gguf_path)
    prompts = [encode_chat(loaded.tokenizer, [{"role": "user", "content": p}]) for p in SMOL_PROMPTS]
    ours = greedy_batch(loaded.model, prompts, 128)
    for prompt, got in zip(prompts, ours):
        assert got == reference_greedy(reference, prompt, 128)


def test_gemma3_greedy_64_tokens_match_transformers_across_sliding_window(gemma):
    loaded, gguf_path = gemma
    reference = _reference(gguf_path)
    prompts = [encode_prompt(loaded.tokenizer, p) for p in GEMMA_PROMPTS]
    window = max(w for w in loaded.model.args.layer_windows if w)
    assert len(prompts[2]) > window, "test premise: one prompt is longer than the sliding window"
    ours = greedy_batch(loaded.model, prompts, 64)
    for prompt, got in zip(prompts, ours):
        assert got == reference_greedy(reference, prompt, 64)


def test_gemma3_long_prompt_logits_match_transformers(gemma):
    """Teacher-forced float32 logits at every position of the long prompt, prefilled in
    chunks so the sliding ring wraps between chunks."""
    from verispec.models.kv_cache import KVCache

    loaded, gguf_path = gemma
    reference = _reference(gguf_path)
    ids = encode_prompt(loaded.tokenizer, GEMMA_PROMPTS[2])
    seq = KVCache(loaded.model.args).allocate(len(ids))
    got = []
    for start in range(0, len(ids), 200):
        got.append(extend_logits(loaded.model, seq, ids[start : start + 200]))
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(torch.cat(got), expected, rtol=1e-3, atol=2e-3)
