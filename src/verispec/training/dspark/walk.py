"""Teacher-forced tau the way live decoding spends rounds: the renewal walk.

Validation's tau (`loss.tau_probabilistic`) averages a block's acceptance over anchors drawn
uniformly from the answer. Live decoding does not visit anchors uniformly: a round drafts at
the last committed token, and the next round starts right after what it kept. An easy
stretch of L tokens holds L uniform anchors but costs live decoding about L / (gamma + 1)
rounds, and a hard stretch costs a round per token either way, so the uniform mean weighs
easy stretches more than live decoding does and reads high. Measured on gemma3-270m (stage
33 of docs/dspark-campaign.md): on 44 greedy answers of held-out prompts the uniform mean of
the greedy match read 2.23, this walk 1.89, and live T=0 decoding of those prompts 1.89.

`walk_tau` takes every anchor of one answer segment (a block at each position) and returns
the expected tokens per round of a walk that starts at the segment's first token and, at
anchor p, keeps a drafts with probability prod_{k<a} c_k (1 - c_a) (all gamma: prod c_k) and
moves to p + a + 1, the bonus token included. With c the analytic acceptance c* that is
the T=1 expectation; with 0/1 matches it is the deterministic T=0 walk. Expected rounds come
from one backward pass, R(p) = 1 + sum_a P(a | p) R(p + a + 1), R(end) = 0.

Checked by tests/test_dspark_walk.py (against a Monte Carlo of the live loop, a statistical
test, and the T=0 walk followed by hand) and tests/test_dspark_train.py (train's walked greedy
tau of a trained tiny drafter on its target's greedy answers against live T=0 decoding of the
same prompts with full blocks: 2.0957 against 2.0956 when written).
"""

from __future__ import annotations

import torch

from verispec.training.dspark.forward import anchor_candidates


def answer_segments(loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)) of each run of answer positions (loss_mask > 0.5) at least 2 long."""
    m = (loss_mask > 0.5).tolist()
    segments, start = [], None
    for i, on in enumerate(m + [False]):
        if on and start is None:
            start = i
        elif not on and start is not None:
            if i - start >= 2:
                segments.append((start, i))
            start = None
    return segments


def walk_rounds(accept: torch.Tensor, start: int, end: int) -> float:
    """Expected rounds to produce positions start+1 .. end-1 when `accept[p - start]` ([gamma])
    holds the conditional acceptance of each slot of the block drafted at anchor p, for p in
    [start, end - 1) (slots whose label is past end - 1 must be 0)."""
    n = end - start  # anchors start..end-2 are accept's rows 0..n-2; R at end - 1 is 0
    gamma = accept.shape[-1]
    c = accept.double()
    keep_first = torch.cumprod(torch.cat([torch.ones(n - 1, 1, dtype=c.dtype), c], dim=1), dim=1)  # P(a >= j)
    p_exact = keep_first[:, :-1] * (1 - c)  # P(a = j), j < gamma
    p_exact = torch.cat([p_exact, keep_first[:, -1:]], dim=1).tolist()  # P(a = gamma) last
    rounds = [0.0] * n
    for row in range(n - 2, -1, -1):
        total = 1.0
        for a in range(gamma + 1):
            p = p_exact[row][a]
            if p:
                total += p * rounds[min(row + a + 1, n - 1)]
        rounds[row] = total
    return rounds[0]


def walk_tau(accept_by_anchor: torch.Tensor, anchors: torch.Tensor, loss_mask: torch.Tensor) -> tuple[float, float]:
    """(tokens, expected rounds) of the walk over every answer segment of one sequence.
    `accept_by_anchor` [A, gamma] (0 on unsupervised slots) belongs to `anchors` [A], which
    must hold every position p with loss_mask[p] and loss_mask[p + 1]."""
    row_of = {int(p): i for i, p in enumerate(anchors.tolist())}
    tokens = rounds = 0.0
    for start, end in answer_segments(loss_mask):
        rows = [row_of.get(p) for p in range(start, end - 1)]
        if any(r is None for r in rows):
            raise ValueError("walk_tau needs a block at every anchor of the answer")
        tokens += end - 1 - start
        rounds += walk_rounds(accept_by_anchor[rows], start, end)
    return tokens, rounds


def all_anchors(loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every valid anchor (`forward.anchor_candidates`), as `forward.sample_anchors` lays
    them out: (anchors, keep)."""
    anchors = anchor_candidates(loss_mask)
    return anchors, torch.ones(len(anchors), dtype=torch.bool)


def greedy_matches(out, vocab_ids) -> torch.Tensor:
    """[B, A, gamma] bool: the drafter's argmax is the target's argmax (what T=0 verification
    keeps), on supervised slots. When the target's logits cover only the draft vocabulary's
    rows (log-probabilities, `target_is_logprobs`), the best row is the target's argmax only
    if its probability is at least the mass outside those rows; where that is unknown the
    slot counts as a miss, so the greedy walk errs low."""
    draft = out.draft_logits.argmax(-1)
    target = out.aligned_target_logits.float()
    if vocab_ids is not None and target.shape[-1] != len(vocab_ids):
        match = vocab_ids[draft] == target.argmax(-1)  # the target's logits span the whole vocabulary
    elif vocab_ids is not None and out.target_is_logprobs:
        best, index = target.max(-1)
        outside = (1 - target.exp().sum(-1)).clamp_min(0)
        match = (draft == index) & (best.exp() >= outside)
    else:
        match = draft == target.argmax(-1)
    return match & out.eval_mask
