"""The Gemma 4 assistant drafter (drafting/gemma4_assistant.py) against transformers' own assisted
generation with the same tiny random target + assistant pair: the same drafts round for round and
the same output; and greedy output equal to plain decoding with rows batched together.

The target's sliding window is wider than the sequences here: past it transformers' sliding
states mix in rejected drafts (a documented deviation); the assistant's own window is small, so
its sliding layers still see only their last window + 1 positions.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation import candidate_generator as hf_candidates

from tests.tiny_models import GEMMA4_PAIRS, GEMMA4_VOCAB as VOCAB, CharTokenizer, build_gemma4_pair, \
    gemma4_target_config as target_config, reference_greedy, \
    track_sources
from verispec.drafting.gemma4_assistant import AssistantMismatchError, AssistantProvider, Gemma4Assistant
from verispec.engine.engine import Engine, EngineConfig
from verispec.engine.request import Collector, GenerationRequest
from verispec.models.loader import load_folder

DRAFTS = 4
NEW = 28


@pytest.fixture(scope="module", params=GEMMA4_PAIRS)
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4-assistant")
    target, assistant = build_gemma4_pair(folder, request.param, drafts=DRAFTS)
    return target, assistant, load_folder(folder / "target"), folder / "assistant"


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(5, VOCAB, (n,), generator=g).tolist() for n in (9, 21, 14)]


def _hf_assisted(target, assistant, prompt: list[int], monkeypatch) -> tuple[list[int], dict[int, list[int]]]:
    """transformers' assisted generation: output tokens and {current length: drafts} per round."""
    rounds = {}
    original = hf_candidates.SinglePositionMultiTokenCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        candidates, logits = original(self, input_ids, *args, **kwargs)
        if candidates.shape[1] > input_ids.shape[1]:
            rounds[input_ids.shape[1]] = candidates[0, input_ids.shape[1]:].tolist()
        return candidates, logits

    monkeypatch.setattr(hf_candidates.SinglePositionMultiTokenCandidateGenerator, "get_candidates", recording)
    out = target.generate(torch.tensor([prompt]), assistant_model=assistant, max_new_tokens=NEW, do_sample=False,
                          eos_token_id=1, pad_token_id=0)
    generated = out[0, len(prompt):].tolist()
    return (generated[: generated.index(1)] if 1 in generated else generated), rounds


def _ours(ours, folder, prompts, stagger: bool) -> tuple[list[list[int]], dict]:
    provider = AssistantProvider(Gemma4Assistant(folder, ours, torch.float32))
    provider.trace = []
    owner = track_sources(provider)
    engine = Engine(ours, CharTokenizer(), (1,), EngineConfig(kv_budget=2**28, num_draft_tokens=DRAFTS,
                                                              adaptive_draft=False), drafter=provider)
    collectors = []
    for i, prompt in enumerate(prompts):
        collectors.append(Collector())
        engine.submit(GenerationRequest(prompt, NEW), collectors[-1])
        if stagger:
            engine.step()
    engine.run_until_idle()
    rounds: dict[tuple, dict[int, list[int]]] = {}
    for record in provider.trace:
        # our trace's length is the target cache's (the tokens with K/V); transformers' the committed tokens
        rounds.setdefault(owner[record["source"]], {})[record["length"] + 1] = record["tokens"]
    return [c.result(0).token_ids for c in collectors], rounds


def test_drafts_and_output_match_transformers_assisted_generation(pair, monkeypatch):
    target, assistant, ours, folder = pair
    for prompt in _prompts():
        expected, hf_rounds = _hf_assisted(target, assistant, prompt, monkeypatch)
        (got,), our_rounds = _ours(ours, folder, [prompt], stagger=False)
        assert got == expected
        mine = our_rounds[tuple(prompt)]
        full = {length: drafts for length, drafts in hf_rounds.items() if len(drafts) == DRAFTS}
        assert len(full) >= 3, "several full rounds were compared"
        for length, drafts in full.items():
            assert mine.get(length) == drafts, (prompt, length)
        kept = [next((j for j in range(DRAFTS) if drafts[j] != expected[length - len(prompt) + j]), DRAFTS)
                if length - len(prompt) + DRAFTS <= len(expected) else None for length, drafts in full.items()]
        print(f"prompt of {len(prompt)}: {len(full)} rounds, drafts kept per round {kept}")


def test_batched_rows_decode_like_plain_greedy(pair):
    target, _, ours, folder = pair
    prompts = _prompts()
    outputs, rounds = _ours(ours, folder, prompts, stagger=True)
    for prompt, got in zip(prompts, outputs):
        assert got == reference_greedy(target, prompt, NEW, stop_ids=(1,))
        assert rounds[tuple(prompt)], "the row drafted"


def test_a_mismatched_pair_is_refused_with_a_reason(pair, tmp_path):
    _, assistant, _, folder = pair
    narrow = AutoModelForCausalLM.from_config(target_config(global_head_dim=64)).eval()
    narrow.save_pretrained(tmp_path / "other")
    with pytest.raises(AssistantMismatchError, match="cannot attend"):
        Gemma4Assistant(folder, load_folder(tmp_path / "other"), torch.float32)
    wider = AutoModelForCausalLM.from_config(target_config(hidden_size=128)).eval()
    wider.save_pretrained(tmp_path / "wider")
    with pytest.raises(AssistantMismatchError, match="hidden size 64"):
        Gemma4Assistant(folder, load_folder(tmp_path / "wider"), torch.float32)
