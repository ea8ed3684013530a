"""Grammar masks for one step's verify positions.

A grammar row fed `[pending, d_1 .. d_k]` has k + 1 verify positions; position j samples
the token after d_j, so its mask is the grammar's state after the row's output plus
d_1 .. d_j. The matcher walks the drafts it accepts (`validate` says how many, m), fills
the masks of positions 0 .. m, and rolls back to the output: the matcher only ever
stays advanced by emitted tokens (engine.py consumes them as they are accepted).

Positions after m need no mask: d_{m+1} is not allowed at position m, so its masked
probability is 0 and every verify rule rejects it there (greedy: the masked argmax
differs; matching: a masked draw never equals it; speculative sampling: p/q = 0). Those
positions are left all-allowed and never read; so are the positions after a draft that
completes the grammar (the row finishes at that draft). Drafts themselves stay unconstrained,
and speculative sampling still sees the draft's own q for the rejected token, so the
residual it resamples from is exact.

A grammar position that allows no token at all (a grammar the backend cannot extend)
raises GrammarDeadEnd before anything is sampled: runner.decide fails that row alone.
"""

from __future__ import annotations

import torch

from verispec.grammar.backend import Matcher, bitmask_words, forbidden_tokens


class GrammarDeadEnd(RuntimeError):
    pass


def step_masks(rows: list[tuple[Matcher | None, list[int]]], vocab_size: int
               ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """`rows`: (matcher or None, drafts) per emitting row, in the order of their verify
    positions. Returns (position index [P], forbidden [P, V]) over the grammar rows'
    positions (index None: every position), or None when no row has a grammar."""
    if all(m is None for m, _ in rows):
        return None
    n_positions = sum(len(drafts) + 1 for m, drafts in rows if m is not None)
    bitmask = torch.full((n_positions, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    index, firsts, at = [], [], 0  # firsts: each grammar row's position 0, the one every step reads
    for matcher, drafts in rows:
        if matcher is not None:
            first = len(index)
            index.extend(range(at, at + len(drafts) + 1))
            matcher.fill_bitmask(bitmask, first)
            valid, walked = matcher.validate(drafts), 0
            while walked < valid:
                matcher.consume(drafts[walked])
                walked += 1
                if matcher.stopped:  # the row ends at this draft: later positions are never read
                    break
                matcher.fill_bitmask(bitmask, first + walked)
            matcher.rollback(walked)
            firsts.append((first, matcher))
        at += len(drafts) + 1
    forbidden = forbidden_tokens(bitmask, vocab_size)
    dead = forbidden[[p for p, _ in firsts]].all(dim=-1).tolist()
    for (_, matcher), no_token in zip(firsts, dead):
        if no_token:
            raise GrammarDeadEnd(f"the grammar allows no next token: {matcher.error or 'no token can continue the output'}")
    return (None if len(index) == at else torch.tensor(index, dtype=torch.long)), forbidden
