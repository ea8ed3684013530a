"""The DSpark training loss (paper Eq 9-12 as DeepSpec codes them, dspark-spec.md §3.3).

Per supervised block slot (the eval mask: a contiguous prefix of each kept block whose
labels are in range and are answer tokens), with weight w_j = exp(-j / decay) (j from 0;
decay 4.0 in DeepSpec, not the paper's gamma):

    ce    = cross-entropy of the Markov-corrected draft logits at the label
    l1    = sum_v |p_d - p_t|            (p at temperature 1, float32; full L1, no 1/2)
    c*    = clamp(1 - l1 / 2, 0, 1)      (analytic acceptance; detached: a target only)
    bce   = BCE-with-logits(confidence logit, c*)

Each term is a weighted mean, sum(W * term) / (sum(W) + 1e-6), and the loss is
0.1 * CE + 0.9 * L1 + 1.0 * BCE. Under data parallelism the denominators are summed over
ranks first and the loss is multiplied by the world size, which cancels DDP's gradient
averaging: every rank then contributes sum(W * term) / global sum(W), so the gradient
is exactly the single-process gradient of the whole global batch.

With a draft vocabulary subset, p_d is zero outside it (its probability mass is what
the subset misses), labels outside it are not scored by CE, and l1 counts the target's
mass outside the subset in full.

Checked by tests/test_dspark.py against DeepSpec's own numbers on a fixed batch
(../shared/oracles/deepspec-tiny/loss_expected.json).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from verispec.training.dspark.forward import TrainOutput

CE_ALPHA, L1_ALPHA, CONF_ALPHA = 0.1, 0.9, 1.0
LOSS_DECAY = 4.0


@dataclass
class LossTerms:
    loss: torch.Tensor  # what to backpropagate (already scaled by world size)
    ce: float
    l1: float
    confidence: float
    total: float  # 0.1 CE + 0.9 L1 + 1.0 BCE with the local denominators
    weight_mask: torch.Tensor  # [B, A, gamma] eval mask x decay weight
    per_token: dict = field(default_factory=dict)  # ce, l1, c_star, bce: [B, A, gamma]
    accept_rate_by_position: list = field(default_factory=list)  # mean c* per slot (teacher-forced acceptance)
    tau_probabilistic: float = 0.0  # mean over supervised blocks of 1 + sum_j prod_{i<=j} c*_i


def weight_sums(eval_mask: torch.Tensor, target_ids: torch.Tensor, decay: float | None = LOSS_DECAY,
                draft_vocab_ids=None) -> dict:
    """The denominators a micro-batch contributes, from data alone (before any forward)."""
    w = eval_mask.float() * decay_weights(eval_mask.shape[-1], decay, eval_mask.device)
    ce = w
    if draft_vocab_ids is not None:
        ce = w * torch.isin(target_ids, draft_vocab_ids).float()
    return {"ce": float(ce.sum()), "other": float(w.sum())}


def decay_weights(block_size: int, decay: float | None = LOSS_DECAY, device=None) -> torch.Tensor:
    j = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.exp(-j / decay) if decay else torch.ones(block_size, device=device)


def dspark_loss(out: TrainOutput, *, ce_alpha: float = CE_ALPHA, l1_alpha: float = L1_ALPHA,
                conf_alpha: float = CONF_ALPHA, decay: float | None = LOSS_DECAY, draft_vocab_ids=None,
                denominators: dict | None = None, world_size: int = 1) -> LossTerms:
    """`denominators` = {"ce": ..., "other": ...}: the weight sums of the whole global batch
    (all micro-batches, all ranks; see `weight_sums`), so that every micro-batch's loss is
    its share of the global batch's weighted mean. Default: this micro-batch's own."""
    g = out.draft_logits.shape[2]
    weights = out.eval_mask.float() * decay_weights(g, decay, out.draft_logits.device)
    draft_logp = out.draft_logits.float().log_softmax(dim=-1)
    ce_weights = weights
    if draft_vocab_ids is None:
        ce = F.cross_entropy(draft_logp.flatten(0, 2), out.target_ids.flatten(), reduction="none").view_as(weights)
    else:
        ce, inside = _subset_cross_entropy(draft_logp, out.target_ids, draft_vocab_ids)
        ce_weights = weights * inside
    terms = {"ce": ce}
    c_star = None
    if out.aligned_target_logits is not None:
        target = out.aligned_target_logits.float()
        p_t = target.exp() if out.target_is_logprobs else target.softmax(dim=-1)
        p_d = draft_logp.exp()
        if draft_vocab_ids is None:
            l1 = (p_d - p_t).abs().sum(dim=-1)
        else:
            p_t_sub = p_t if p_t.shape[-1] == len(draft_vocab_ids) else p_t.index_select(-1, draft_vocab_ids)
            l1 = (p_d - p_t_sub).abs().sum(dim=-1) + (1.0 - p_t_sub.sum(dim=-1)).clamp_min(0)
        terms["l1"] = l1
        c_star = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
        terms["c_star"] = c_star
    if out.confidence_logits is not None:
        if c_star is None:
            raise ValueError("the confidence loss needs the target's logits (aligned_target_logits)")
        terms["bce"] = F.binary_cross_entropy_with_logits(out.confidence_logits.float(), c_star, reduction="none")

    dens = {"ce": ce_weights.sum().detach(), "other": weights.sum().detach()}
    dens = {k: (v, v if denominators is None else torch.as_tensor(denominators[k])) for k, v in dens.items()}
    parts = {"ce": (ce_alpha, "ce"), "l1": (l1_alpha, "l1"), "confidence": (conf_alpha, "bce")}
    loss = torch.zeros((), device=weights.device)
    local = {}
    for name, (alpha, key) in parts.items():
        if key not in terms:
            local[name] = 0.0
            continue
        w = ce_weights if key == "ce" else weights
        local_den, global_den = dens["ce" if key == "ce" else "other"]
        if alpha > 0:
            loss = loss + alpha * (terms[key] * w).sum() / (global_den + 1e-6)
        local[name] = float((terms[key].detach() * w).sum() / (local_den + 1e-6))
    total = sum(alpha * local[name] for name, (alpha, key) in parts.items() if key in terms)
    accept, tau = _acceptance_stats(c_star, out.eval_mask)
    return LossTerms(loss * world_size, local["ce"], local["l1"], local["confidence"], total, weights,
                     {k: v.detach() for k, v in terms.items()}, accept, tau)


def _subset_cross_entropy(draft_logp, target_ids, draft_vocab_ids):
    """(CE of labels inside the draft vocabulary, 0 elsewhere; the float mask of those labels)."""
    size = max(int(draft_vocab_ids.max()), int(target_ids.max())) + 1
    lookup = torch.full((size,), -1, dtype=torch.long, device=target_ids.device)
    lookup[draft_vocab_ids] = torch.arange(len(draft_vocab_ids), device=target_ids.device)
    index = lookup[target_ids]
    inside = (index >= 0).float()
    return -draft_logp.gather(-1, index.clamp_min(0)[..., None]).squeeze(-1) * inside, inside


def _acceptance_stats(c_star, eval_mask) -> tuple[list, float]:
    if c_star is None:
        return [], 0.0
    valid = eval_mask.float()
    per_pos = (c_star * valid).sum(dim=(0, 1)) / valid.sum(dim=(0, 1)).clamp_min(1)
    blocks = eval_mask.any(dim=-1)
    tau = ((c_star * valid).cumprod(dim=-1).sum(dim=-1) + 1.0)[blocks]
    return [round(float(x), 6) for x in per_pos], (float(tau.mean()) if blocks.any() else math.nan)
