"""DSpark drafters for every target family we serve (llama, qwen2, qwen3, gemma3), built
the way DeepSpec builds its Qwen3 drafter: the target's config with the DSpark fields.

Oracles: the training view (all anchor blocks at once under a dense mask) and the decoding
view (an incremental context cache, one block per round) are two computations of the same
function, so for every family they must agree; greedy speculation with an untrained
drafter must give transformers' own greedy tokens; the RNN head must follow the paper's
Eq 6 as written out here independently; DFlash (no sequential head) drafts every slot from
its base logits alone.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import CharTokenizer, build_reference, family_configs, reference_greedy
from verispec.engine.engine import Engine, EngineConfig
from verispec.engine.request import GenerationRequest
from verispec.models.decoder import BatchKV
from verispec.models.loader import load_folder, read_config
from verispec.drafting.dspark.config import DSparkConfig
from verispec.drafting.dspark.model import DSparkDrafter
from verispec.drafting.dspark.source import DSparkProvider
from verispec.training.dspark.forward import train_forward

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3", "gemma4"]


def make_drafter(target_config: dict, head="vanilla", rank=8, seed=0, draft_layers=2, prepare=True,
                 **overrides) -> DSparkDrafter:
    layers = target_config["num_hidden_layers"]
    config = DSparkConfig.from_target(
        target_config, num_draft_layers=draft_layers, block_size=4, target_layer_ids=[-1, 0, layers - 2],
        mask_token_id=target_config["vocab_size"] - 1, markov_rank=rank, markov_head_type=head,
        enable_confidence_head=rank > 0, confidence_head_with_markov=rank > 0, num_anchors=8, **overrides)
    torch.manual_seed(seed)
    drafter = DSparkDrafter(config)
    with torch.no_grad():  # norm weights away from their init, so the (1 + w) convention matters
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return drafter.prepare_for_inference() if prepare else drafter


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = build_reference(family_configs()[request.param], folder)
    return request.param, reference, load_folder(folder), read_config(folder)


def test_training_and_decoding_views_agree(family):
    name, _, target, config = family
    drafter = make_drafter(config, head="rnn")
    g = drafter.block_size
    S = 20
    ids = torch.randint(0, 90, (1, S), generator=torch.Generator().manual_seed(1))
    seq = target.new_cache().allocate(S)
    features = torch.cat(target(ids[0], BatchKV([seq], [S]),
                                taps=drafter.config.target_layer_ids).hidden, dim=-1)
    anchors = torch.tensor([[3, 9, 14]])
    out = train_forward(drafter, ids, features[None], torch.ones(1, S), anchors, torch.ones(1, 3, dtype=torch.bool))
    for a, anchor in enumerate(anchors[0].tolist()):
        cache = drafter.new_cache(S + g)
        split = anchor // 2  # the context arrives in two rounds, as it does while decoding
        drafter.draft_hidden([cache], [features[:split]], [int(ids[0, anchor])])
        cache_after_first = cache.length
        h = drafter.draft_hidden([cache], [features[split:anchor]], [int(ids[0, anchor])])
        assert cache_after_first == split and cache.length == anchor
        # teacher-forced slot logits of the training view = the decoding view fed the same tokens
        forced = iter(out.target_ids[0, a].tolist())
        logits = []

        def teacher(slot, step_logits):
            logits.append(step_logits[0])
            return torch.tensor([next(forced)])

        _, confidence = drafter.propose(h, [int(ids[0, anchor])], teacher)
        torch.testing.assert_close(torch.stack(logits), out.draft_logits[0, a], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(confidence[0], out.confidence_logits[0, a], atol=2e-4, rtol=1e-4)


def test_a_deepened_drafter_computes_what_it_was_deepened_from(family):
    """`train --init-from D --layers N` (training/dspark/train.py deepen): D's layers, then copies
    of its last with zeroed residual branches. Oracle: D itself, in the training view (slot
    logits and confidences at every anchor) and the decoding view (the backbone's block hidden
    states); and the new layers are not inert, since their copied weights are D's."""
    from verispec.training.dspark.train import deepen

    name, _, target, config = family
    drafter = make_drafter(config, head="rnn", draft_layers=1, prepare=False)
    deep = deepen(drafter, 3)
    assert len(deep.layers) == 3 and deep.config.args.num_layers == 3 and deep.config.raw["num_hidden_layers"] == 3
    torch.testing.assert_close(deep.layers[2].mlp.gate_proj.weight, drafter.layers[0].mlp.gate_proj.weight)
    S = 20
    ids = torch.randint(0, 90, (1, S), generator=torch.Generator().manual_seed(2))
    seq = target.new_cache().allocate(S)
    features = torch.cat(target(ids[0], BatchKV([seq], [S]), taps=drafter.config.target_layer_ids).hidden, dim=-1)
    anchors = torch.tensor([[3, 9, 14]])
    views = [train_forward(d, ids, features[None], torch.ones(1, S), anchors, torch.ones(1, 3, dtype=torch.bool))
             for d in (drafter, deep)]
    torch.testing.assert_close(views[1].draft_logits, views[0].draft_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(views[1].confidence_logits, views[0].confidence_logits, atol=1e-5, rtol=1e-5)
    hidden = [d.draft_hidden([d.new_cache(S + drafter.block_size)], [features[:14]], [int(ids[0, 14])])
              for d in (drafter, deep)]
    torch.testing.assert_close(hidden[1], hidden[0], atol=1e-5, rtol=1e-5)
    # a step of training moves the new layers' zeroed branches off zero (their gradient is not zero)
    out = train_forward(deep, ids, features[None], torch.ones(1, S), anchors, torch.ones(1, 3, dtype=torch.bool))
    out.draft_logits.square().mean().backward()
    layer = deep.layers[2]
    zeroed = ([layer.post_attention_layernorm.weight, layer.post_feedforward_layernorm.weight] if layer.sandwich
              else [layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight])
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in zeroed)


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn", "dflash"])
def test_greedy_speculation_with_an_untrained_drafter_is_lossless(family, head):
    name, reference, target, config = family
    drafter = make_drafter(config, head="vanilla" if head == "dflash" else head, rank=0 if head == "dflash" else 8)
    provider = DSparkProvider(drafter)
    engine = Engine(target, CharTokenizer(), (), EngineConfig(kv_budget=2**30, num_draft_tokens=4, adaptive_draft=False),
                    drafter=provider)
    prompts = [torch.randint(0, 90, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 11, 17)]
    for prompt in prompts:
        result = engine.generate(GenerationRequest(prompt, 16))
        assert result.token_ids == reference_greedy(reference, prompt, 16)
    assert engine.drafting.totals.drafted > 0


def test_rnn_head_follows_eq6():
    """s' = sigmoid(Wg z) * s + (1 - sigmoid(Wg z)) * tanh(Wc z), bias = W2 tanh(Wo z) with
    z = [s; W1[x_prev]; h] (the OLD state), one joint projection split gate|candidate|output."""
    from verispec.drafting.dspark.heads import RNNHead

    torch.manual_seed(0)
    head = RNNHead(vocab_size=11, rank=4, out_size=11, hidden_size=6)
    h = torch.randn(5, 6)
    prev = torch.tensor([1, 2, 3, 4, 5])
    state = torch.randn(5, 4)
    W = head.joint_proj.weight
    b = head.joint_proj.bias
    z = torch.cat([state, head.markov_w1.weight[prev], h], dim=-1)
    Wg, Wc, Wo = W[:4], W[4:8], W[8:]
    bg, bc, bo = b[:4], b[4:8], b[8:]
    gate = torch.sigmoid(z @ Wg.T + bg)
    expected_state = gate * state + (1 - gate) * torch.tanh(z @ Wc.T + bc)
    expected_bias = torch.tanh(z @ Wo.T + bo) @ head.markov_w2.weight.T
    bias, new_state = head.step(head.prev_embedding(prev), h, state)
    torch.testing.assert_close(new_state, expected_state)
    torch.testing.assert_close(bias, expected_bias)


def test_dflash_drafts_each_slot_from_its_base_logits(family):
    _, _, target, config = family
    drafter = make_drafter(config, rank=0)
    assert drafter.markov_head is None and drafter.confidence_head is None
    cache = drafter.new_cache(32)
    features = torch.randn(6, drafter.fc.in_features)
    h = drafter.draft_hidden([cache], [features], [7])
    tokens, confidence = drafter.propose(h, [7], lambda slot, logits: logits.argmax(dim=-1))
    assert confidence is None
    assert tokens[0].tolist() == drafter.base_logits(h)[0].argmax(dim=-1).tolist()
