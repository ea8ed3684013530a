"""The DSpark drafter's training view: every anchor block of a batch in one pass, and
the data-only pieces around it (which positions are anchors, what each slot is labelled).

The same layers and weights as decoding (drafting/dspark/model.py), seen the way
DeepSpec's trainer sees them: sequences with sampled anchor blocks and a dense boolean
mask (dropped blocks attend to nothing and get zero attention output, as DeepSpec's flex
and dense paths both do). Slot j of the block at anchor p predicts the token at p + j + 1,
and its target distribution is the target's next-token distribution at position p + j
(the alignment a silent off-by-one once broke: `block_labels` and the gather below).

Checked by tests/test_dspark.py (loss terms, masks, per-token values and logits against
DeepSpec's own `Qwen3DSparkModel.forward` on the fixture's batch) and
tests/test_dspark_families.py (for every family the training view's logits equal the
decoding view's on the same block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from verispec.drafting.dspark.model import DSparkDrafter


@dataclass
class TrainOutput:
    draft_logits: torch.Tensor  # [B, A, gamma, V_draft] Markov-corrected, teacher forced
    target_ids: torch.Tensor  # [B, A, gamma]
    eval_mask: torch.Tensor  # [B, A, gamma] bool: the supervised prefix of each block
    block_keep_mask: torch.Tensor  # [B, A]
    confidence_logits: torch.Tensor | None  # [B, A, gamma]
    aligned_target_logits: torch.Tensor | None  # [B, A, gamma, V] target at anchor + j
    target_is_logprobs: bool = False  # aligned_target_logits already normalized (target_lse given)


def train_forward(
    drafter: DSparkDrafter,
    input_ids: torch.Tensor,
    target_hidden: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_keep_mask: torch.Tensor,
    target_last_hidden: torch.Tensor | None = None,
    target_head: nn.Module | None = None,
    target_lse: torch.Tensor | None = None,
) -> TrainOutput:
    """All anchor blocks of a batch in one pass. `target_head` turns the target's
    final hidden states into logits (default: this drafter's lm_head, which for a
    full-vocabulary drafter is the target's own frozen copy). With `target_lse`
    ([B, S], the logsumexp of the target's full logits) they become log-probabilities,
    exact even when the head covers only a draft-vocabulary subset."""
    B, S = input_ids.shape
    A, g = anchors.shape[1], drafter.block_size
    device = input_ids.device
    keep = block_keep_mask.bool()
    anchor_tokens = input_ids.gather(1, anchors)
    noise = torch.full((B, A, g), drafter.config.mask_token_id, dtype=torch.long, device=device)
    noise[:, :, 0] = torch.where(keep, anchor_tokens, torch.full_like(anchor_tokens, drafter.config.mask_token_id))
    x = drafter.embed_block(noise.view(B, A * g))
    ctx = drafter.context(target_hidden.to(x.dtype))
    ctx_rope = drafter.rope(torch.arange(S, device=device))
    blk_pos = (anchors[:, :, None] + torch.arange(g, device=device)).view(B, A * g)
    blk_rope = tuple(t.view(B, A * g, 1, -1) for t in drafter.rope(blk_pos.reshape(-1)))
    mask, visible = _train_mask(drafter, anchors, keep, S)
    for layer in drafter.layers:
        u = layer.input_layernorm(x)
        attn = layer.self_attn
        k_ctx, v_ctx = attn.keys_values(ctx, ctx_rope)
        k_blk, v_blk = attn.keys_values(u, blk_rope)
        out = attn.attend(attn.queries(u, blk_rope), torch.cat([k_ctx, k_blk], 1), torch.cat([v_ctx, v_blk], 1), mask)
        x = layer.finish(x, out * visible)
    h = drafter.norm(x).view(B, A, g, -1)

    target_ids, eval_mask, safe = block_labels(input_ids, loss_mask, anchors, keep, g)
    prev_ids = torch.cat([anchor_tokens[:, :, None], target_ids[:, :, :-1]], dim=-1)

    logits = drafter.base_logits(h)
    confidence = None
    if drafter.markov_head is not None:
        prev_emb = drafter.markov_embedding(prev_ids)
        logits = logits + drafter.markov_head.block_bias(prev_emb, h)
        confidence = drafter.confidence(h, prev_emb)
    else:
        confidence = drafter.confidence(h, None)

    aligned = None
    if target_last_hidden is not None:
        idx = (safe - 1).clamp(min=0).view(B, -1, 1).expand(-1, -1, target_last_hidden.shape[-1])
        aligned_hidden = target_last_hidden.gather(1, idx).view(B, A, g, -1).to(h.dtype)
        head = target_head if target_head is not None else drafter.lm_head
        aligned = head(aligned_hidden)
        cap = drafter.config.args.final_logit_softcap
        if cap:
            aligned = torch.tanh(aligned / cap) * cap
        if target_lse is not None:
            lse = target_lse.gather(1, (safe - 1).clamp(min=0).view(B, -1)).view(B, A, g, 1)
            aligned = aligned.float() - lse.float()
    return TrainOutput(logits, target_ids, eval_mask, keep, confidence, aligned, target_lse is not None)

def _train_mask(drafter: DSparkDrafter, anchors: torch.Tensor, keep: torch.Tensor, S: int):
    """[B, 1, A*g, S + A*g] bool: context strictly before the anchor, the own block.
    Dropped blocks see their own block (to keep the softmax finite) and their output
    is zeroed by `visible` ([B, A*g, 1]), which is what an all-masked row gives."""
    B, A = anchors.shape
    g, device = drafter.block_size, anchors.device
    block_of_query = torch.arange(A * g, device=device) // g
    ctx_ok = torch.arange(S, device=device)[None, None, :] < anchors.repeat_interleave(g, dim=1)[:, :, None]
    ctx_ok = ctx_ok & keep.repeat_interleave(g, dim=1)[:, :, None]
    same_block = block_of_query[:, None] == block_of_query[None, :]
    mask = torch.cat([ctx_ok, same_block.expand(B, -1, -1)], dim=-1)[:, None]
    visible = keep.repeat_interleave(g, dim=1)[:, :, None].to(drafter.dtype)
    return mask, visible


def block_labels(input_ids, loss_mask, anchors, keep, block_size: int):
    """(target ids, eval mask, clamped label index), each [B, A, gamma], from data alone: slot j
    of the block at anchor p is labelled with the token at p + j + 1 and supervised while the
    labels are in range and answer tokens (a contiguous prefix: the cumulative product)."""
    B, S = input_ids.shape
    A = anchors.shape[1]
    labels = anchors[:, :, None] + torch.arange(1, block_size + 1, device=anchors.device)
    safe = torch.where(keep[:, :, None], labels.clamp(max=S - 1), torch.zeros_like(labels))
    target_ids = input_ids.gather(1, safe.view(B, -1)).view(B, A, block_size)
    eval_mask = (labels < S) & (loss_mask.gather(1, safe.view(B, -1)).view(B, A, block_size) > 0.5) & keep[:, :, None]
    return target_ids, eval_mask.int().cumprod(dim=-1).bool(), safe


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Every position i with loss_mask[i] and loss_mask[i + 1] (the anchor and its first
    label are answer tokens), ascending."""
    return ((loss_mask[:-1] > 0.5) & (loss_mask[1:] > 0.5)).nonzero().flatten()


def sample_anchors(loss_mask: torch.Tensor, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSpec's sampler for one sequence: up to `count` distinct `anchor_candidates`,
    uniformly without replacement, sorted; the unused slots are 0 and not kept."""
    candidates = anchor_candidates(loss_mask)
    chosen = candidates[torch.randperm(len(candidates), generator=generator)[:count]].sort().values
    anchors = torch.zeros(count, dtype=torch.long)
    keep = torch.zeros(count, dtype=torch.bool)
    anchors[: len(chosen)] = chosen
    keep[: len(chosen)] = True
    return anchors, keep


class TrainingView(nn.Module):
    """The drafter under `train_forward`, as one module (what DistributedDataParallel
    wraps); its parameters are the drafter's own, so checkpoints save the drafter."""

    def __init__(self, drafter: DSparkDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, *args, **kwargs) -> TrainOutput:
        return train_forward(self.drafter, *args, **kwargs)
