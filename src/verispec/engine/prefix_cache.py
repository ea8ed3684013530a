"""The prefix cache: KV of finished requests kept so that a later prompt starting with
the same tokens skips prefilling them.

Why this shape (copy on hit, exact token prefixes at block boundaries). Every sequence
owns its KV tensors (models/kv_cache.py: rows join and leave without touching each
other), so a shared prefix cannot be referenced in place as vLLM's paged blocks are;
it is copied into the new row's tensors at admission. A copy of L tokens' KV is a memcpy
(SmolLM2 float32: 46 KB a token; copying 1,000 tokens in measured 8.5 ms on the AVX2 EPYC
host, one thread) against a prefill of L tokens (~4 ms a token there: the SPS table's
64-token forward takes 270 ms): the copy is some 500x cheaper than what it saves, and a
hit loses at most the BLOCK - 1 tokens after its last whole block, so a radix tree's
token-exact sharing would save under 16 tokens' prefill a hit for its bookkeeping.

* An entry is the KV of one token sequence of length L (a multiple of BLOCK): a finished
  row's prompt + output (what a multi-turn chat's next prompt starts with), stored when it
  finishes. Global-attention layers keep positions [0, L); sliding-window layers keep the
  last `window` positions [L - window, L), which is all a query at L or later can see.
* Lookup: the longest block prefix of the new prompt (at most prompt - 1 tokens: the last
  prompt token is always computed, it gives the first logits) that an entry holds, the
  tokens compared exactly (hashes only index). A model with sliding-window layers uses an
  entry only at its own length (its ring holds no older window).
* Memory: entries are byte-capped (`max_bytes`) and count against the engine's KV budget:
  the scheduler evicts them, least recently used first, before a row would wait for
  memory. An entry that another one extends is dropped (the longer one serves it).
* Bit-exact: a restored position holds the bits the row's own prefill would have written
  (batch-invariant kernels: a position's K/V do not depend on the chunk it was computed
  in), masked keys never enter a sum, so greedy output is identical with the cache on and
  off. The draft sources are handed the restored tokens.
* Features: a row whose draft source reads the target's hidden states (DSpark, the
  composite) needs every position's tapped features, not only its KV. Its entries keep
  them too (the features its own forwards produced, position by position, as its source
  was given them), and such a row restores only from an entry that has them, handing them
  to its source as the prefill it skipped would have. Before, those rows prefilled in
  full: a drafter reading hidden states turned the cache off. Under batch-invariant
  kernels a position's features, like its K/V, do not depend on the forward that
  computed them.

Checked by tests/test_prefix_cache.py (greedy output with the cache on and off and
against transformers, across joins, leaves, rollbacks, evictions and sliding windows;
the KV budget never exceeded; a DSpark drafter's features and proposals on a restored
prefix against the same requests with the cache off) and bench/prefix_cache.py
(multi-turn replay).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from verispec.models.kv_cache import KVCache, SequenceKV

BLOCK = 16


@dataclass
class Entry:
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer with its own KV (KVCache.own_layers): [kv_heads, positions held, head_dim]
    values: list[torch.Tensor]
    nbytes: int
    features: tuple[torch.Tensor, ...] | None = None  # per tap [L, H]: for sources that read hidden states


class PrefixCache:
    def __init__(self, cache: KVCache, max_bytes: int, block: int = BLOCK):
        self.cache, self.max_bytes, self.block = cache, max_bytes, block
        self.sliding = any(w is not None for w in cache.layer_windows)
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.index: dict[int, set[tuple[int, ...]]] = {}  # hash of a block prefix -> entries holding it
        self.bytes = 0
        self.lookups = self.hits = self.hit_tokens = self.looked_up_tokens = self.evictions = 0
        self._lock = threading.Lock()  # /stats reads while the engine thread writes

    # -- lookup and restore ----------------------------------------------------------------

    def restore(self, seq: SequenceKV, prompt: list[int], features: bool = False) \
            -> tuple[int, tuple[torch.Tensor, ...] | None]:
        """Copy the longest cached block prefix of `prompt` into the empty `seq`; return
        its length (0: no hit) and, with `features`, the restored positions' tapped hidden
        states (then only entries that kept them count)."""
        self.lookups += 1
        self.looked_up_tokens += len(prompt)
        for length in range(self.cacheable(len(prompt)), 0, -self.block):
            entry = self._find(prompt, length, features)
            if entry is not None:
                self._copy_in(entry, seq, length)
                self.hits += 1
                self.hit_tokens += length
                return length, tuple(f[:length] for f in entry.features) if features else None
        return 0, None

    def cacheable(self, prompt_len: int) -> int:
        """How many of a prompt's tokens the cache can hold: its whole blocks among all but
        the last token (the last is always computed, for its logits)."""
        return (prompt_len - 1) // self.block * self.block

    def _find(self, prompt: list[int], length: int, features: bool = False) -> Entry | None:
        head = tuple(prompt[:length])
        for key in self.index.get(hash(head), ()):
            entry = self.entries[key]
            if features and entry.features is None:
                continue
            if (len(key) == length or not self.sliding) and key[:length] == head:
                self.entries.move_to_end(key)
                return entry
        return None

    def _copy_in(self, entry: Entry, seq: SequenceKV, length: int) -> None:
        for at, layer in enumerate(self.cache.own_layers):  # layers sharing another's KV hold none
            window = self.cache.layer_windows[layer]
            k, v = entry.keys[at], entry.values[at]
            if window is None:
                seq.keys[layer][:, :length].copy_(k[:, :length])
                seq.values[layer][:, :length].copy_(v[:, :length])
            else:  # the positions [length - held, length), each to its slot in this ring
                held = k.shape[1]
                slots = torch.arange(length - held, length) % seq.slots[layer]
                # the ring's other slots are masked, but a masked slot still enters SDPA's
                # product (0 x NaN is NaN): no uninitialized memory there
                seq.keys[layer].zero_()
                seq.values[layer].zero_()
                seq.keys[layer][:, slots] = k
                seq.values[layer][:, slots] = v
        seq.length = seq.written_end = length
        for window in seq.valid_from:
            seq.valid_from[window] = max(0, length - window)

    # -- insert and evict ------------------------------------------------------------------

    def insert(self, tokens: list[int], seq: SequenceKV,
               features: list[tuple[torch.Tensor, ...]] | None = None) -> None:
        """Keep the KV of `tokens` (a finished row's prompt + output; the sequence holds at
        least the first len(tokens) - 1 of them) at the largest block boundary held, and
        the tapped features of those positions where given: per forward that wrote the
        sequence, in order, its rows' features (one tensor per tap; `Row.features`)."""
        length = min(seq.length, len(tokens) - 1) // self.block * self.block
        if length < self.block:
            return
        if features is not None and sum(len(f[0]) for f in features) < length:
            features = None  # not every position's: a source reading them cannot use the entry
        key = tuple(tokens[:length])
        if key in self.entries and (self.entries[key].features is not None or features is None):
            self.entries.move_to_end(key)
            return
        keys, values = [], []
        for layer in self.cache.own_layers:
            window = self.cache.layer_windows[layer]
            if window is None:
                keys.append(seq.keys[layer][:, :length].clone())
                values.append(seq.values[layer][:, :length].clone())
            else:
                first = max(0, length - window)
                if seq.valid_from[window] > first:
                    return  # the ring moved on past these positions: nothing exact to keep
                slots = torch.arange(first, length) % seq.slots[layer]
                keys.append(seq.keys[layer][:, slots].clone())
                values.append(seq.values[layer][:, slots].clone())
        kept = None if features is None else _first_rows(features, length)
        nbytes = sum(t.nelement() * t.element_size() for t in keys + values + list(kept or ()))
        if nbytes > self.max_bytes:
            return
        with self._lock:
            if key in self.entries:  # the same tokens without features: this one serves every row
                self._drop(key)
            if not self.sliding:  # entries this one extends are served by it now (features permitting)
                for shorter in [k for k in self.index.get(hash(key[: self.block]), ()) if len(k) < length
                                and key[: len(k)] == k and (kept is not None or self.entries[k].features is None)]:
                    self._drop(shorter)
            self.entries[key] = Entry(key, keys, values, nbytes, kept)
            for end in range(self.block, length + 1, self.block):
                self.index.setdefault(hash(key[:end]), set()).add(key)
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self.entries)))
                self.evictions += 1

    def evict(self, nbytes: int) -> int:
        """Free at least `nbytes` (least recently used first) or everything; return the
        bytes freed."""
        freed = 0
        with self._lock:
            while self.entries and freed < nbytes:
                before = self.bytes
                self._drop(next(iter(self.entries)))
                freed += before - self.bytes
                self.evictions += 1
        return freed

    def _drop(self, key: tuple[int, ...]) -> None:
        entry = self.entries.pop(key)
        self.bytes -= entry.nbytes
        for end in range(self.block, len(key) + 1, self.block):
            holders = self.index.get(hash(key[:end]))
            if holders is not None:
                holders.discard(key)
                if not holders:
                    del self.index[hash(key[:end])]

    def stats(self) -> dict:
        return {"bytes": self.bytes, "max_bytes": self.max_bytes, "entries": len(self.entries),
                "lookups": self.lookups, "hits": self.hits,
                "hit_rate": round(self.hit_tokens / self.looked_up_tokens, 4) if self.looked_up_tokens else 0.0,
                "hit_tokens": self.hit_tokens, "evictions": self.evictions, "block": self.block}


def _first_rows(record: list[tuple[torch.Tensor, ...]], length: int) -> tuple[torch.Tensor, ...]:
    """Per tap, the first `length` rows of a record of forwards' features, in one copy."""
    parts, held = [], 0
    for forward in record:
        if held >= length:
            break
        parts.append(tuple(f[: length - held] for f in forward))
        held += len(forward[0])
    return tuple(torch.cat([part[tap] for part in parts]) for tap in range(len(record[0])))
