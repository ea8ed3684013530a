"""Verification: which drafted tokens a row keeps, and the token that follows them.

A row fed `[pending, d_1 .. d_k]` gets k + 1 rows of processed target logits: position j
is the target's distribution p_j for the token after d_j (after `pending` for j = 0),
computed by the same processors as plain decoding, with the drafts before it in the
history. Three rules, each leaving the output distribution exactly the target's:

* greedy: y_j = argmax p_j; keep drafts while d_{j+1} == y_j; the first y_j that differs
  (or y_k, the bonus) follows. Identical tokens to plain greedy decoding.
* sampled, no draft distribution (n-gram): draw y_j ~ p_j with the request's generator
  and keep drafts while they match. Each kept token was drawn from p exactly as plain
  decoding would have drawn it, with the same random number: the generator is rewound
  so that a round consumes exactly one number per token it emits, and a seeded request
  gives the same tokens with or without speculation.
* sampled, with q (a draft model, DSpark), no seed: standard speculative sampling
  (Leviathan et al., Chen et al.): keep d_j with probability min(1, p(d_j) / q(d_j)); at
  the first rejection draw from normalize(max(0, p - q)) (p itself where that mass
  vanishes); when all k are kept draw the bonus from p_k. The output has distribution p.
* sampled, with q, seeded: by matching, like n-gram drafts. Speculative sampling's random
  numbers depend on how many drafts each round verified, and the cost-based policy picks
  that from timings, so a seeded request would not repeat itself run to run; matching
  gives exactly plain decoding's seeded tokens whatever was drafted (at a lower
  acceptance: sum p*q instead of sum min(p, q)).

Checked by tests/test_spec.py: greedy outputs identical to plain decoding for every
source, seeded sampling with n-gram identical too, and a chi-square test of the first
tokens' joint distribution against the exact one computed from the model, which a rule
that skips the residual correction fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.engine.sampling import SamplingParams, greedy_tokens, inverse_cdf_draw, sample

# q(x) below this is treated as this: a token the draft could (numerically) not have
# drawn is accepted only with probability p / 1e-10, i.e. always when p is not tiny
Q_FLOOR = 1e-10
RESIDUAL_FLOOR = 1e-8


@dataclass
class VerifyRow:
    params: SamplingParams
    generator: torch.Generator | None
    drafts: list[int]
    q: torch.Tensor | None = None  # [len(drafts), V]


def verify(processed: torch.Tensor, rows: list[VerifyRow]) -> list[tuple[int, int]]:
    """`processed`: the rows' processed logits stacked, len(drafts) + 1 per row, in order.
    Returns (number of drafts kept, the token that follows them) per row."""
    spans, at = [], 0
    for row in rows:
        spans.append((at, at + len(row.drafts) + 1))
        at += len(row.drafts) + 1
    if at != processed.shape[0]:
        raise ValueError(f"{processed.shape[0]} logits rows for {at} verify positions")
    results: list[tuple[int, int] | None] = [None] * len(rows)

    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    if greedy:
        targets = greedy_tokens(processed).tolist()
        for i in greedy:
            a, b = spans[i]
            results[i] = _first_mismatch(rows[i].drafts, targets[a:b])

    matched = [i for i, r in enumerate(rows) if not r.params.is_greedy and (r.q is None or r.params.seed is not None)]
    if matched:
        results_m = _verify_by_matching(processed, [rows[i] for i in matched], [spans[i] for i in matched])
        for i, result in zip(matched, results_m):
            results[i] = result

    for i, row in enumerate(rows):
        if results[i] is None:
            a, b = spans[i]
            results[i] = speculative_sample(processed[a:b], row)
    return results  # type: ignore[return-value]


def _first_mismatch(drafts: list[int], targets: list[int]) -> tuple[int, int]:
    for j, d in enumerate(drafts):
        if targets[j] != d:
            return j, targets[j]
    return len(drafts), targets[len(drafts)]


def _verify_by_matching(processed, rows: list[VerifyRow], spans) -> list[tuple[int, int]]:
    params = [r.params for r, (a, b) in zip(rows, spans) for _ in range(b - a)]
    generators = [r.generator for r, (a, b) in zip(rows, spans) for _ in range(b - a)]
    states = [r.generator.get_state() for r in rows]
    if spans[0][0] == 0 and spans[-1][1] == processed.shape[0] and all(
            b == a2 for (_, b), (a2, _) in zip(spans, spans[1:])):
        rows_of = processed  # every row of the step is matched, in order: no copy (16 rows of Gemma's: 2-3 ms)
    else:
        rows_of = processed.index_select(0, torch.cat([torch.arange(a, b) for a, b in spans]).to(processed.device))
    drawn = sample(rows_of, params, generators).tolist()
    out, at = [], 0
    for row, (a, b), state in zip(rows, spans, states):
        n, token = _first_mismatch(row.drafts, drawn[at : at + (b - a)])
        at += b - a
        # consume exactly one random number per emitted token, as plain decoding does
        row.generator.set_state(state)
        torch.rand((n + 1, 1), generator=row.generator, dtype=torch.float64)
        out.append((n, token))
    return out


def speculative_sample(processed: torch.Tensor, row: VerifyRow) -> tuple[int, int]:
    """Standard speculative sampling for one sampled row: processed [k + 1, V], row.q [k, V].

    p is computed only as far as positions are reached: position j's is needed only if
    drafts 0..j-1 were kept, and at T=1 most rounds stop at the first. Each reached position
    costs one softmax over the vocabulary (262,144 entries on Gemma); the residual one more
    pass, on the rejected position only."""
    k = len(row.drafts)
    u = torch.rand(k, generator=row.generator, dtype=torch.float64).tolist() if k else []
    for j, draft in enumerate(row.drafts):
        p = processed[j].float().softmax(dim=-1)
        q = row.q[j]
        if not u[j] < float(p[draft]) / max(float(q[draft]), Q_FLOOR):
            return j, _draw(residual(p, q.to(p.device, torch.float32)), row.generator)
    return k, _draw(processed[k].float().softmax(dim=-1), row.generator)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), what a rejection must be resampled from (p where that mass vanishes);
    the draw normalizes."""
    r = (p - q).clamp_min_(0)
    return r if float(r.sum(dtype=torch.float64)) > RESIDUAL_FLOOR else p


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One exact draw from a row of nonnegative weights (one random number, as `sample` uses)."""
    return int(inverse_cdf_draw(weights[None], generator)[0])
