"""Per-sequence KV storage: many sequences at once, O(1) rollback, sliding-window rings.

Layout. Every sequence owns its own tensors (one K and one V per layer, shape
[kv_heads, slots, head_dim], both per layer in gemma4; a gemma4 layer that shares another's
KV holds the same tensors as that layer), reserved once at admission for `capacity` tokens. A batch is
just a list of sequences: joining or leaving never copies or re-merges another row's KV,
and the bytes a sequence holds are known before it starts, so a scheduler can admit by
budget (`KVCache.bytes_for`).

Global-attention layers have `capacity` slots; position p lives in slot p. Sliding-window
layers (gemma3) keep a ring of `window + max_rollback` slots; position p lives in slot
p % ring. The extra `max_rollback` slots are what make rollback possible after the ring
has wrapped: a speculative round may discard up to that many tokens and the window
behind the new end is still intact. `valid_from` records the oldest position whose whole
tail is still in the ring; a rollback that would need older positions is refused.

Rollback is O(1): it only moves `length` back. Stale slots beyond `length` are
overwritten by the next write and never attended to: attention masks are built from the
positions each slot must hold (derived from `length`), and any slot whose position is
outside the query's window or not yet written is masked out.

Checked by tests/test_kv_cache.py (rollback + re-extend == fresh run, with and without a
wrapped ring, against transformers' logits as well as our own fresh run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.models.config import ModelArgs

DEFAULT_MAX_ROLLBACK = 64


class CacheError(RuntimeError):
    """A cache operation the current contents cannot support (capacity, rollback)."""


@dataclass
class KeyPlan:
    """How one row attends in one kind of layer during one forward (shared by all
    layers of that kind, so the mask is built once per row, not once per layer)."""

    write: slice | torch.Tensor  # slots receiving the new tokens' K/V
    write_from: int  # index of the first new token that is written (gather mode skips the rest)
    n_view: int  # keys = slots [:n_view] (view mode)
    gather: torch.Tensor | None  # slot indices of older keys to prepend (gather mode)
    mask: torch.Tensor | None  # [n_new, n_keys] bool, True = attend; None = attend to all


class SequenceKV:
    """The KV cache of one sequence for one model."""

    def __init__(self, cache: "KVCache", capacity: int):
        self.cache = cache
        self.capacity = capacity
        self.length = 0
        # where the latest forward's writes ended: a rollback moves `length` back but the rolled
        # back slots keep their K/V until overwritten (the gemma4 assistant reads one of them)
        self.written_end = 0
        self.slots = [cache.slots_for_layer(i, capacity) for i in range(cache.num_layers)]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for i, slots in enumerate(self.slots):
            source = cache.kv_source[i]
            if source != i:  # gemma4 KV sharing: the same tensors as the layer it reads (never written here)
                self.keys.append(self.keys[source])
                self.values.append(self.values[source])
                continue
            heads, dim = cache.layer_shapes[i]
            self.keys.append(torch.empty((heads, slots, dim), dtype=cache.dtype, device=cache.device))
            self.values.append(torch.empty((heads, slots, dim), dtype=cache.dtype, device=cache.device))
        # slots per layer kind (kind = sliding window size, None for global attention)
        self.kind_slots = {w: s for w, s in zip(cache.layer_windows, self.slots)}
        # per sliding kind: oldest position p such that every position in [p, length) is held
        self.valid_from = {w: 0 for w in self.kind_slots if w is not None}
        self.nbytes = sum(self.keys[i].nelement() * self.keys[i].element_size() * 2 for i in cache.own_layers)

    def rollback(self, n: int) -> None:
        """Forget the last n tokens (O(1))."""
        if n < 0 or n > self.length:
            raise CacheError(f"cannot roll back {n} tokens of a sequence holding {self.length}")
        new_length = self.length - n
        for window, valid_from in self.valid_from.items():
            if valid_from > max(0, new_length - window + 1):
                raise CacheError(
                    f"cannot roll back {n} tokens: the sliding-window ring (window {window}) no longer holds "
                    f"positions before {valid_from} (max rollback after wrap is {self.cache.max_rollback})"
                )
        self.length = new_length

    def plan(self, n_new: int) -> dict[int | None, KeyPlan]:
        """Key plans for appending n_new tokens, one per layer kind (window or None)."""
        if self.length + n_new > self.capacity:
            raise CacheError(
                f"sequence cache full: {self.length} cached + {n_new} new > capacity {self.capacity}"
            )
        plans = {}
        for window, slots in self.kind_slots.items():
            if window is None:
                plans[window] = _linear_plan(self.length, n_new, self.cache.device)
            else:
                plans[window] = self._ring_plan(window, slots, n_new)
        return plans

    def _ring_plan(self, window: int, ring: int, n_new: int) -> KeyPlan:
        start, end = self.length, self.length + n_new
        device = self.cache.device
        if end <= ring or n_new <= ring - window + 1:
            # View mode: write first, then attend over the whole ring. Safe because a
            # chunk of at most (ring - window + 1) tokens never overwrites a slot that an
            # earlier query of the same chunk still needs.
            n_view = min(ring, end)
            slot_pos = _ring_slot_positions(end, ring, n_view, device)
            q_pos = torch.arange(start, end, device=device)
            mask = None
            if not (n_new == 1 and end <= window):
                diff = q_pos[:, None] - slot_pos[None, :]
                mask = (diff >= 0) & (diff < window) & (slot_pos[None, :] >= self.valid_from[window])
            return KeyPlan(_ring_slots(start, end, ring, device), 0, n_view, None, mask)
        # Gather mode (long prefill chunk after wrap): read the older window in order,
        # attend over [older, new], then write only the newest `ring` tokens.
        first_old = max(0, start - window + 1)
        old_pos = torch.arange(first_old, start, device=device)
        key_pos = torch.cat([old_pos, torch.arange(start, end, device=device)])
        q_pos = torch.arange(start, end, device=device)
        diff = q_pos[:, None] - key_pos[None, :]
        mask = (diff >= 0) & (diff < window)
        write_from = max(0, n_new - ring)
        return KeyPlan(_ring_slots(start + write_from, end, ring, device), write_from, 0, old_pos % ring, mask)

    def advance(self, n_new: int) -> None:
        """Commit n_new written tokens (called once per forward, after all layers)."""
        self.length += n_new
        self.written_end = self.length
        for window in self.valid_from:
            self.valid_from[window] = max(self.valid_from[window], self.length - self.kind_slots[window])


def _linear_plan(start: int, n_new: int, device) -> KeyPlan:
    end = start + n_new
    mask = None
    if n_new > 1:
        q_pos = torch.arange(start, end, device=device)
        mask = torch.arange(end, device=device)[None, :] <= q_pos[:, None]
    return KeyPlan(slice(start, end), 0, end, None, mask)


def _ring_slots(start: int, end: int, ring: int, device) -> slice | torch.Tensor:
    if start // ring == (end - 1) // ring:  # no wrap inside the write: a plain slice
        return slice(start % ring, (end - 1) % ring + 1)
    return torch.arange(start, end, device=device) % ring


def _ring_slot_positions(end: int, ring: int, n_view: int, device) -> torch.Tensor:
    """Position each slot must hold for a sequence of length `end`: the largest
    p < end with p % ring == slot (negative = never written)."""
    slots = torch.arange(n_view, device=device)
    last = end - 1
    return last - ((last - slots) % ring)


class KVCache:
    """Allocator and accountant of SequenceKV objects for one model."""

    def __init__(
        self,
        args: ModelArgs,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_rollback: int = DEFAULT_MAX_ROLLBACK,
    ):
        self.num_layers = args.num_layers
        self.layer_shapes = [(args.kv_heads_at(i), args.head_dim_at(i)) for i in range(args.num_layers)]
        self.kv_source = [args.kv_source_at(i) for i in range(args.num_layers)]
        self.own_layers = [i for i in range(args.num_layers) if self.kv_source[i] == i]
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_rollback = max_rollback
        self.layer_windows = tuple(args.layer_windows) or (None,) * args.num_layers
        self.live: set[SequenceKV] = set()
        # a running total rather than a sum over `live`: other threads (the server's
        # /stats) read it while the engine thread allocates and releases
        self._bytes_in_use = 0

    def slots_for_layer(self, layer: int, capacity: int) -> int:
        window = self.layer_windows[layer]
        if window is None:
            return capacity
        # A sequence shorter than the ring never wraps and needs no more than capacity.
        return min(capacity, window + self.max_rollback)

    def bytes_for(self, capacity: int) -> int:
        element = torch.finfo(self.dtype).bits // 8
        return sum(self.slots_for_layer(i, capacity) * 2 * heads * dim * element
                   for i, (heads, dim) in enumerate(self.layer_shapes) if i in self.own_layers)

    def allocate(self, capacity: int) -> SequenceKV:
        if capacity <= 0:
            raise CacheError(f"capacity must be positive, got {capacity}")
        seq = SequenceKV(self, capacity)
        self.live.add(seq)
        self._bytes_in_use += seq.nbytes
        return seq

    def release(self, seq: SequenceKV) -> None:
        if seq in self.live:
            self.live.discard(seq)
            self._bytes_in_use -= seq.nbytes
        seq.keys.clear()
        seq.values.clear()

    @property
    def bytes_in_use(self) -> int:
        return self._bytes_in_use
