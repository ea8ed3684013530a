"""A direct generation loop over the Decoder: prefill (chunked), then one token per step.

This is the serial path used by `verispec generate`, the tests and bench/decode.py. The
server's continuous-batching engine (a later issue) drives the same Decoder/KVCache
seams with many rows per step; `greedy_batch` here already runs several rows in one
forward to prove the seams batch exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from verispec.models.kv_cache import KVCache, SequenceKV
from verispec.models.decoder import BatchKV, Decoder

DEFAULT_PREFILL_CHUNK = 512


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0  # wall time until the first token was sampled (TTFT)
    decode_s: float = 0.0  # wall time of the steps after the first token
    finish_reason: str = "length"

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first token comes out of prefill; decode speed counts the rest
        n = self.generated_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s else 0.0


@dataclass
class TokenEvent:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


def prefill(model: Decoder, seq: SequenceKV, prompt: Sequence[int], chunk: int = DEFAULT_PREFILL_CHUNK) -> torch.Tensor:
    """Run the prompt through the model in chunks; returns the last position's logits."""
    ids = torch.as_tensor(prompt, dtype=torch.long, device=model.device)
    logits = None
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        logits = model(piece, BatchKV([seq], [len(piece)])).logits
    return logits[0]


def stream_generate(
    model: Decoder,
    prompt: Sequence[int],
    max_new_tokens: int,
    sampler=None,
    stop_ids: Sequence[int] = (),
    cache: KVCache | None = None,
    stats: GenerationStats | None = None,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
) -> Iterator[TokenEvent]:
    """Yield generated tokens one at a time. `sampler(logits[V], generated) -> TokenEvent`
    picks each token (greedy argmax when None). A stop id ends generation and is not
    yielded (EOS is never content)."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if max_new_tokens <= 0:
        return
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt)
    cache = cache or model.new_cache()
    seq = cache.allocate(len(prompt) + max_new_tokens)
    pick = sampler or (lambda logits, _generated: TokenEvent(int(torch.argmax(logits))))
    stops = set(stop_ids)
    generated: list[int] = []
    try:
        t0 = time.perf_counter()
        logits = prefill(model, seq, prompt, prefill_chunk)
        while True:
            event = pick(logits, generated)
            now = time.perf_counter()
            if not generated:
                stats.prefill_s = now - t0
                t_first = now
            else:
                stats.decode_s = now - t_first
            if event.token in stops:
                stats.finish_reason = "stop"
                return
            generated.append(event.token)
            stats.generated_tokens = len(generated)
            yield event
            if len(generated) >= max_new_tokens:
                stats.finish_reason = "length"
                return
            step = torch.tensor([event.token], device=model.device)
            logits = model(step, BatchKV([seq], [1])).logits[0]
    finally:
        cache.release(seq)


def greedy_batch(model: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy-decode several prompts as one batch: one forward per step over all rows
    (rows of different lengths, no padding). Used to prove batching is exact."""
    cache = model.new_cache()
    seqs = [cache.allocate(len(p) + max_new_tokens) for p in prompts]
    ids = torch.cat([torch.as_tensor(p, dtype=torch.long) for p in prompts]).to(model.device)
    logits = model(ids, BatchKV(seqs, [len(p) for p in prompts])).logits
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        next_ids = logits.argmax(-1)
        for out, tok in zip(outputs, next_ids.tolist()):
            out.append(tok)
        if step + 1 < max_new_tokens:
            logits = model(next_ids, BatchKV(seqs, [1] * len(seqs))).logits
    for seq in seqs:
        cache.release(seq)
    return outputs
