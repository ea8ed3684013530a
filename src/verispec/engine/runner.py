"""One step's model work: the packed target forward, then the tokens each row emits.

`Work` is one row's part of a step: the tokens it feeds (a prefill chunk, or `[pending,
drafts...]` for a decoding row) and, after `forward`, its logits and tapped hidden
states. `decide` turns the logits of the rows that emit into tokens: every row's
positions go through the processors in one batched call (each position with its own
history: the output plus the drafts before it, and, for a row with a grammar, the mask
of the grammar's state at that position: engine/grammar_masks.py), then engine/verify.py keeps the longest
acceptable prefix of each row's drafts and draws the token after it. A row without drafts
is the k = 0 case of the same rule, which is plain sampling.

Failure stays local: if the batched forward or decision raises, each row is run alone,
and only rows that still raise are reported as failed (a forward that raised left no
trace in any cache: lengths are restored).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from verispec.engine.grammar_masks import step_masks
from verispec.engine.request import TokenInfo
from verispec.engine.row import Row
from verispec.engine.sampling import process_logits, token_logprobs
from verispec.models.decoder import BatchKV, Decoder
from verispec.engine.draft import Draft, Hidden
from verispec.engine.verify import VerifyRow, verify

OnFailure = Callable[[Row, Exception], None]


@dataclass
class Work:
    row: Row
    tokens: list[int]
    emits: bool  # samples tokens from this step (decode rows, a prompt's last chunk)
    draft: Draft = field(default_factory=Draft)
    chunk: PrefillChunk | None = None  # the prompt chunk it feeds; None: it decodes [pending, drafts...]
    logits: torch.Tensor | None = None  # [positions, V]: all fed positions of a decode row, else the last
    hidden: Hidden | None = None  # per tap: [len(tokens), H]

    @classmethod
    def decoding(cls, row: Row, draft: Draft) -> "Work":
        return cls(row, [row.pending, *draft.tokens], True, draft)

    @classmethod
    def prefilling(cls, chunk: PrefillChunk) -> "Work":
        return cls(chunk.row, chunk.row.request.prompt_ids[chunk.start : chunk.stop], chunk.completes_prompt, chunk=chunk)

    @property
    def decode(self) -> bool:
        return self.chunk is None

    @property
    def logit_positions(self) -> range:
        if not self.emits:
            return range(0)
        n = len(self.tokens)
        return range(n - 1 - len(self.draft), n)


def forward(model: Decoder, work: list[Work], taps: Sequence[int], on_failure: OnFailure) -> list[Work]:
    """Run the step's forward; return the work items that succeeded (with logits/hidden)."""
    try:
        _run(model, work, taps)
        return work
    except Exception as e:  # noqa: BLE001 - isolate the failing row below
        if len(work) == 1:
            on_failure(work[0].row, e)
            return []
    survivors = []
    for item in work:
        try:
            _run(model, [item], taps)
            survivors.append(item)
        except Exception as e:  # noqa: BLE001
            on_failure(item.row, e)
    return survivors


def _run(model: Decoder, work: list[Work], taps: Sequence[int]) -> None:
    seqs = [w.row.kv for w in work]
    lengths = [seq.length for seq in seqs]
    device = model.device
    ids = torch.tensor([t for w in work for t in w.tokens], dtype=torch.long, device=device)
    at, logits_at = 0, []
    for w in work:
        logits_at.extend(at + p for p in w.logit_positions)
        at += len(w.tokens)
    wanted = [w for w in work if w.row.source_needs_hidden] if taps else []
    try:
        out = model(ids, BatchKV(seqs, [len(w.tokens) for w in work]),
                    logits_at=torch.tensor(logits_at, dtype=torch.long, device=device), taps=taps if wanted else ())
    except Exception:
        for seq, n in zip(seqs, lengths):  # nothing of a failed forward stays in any cache
            if seq.length > n:
                seq.rollback(seq.length - n)
        raise
    at_logits, at_tokens = 0, 0
    for w in work:
        n_logits = len(w.logit_positions)
        w.logits = out.logits[at_logits : at_logits + n_logits]
        if wanted and w.row.source_needs_hidden:
            w.hidden = tuple(h[at_tokens : at_tokens + len(w.tokens)] for h in out.hidden)
        at_logits += n_logits
        at_tokens += len(w.tokens)


def joined_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The rows of `parts` as one tensor: a view when they lie back to back in one buffer,
    as the forward's logits do, sliced per row in order (at 16 rows of Gemma's 262,144-token
    vocabulary a copy is 16 MB a step, ~3 ms with its fresh pages), else a copy."""
    first = parts[0]
    if len(parts) == 1:
        return first
    storage, stride, offset = first.untyped_storage().data_ptr(), first.stride(), first.storage_offset()
    for part in parts:
        if part.untyped_storage().data_ptr() != storage or part.storage_offset() != offset or (
                part.shape[1:] != first.shape[1:] or part.stride()[1:] != stride[1:]
                or part.shape[0] > 1 and part.stride()[0] != stride[0]):
            return torch.cat(parts)
        offset += part.shape[0] * stride[0]
    rows = sum(part.shape[0] for part in parts)
    return first.as_strided((rows, *first.shape[1:]), stride, first.storage_offset())


def decide(work: list[Work], on_failure: OnFailure) -> list[tuple[Work, list[TokenInfo]]]:
    """The tokens each emitting row emits this step: kept drafts, then the next token."""
    try:
        return _decide(work)
    except Exception as e:  # noqa: BLE001
        if len(work) == 1:
            on_failure(work[0].row, e)
            return []
    results = []
    for item in work:
        try:
            results.extend(_decide([item]))
        except Exception as e:  # noqa: BLE001
            on_failure(item.row, e)
    return results


def _decide(work: list[Work]) -> list[tuple[Work, list[TokenInfo]]]:
    logits = joined_rows([w.logits for w in work])
    params, prompts, histories = [], [], []
    penalties = any(w.row.params.has_penalties for w in work)
    for w in work:
        drafts = w.draft.tokens
        for j in range(len(drafts) + 1):
            params.append(w.row.params)
            if penalties:
                prompts.append(w.row.prompt_tensor)
                histories.append(w.row.output + drafts[:j] if j else w.row.output)
    grammar_mask = step_masks([(w.row.grammar, w.draft.tokens) for w in work], logits.shape[1])
    processed = process_logits(logits, params, prompts if penalties else None, histories if penalties else None,
                               grammar_mask)
    decisions = verify(processed, [VerifyRow(w.row.params, w.row.generator, w.draft.tokens, w.draft.q) for w in work])
    out, at = [], 0
    for w, (n_kept, next_token) in zip(work, decisions):
        tokens = w.draft.tokens[:n_kept] + [next_token]
        infos = [TokenInfo(t) for t in tokens]
        k = w.row.params.logprobs
        if k is not None:
            lp = token_logprobs(logits[at : at + len(tokens)], torch.tensor(tokens, device=logits.device), k)
            for info, chosen, ids, values in zip(infos, lp.chosen.tolist(), lp.top_ids.tolist(), lp.top_logprobs.tolist()):
                info.logprob, info.top = chosen, list(zip(ids, values))
        out.append((w, infos))
        at += len(w.draft) + 1
    return out
