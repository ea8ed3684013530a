"""Per-request logits processing, token sampling and logprobs.

The sampler works on a batch of logits rows ``[N, V]``. Every row belongs to a
request with its own :class:`SamplingParams` and its own token history. In plain
decoding a request owns one row; in speculative verification it owns several
consecutive rows (its verify positions), whose histories differ (prompt + output
+ the drafts accepted so far), and the target (p) and draft (q) distributions must
go through exactly the same processors. So every processor here is a function of
``(logits row, params, that row's history)``, batched over rows.

Processing order (``process_logits``)
-------------------------------------
1. ``logit_bias``          -- the user's edit of the model's scores comes first, as in
                               OpenAI's API, so later stages see the biased scores.
2. repetition penalty       -- HF/CTRL semantics over prompt + generated tokens: it is
                               a rescaling of the model's logits, so it acts on logits
                               before anything that depends on their scale.
3. presence / frequency     -- OpenAI semantics over generated tokens only; additive,
                               also on the logit scale.
   grammar mask             -- (structured output) tokens the row's grammar does not
                               allow next become -inf: after the logits processors, before
                               everything that samples, so temperature and the
                               truncations act on the grammar's support (vLLM's order),
                               and a top-k/top-p set can never end up empty.
   *Greedy rows stop here*: the token is the argmax of this row. Temperature and
   the truncations below cannot change which token is largest (they only rescale
   or drop smaller tokens), so skipping them saves work and changes nothing.
4. temperature              -- divides the logits; the truncations below are defined on
                               the tempered distribution (same order as HF ``generate``
                               and vLLM), so top-p and min-p see the probabilities that
                               are actually sampled.
5. top-k                    -- keeps ties with the k-th largest value (HF semantics).
6. top-p                    -- keeps the smallest high-probability set with mass >= p.
7. min-p                    -- drops tokens below ``min_p * max prob``.

Rows that all set a small top-k (at most ``SPARSE_TOP_K``, as Gemma 3's recommended 64) run
temperature, top-p and min-p on their top-k candidates alone, found through block maxima
(``_largest``), and the rest of the row is ``-inf``: the same result without a pass over the
vocabulary per stage (0.28 ms against 3.6 ms a row on Gemma's 262,144 tokens).

Removed tokens are set to ``-inf``. The processed row is what sampling uses, and
``softmax(processed row)`` is the distribution it draws from (:func:`sampling_probs`
returns it, with a point mass at the argmax for greedy rows), so speculative
verification can use it directly as p or q.

Logprobs (:func:`token_logprobs`) are computed from the *raw* model logits, before
any processing -- the vLLM default (``logprobs_mode="raw_logprobs"``).

Checked against (``tests/test_sampling.py``): transformers' ``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``,
``RepetitionPenaltyLogitsProcessor`` and ``SequenceBiasLogitsProcessor``; a per-token
loop of OpenAI's documented presence/frequency formula; a chi-square test of the
sampled frequencies against ``softmax(processed)``.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeAlias

import torch

__all__ = [
    "GREEDY_TEMPERATURE",
    "MAX_LOGPROBS",
    "TOP_P_CANDIDATES",
    "History",
    "SamplingParams",
    "TokenLogprobs",
    "inverse_cdf_draw",
    "make_generator",
    "process_logits",
    "sample",
    "sampling_probs",
    "token_logprobs",
]

# Temperatures below this are treated as greedy (as vLLM does): dividing logits by a
# near-zero temperature overflows float32 to inf and softmax then gives NaN.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20

# A token history: token ids as a list/tuple of ints or a 1-D integer tensor.
History: TypeAlias = Sequence[int] | torch.Tensor


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, validated on construction (ValueError naming the field).

    ``temperature`` 0 (or below ``GREEDY_TEMPERATURE``) is greedy; ``top_k`` 0/None,
    ``top_p`` 1, ``min_p`` 0, ``repetition_penalty`` 1 and the other penalties 0 are
    off. ``repetition_penalty`` acts on prompt + generated tokens (HF/CTRL);
    ``presence_penalty``/``frequency_penalty`` on generated tokens only (OpenAI).
    ``logit_bias`` maps token id -> additive bias in [-100, 100] (string ids from JSON
    are accepted). ``logprobs`` is how many top alternatives to report (0..20).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    logprobs: int | None = None

    # Derived once so the per-token hot path only reads attributes.
    _greedy: bool = field(init=False, repr=False, compare=False)
    _noop: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate_scalars()
        self._validate_logit_bias()
        self._validate_seed_and_logprobs()
        if self.top_k is None:
            object.__setattr__(self, "top_k", 0)
        greedy = self.temperature < GREEDY_TEMPERATURE
        object.__setattr__(self, "_greedy", greedy)
        object.__setattr__(self, "_noop", greedy and not self.has_bias and not self.has_penalties)

    def _validate_scalars(self) -> None:
        def number(name: str) -> float:
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            return float(value)

        if number("temperature") < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 0):
            raise ValueError(f"top_k must be None or an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < number("top_p") <= 1:
            raise ValueError(f"top_p must satisfy 0 < top_p <= 1, got {self.top_p!r}")
        if not 0 <= number("min_p") < 1:
            raise ValueError(f"min_p must satisfy 0 <= min_p < 1, got {self.min_p!r}")
        if number("repetition_penalty") <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= number(name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
        normalized: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            # JSON object keys are strings ("50256"); accept those as token ids too.
            token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
            if not _is_number(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {key!r}")
            normalized[token] = float(bias)
        object.__setattr__(self, "logit_bias", normalized or None)

    def _validate_seed_and_logprobs(self) -> None:
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64), got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the token is the argmax (temperature 0, or below GREEDY_TEMPERATURE)."""
        return self._greedy

    @property
    def has_bias(self) -> bool:
        return self.logit_bias is not None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def is_noop(self) -> bool:
        """Greedy with nothing to apply: the processed row is the raw row."""
        return self._noop


# ---------------------------------------------------------------------------
# Random generators


def make_generator(seed: int | None = None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator: reproducible when ``seed`` is given; otherwise seeded
    from the OS's entropy, so two requests without a seed never share a stream."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


# ---------------------------------------------------------------------------
# Logits processing


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_histories: Sequence[History | None] | None = None,
    output_histories: Sequence[History | None] | None = None,
    grammar_mask: tuple[torch.Tensor | None, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Apply every request's processors to its rows (order in the module docstring).

    ``logits`` is ``[N, V]`` (any float dtype; computed in float32). ``params[i]``,
    ``prompt_histories[i]`` and ``output_histories[i]`` belong to row ``i``; histories
    are needed only for rows with penalties (a ``None`` entry means empty).
    ``grammar_mask`` is ``(row index [P] or None for every row, forbidden bool [P, V])``:
    the grammar masks of the rows that have one (engine/grammar_masks.py). Token ids
    outside ``[0, V)`` in a history are ignored: a model whose embedding table is
    larger than its output head can never produce them (HF does the same). Histories
    are cheapest as 1-D LongTensors on the logits' device: a Python list is converted
    on every call (~0.1 us per token).

    Returns a float32 ``[N, V]`` tensor. When no row has anything to apply it is the
    input itself (no copy if already float32) -- treat the result as read-only. The
    input is never modified, so it can still serve raw logprobs.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    num_rows = logits.shape[0]
    if len(params) != num_rows:
        raise ValueError(f"got {len(params)} SamplingParams for {num_rows} logits rows")
    # Fast path: plain greedy decoding must cost next to nothing per token.
    if grammar_mask is None and all(p._noop for p in params):
        return logits.float()

    if grammar_mask is None and not any(p.has_bias or p.has_penalties for p in params):
        # nothing edits the row before the warpers: read the logits as they are, write a new row
        warped = _warp_on_candidates(logits.float(), params)
        if warped is not None:
            return warped
    scores = logits.to(torch.float32, copy=True)
    _apply_logit_bias(scores, params)
    _apply_penalties(scores, params, prompt_histories, output_histories)
    if grammar_mask is not None:
        rows, forbidden = grammar_mask
        forbidden = forbidden.to(scores.device)
        if rows is None:
            scores.masked_fill_(forbidden, -math.inf)
        else:
            rows = rows.to(scores.device)
            scores[rows] = scores[rows].masked_fill_(forbidden, -math.inf)
    _apply_warpers(scores, params)
    return scores


def _apply_logit_bias(scores: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    rows: list[int] = []
    tokens: list[int] = []
    biases: list[float] = []
    for row, p in enumerate(params):
        if p.logit_bias:
            rows.extend([row] * len(p.logit_bias))
            tokens.extend(p.logit_bias.keys())
            biases.extend(p.logit_bias.values())
    if not rows:
        return
    vocab_size = scores.shape[1]
    if max(tokens) >= vocab_size:
        raise ValueError(f"logit_bias token id {max(tokens)} is outside the vocabulary (size {vocab_size})")
    device = scores.device
    index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
    scores.index_put_(index, torch.tensor(biases, dtype=scores.dtype, device=device), accumulate=True)


def _apply_penalties(
    scores: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_histories: Sequence[History | None] | None,
    output_histories: Sequence[History | None] | None,
) -> None:
    """Repetition, presence and frequency penalties, in place.

    Work is proportional to the histories, not the vocabulary: each history becomes
    flat keys ``row * V + token``; their unique values (with counts) say which
    entries to gather, penalize and write back.
    """
    num_rows, vocab_size = scores.shape
    repetition_rows = [row for row, p in enumerate(params) if p.repetition_penalty != 1.0]
    additive_rows = [row for row, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if not repetition_rows and not additive_rows:
        return
    for name, histories in (("prompt_histories", prompt_histories), ("output_histories", output_histories)):
        if histories is None:
            raise ValueError(f"{name} is required when a row has a repetition/presence/frequency penalty")
        if len(histories) != num_rows:
            raise ValueError(f"got {len(histories)} {name} for {num_rows} logits rows")

    if repetition_rows:
        # Every token seen in prompt or output, once: CTRL divides a positive logit
        # and multiplies a negative one, so a penalty > 1 always lowers a seen token.
        seen = torch.unique(_history_keys(repetition_rows, (prompt_histories, output_histories), scores))
        index = (seen // vocab_size, seen % vocab_size)
        penalty = _per_row(params, "repetition_penalty", scores)[index[0]]
        current = scores[index]
        scores[index] = torch.where(current < 0, current * penalty, current / penalty)

    if additive_rows:
        keys, counts = torch.unique(_history_keys(additive_rows, (output_histories,), scores), return_counts=True)
        index = (keys // vocab_size, keys % vocab_size)
        frequency = _per_row(params, "frequency_penalty", scores)[index[0]]
        presence = _per_row(params, "presence_penalty", scores)[index[0]]
        # OpenAI: mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty;
        # only tokens with c[j] > 0 are listed here.
        scores[index] -= counts.to(scores.dtype) * frequency + presence


def _history_keys(
    rows: list[int], history_sources: tuple[Sequence[History | None], ...], scores: torch.Tensor
) -> torch.Tensor:
    """Flat ``row * V + token`` int64 keys, on ``scores``' device, of every token in the
    given rows' histories (from each source); ids outside ``[0, V)`` are dropped."""
    vocab_size, device = scores.shape[1], scores.device
    tokens = [_as_long_tensor(histories[row], device) for row in rows for histories in history_sources]
    offsets = [row * vocab_size for row in rows for _ in history_sources]
    flat_tokens = torch.cat(tokens)
    keys = torch.cat([piece + offset for piece, offset in zip(tokens, offsets)])
    return keys[(flat_tokens >= 0) & (flat_tokens < vocab_size)]


def _per_row(params: Sequence[SamplingParams], name: str, like: torch.Tensor) -> torch.Tensor:
    """One parameter of every row as a ``[N]`` tensor in ``like``'s dtype and device."""
    return torch.tensor([getattr(p, name) for p in params], dtype=like.dtype, device=like.device)


def _apply_warpers(scores: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    rows = [row for row, p in enumerate(params) if not p._greedy]
    if not rows:
        return
    chosen = [params[row] for row in rows]
    sub = _RowSubset(scores, rows)
    values = sub.values
    warped = _warp_on_candidates(values, chosen)
    if warped is not None:
        sub.store(warped)
        return
    if any(p.temperature != 1.0 for p in chosen):
        values = values / _row_column([p.temperature for p in chosen], scores)
    values = _top_k(values, [p.top_k for p in chosen])
    values = _top_p(values, [p.top_p for p in chosen])
    values = _min_p(values, [p.min_p for p in chosen])
    sub.store(values)


# Rows that all keep at most this many tokens (top-k) are warped on their candidates alone.
SPARSE_TOP_K = 1024


def _warp_on_candidates(values: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor | None:
    """The warped rows (float32, -inf outside the kept candidates) where every row can be
    warped on a few candidates (every row a small top-k, or every row a top-p without
    top-k), else None: the full-width path."""
    width = values.shape[1]
    if any(p._greedy for p in params):
        return None
    if width > SPARSE_TOP_K and all(0 < p.top_k <= SPARSE_TOP_K for p in params):
        warped = _warp_top_k_candidates(values, params)
    elif TOP_P_CANDIDATES and width > TOP_P_CANDIDATES[0] and all(p.top_k == 0 and p.top_p < 1.0 for p in params):
        warped = _warp_top_p_candidates(values, params)
    else:
        return None
    if warped is None:
        return None
    return torch.full(values.shape, -math.inf, dtype=torch.float32, device=values.device).scatter_(1, *warped)


def _log_normalizer(values: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logsumexp(values / temperatures) of each row, [N, 1], with one temporary row. Not
    torch.logsumexp: its exp runs ~30x slower where results are subnormal (most of a row
    at a low temperature); terms below e^-80 of the largest are taken as e^-80, at most
    262,144 e^-80 ~ 5e-30 of the sum."""
    largest = values.amax(dim=-1, keepdim=True)
    terms = (values - largest).div_(temperatures).clamp_min_(-80.0).exp_()
    return largest / temperatures + terms.sum(dim=-1, keepdim=True).log_()


def _warp_top_p_candidates(values: torch.Tensor, params: Sequence[SamplingParams]
                           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Temperature, top-p and min-p for rows that all set top-p and no top-k, on their
    `TOP_P_CANDIDATES` most likely tokens, when those hold the nucleus of every row (else
    None: the full-width path). The softmax's normalizer comes from one logsumexp over the
    row; the candidates' probabilities, HF's rule on them (the mass below them being all
    the rest) and min-p need nothing else of the row. SmolLM2's recommended T 0.2 / top-p
    0.9 cost ~0.4 ms a row on its 49,152 tokens through the full-width path (a copy, a
    division, a softmax, a sum, a store per row): 7% of a decode step."""
    width = values.shape[1]
    temperatures = _row_column([p.temperature for p in params], values)
    normalizer = _log_normalizer(values, temperatures)
    drop_mass = _row_column([1.0 - p.top_p for p in params], values)
    for size in TOP_P_CANDIDATES:
        if size >= width:
            break
        found = _largest(values, size)
        candidates = found[0] / temperatures
        ascending = (candidates - normalizer).exp().flip(-1)
        rest_mass = (1.0 - ascending.sum(dim=-1, keepdim=True)).clamp_min(0.0)
        if bool((rest_mass <= drop_mass).all()):
            remove = _top_p_remove_sorted(ascending, drop_mass, rest_mass).flip(-1)
            kept = _min_p(candidates.masked_fill(remove, -math.inf), [p.min_p for p in params])
            return found[1], kept
    return None


def _warp_top_k_candidates(values: torch.Tensor, params: Sequence[SamplingParams]
                           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Temperature, top-k, top-p and min-p for rows that all set a small top-k, computed on
    the largest top-k candidates instead of the whole vocabulary: every other token is -inf
    after top-k, so it has probability 0 in top-p's and min-p's softmax and changes nothing.
    The same stages run in the same order on those columns. Returns (their columns, their
    warped values), to scatter into a row of -inf. On Gemma's 262,144 tokens with its
    recommended top-k 64 and top-p 0.95 the full-width path cost 3.6 ms a row (two full
    top-ks, a full softmax, full-width masks); this costs one top-k. None when a token
    outside the candidates ties a row's k-th value (top-k keeps ties, as HF does): then the
    full-width path runs."""
    top_ks = [p.top_k for p in params]
    found = _largest(values, max(top_ks), top_ks)
    if found is None:
        return None
    candidates, indices = found
    if any(p.temperature != 1.0 for p in params):
        candidates = candidates / _row_column([p.temperature for p in params], values)
    candidates = _top_k(candidates, top_ks)
    candidates = _top_p(candidates, [p.top_p for p in params])
    candidates = _min_p(candidates, [p.min_p for p in params])
    return indices, candidates


def _largest(values: torch.Tensor, k: int, top_ks: list[int] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the k largest values of each row, largest first; their columns), like torch.topk.
    With `top_ks`: None when a value outside them ties a row's top_ks[r]-th largest (top-k
    keeps ties: the full-width path decides then).

    Per row, through block maxima: the k-th largest block maximum m is a lower bound on the
    k-th largest value (k blocks reach it), so every candidate lies in a block whose
    maximum is >= m, and one top-k over those blocks finds them. On a 262,144-entry row
    that is ~0.09 ms against torch.topk's ~0.44 ms (k 64). Rows too short for 16 k blocks
    of a size that divides them take torch.topk and a full-width tie count."""
    width = values.shape[1]
    block = next((b for b in (256, 128, 64, 32, 16) if width % b == 0 and width // b >= 16 * k), None)
    if block is None:
        top = torch.topk(values, k, dim=-1)
        if top_ks is not None:
            kth = top.values.gather(1, torch.tensor(top_ks, device=values.device).sub_(1).unsqueeze(1))
            if bool(((values >= kth).sum(dim=-1) > (top.values >= kth).sum(dim=-1)).any()):
                return None
        return top.values, top.indices
    out_values = values.new_empty(values.shape[0], k)
    out_columns = torch.empty(values.shape[0], k, dtype=torch.long, device=values.device)
    for r in range(values.shape[0]):
        blocks = values[r].reshape(-1, block)  # a view where the row is contiguous
        maxima = blocks.amax(dim=-1)
        chosen = (maxima >= torch.topk(maxima, k).values[-1]).nonzero().squeeze(1)
        pool = blocks.index_select(0, chosen).flatten()
        top = torch.topk(pool, k)
        if top_ks is not None:
            kth = top.values[top_ks[r] - 1]
            if int((pool >= kth).sum()) > int((top.values >= kth).sum()):
                return None  # every value >= kth is in the pool: outside it no block reaches m <= kth
        out_values[r] = top.values
        out_columns[r] = chosen[top.indices // block] * block + top.indices % block
    return out_values, out_columns


def _top_k(values: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab_size = values.shape[1]
    enabled = [0 < k < vocab_size for k in top_ks]
    if not any(enabled):
        return values
    # One topk with the largest k serves every row: row r's threshold is its k-th value.
    ks = [k if on else 1 for k, on in zip(top_ks, enabled)]
    largest = torch.topk(values, max(ks), dim=-1).values
    kth_index = torch.tensor(ks, device=values.device).sub_(1).unsqueeze(1)
    threshold = largest.gather(1, kth_index)
    if not all(enabled):
        # Rows with top-k off get a threshold of -inf: nothing is below it.
        off = torch.tensor([not on for on in enabled], device=values.device).unsqueeze(1)
        threshold = threshold.masked_fill(off, -math.inf)
    # Strict "<" keeps every token tied with the k-th value, as HF does.
    return values.masked_fill(values < threshold, -math.inf)


# Candidate-set sizes tried before sorting the whole vocabulary for top-p: a full sort
# costs ~4 ms (50k vocab) to ~13 ms (152k) per row on CPU, topk(256) ~0.2 ms, and the
# nucleus of a language model's next-token distribution is usually far smaller.
TOP_P_CANDIDATES = (256, 4096)


def _top_p(values: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    active = [row for row, p in enumerate(top_ps) if p < 1.0]
    if not active:
        return values
    if len(active) < len(top_ps):
        index = torch.tensor(active, device=values.device)
        kept = _top_p_rows(values.index_select(0, index), [top_ps[row] for row in active])
        return values.index_copy(0, index, kept)
    return _top_p_rows(values, top_ps)


def _top_p_rows(values: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """HF's top-p rule: sort ascending, drop every token whose cumulative mass (its own
    plus all less likely tokens) is <= 1 - p; the most likely token always stays.

    The cumulative mass of a token depends only on the tokens below it, so if the
    ``size`` most likely tokens already hold mass >= p, every other token is dropped
    and only those candidates need sorting (``topk`` returns them sorted).
    """
    vocab_size = values.shape[1]
    drop_mass = _row_column([1.0 - p for p in top_ps], values)
    probs = values.softmax(dim=-1)
    for size in TOP_P_CANDIDATES:
        if size >= vocab_size:
            continue
        top_values, top_indices = _largest(values, size)
        candidate_probs = probs.gather(1, top_indices).flip(-1)  # ascending
        rest_mass = probs.sum(dim=-1, keepdim=True) - candidate_probs.sum(dim=-1, keepdim=True)
        if bool((rest_mass <= drop_mass).all()):
            remove = _top_p_remove_sorted(candidate_probs, drop_mass, rest_mass).flip(-1)
            kept = torch.full_like(values, -math.inf)
            return kept.scatter_(1, top_indices, top_values.masked_fill(remove, -math.inf))
    sorted_values, sorted_indices = torch.sort(values, descending=False)
    remove_sorted = _top_p_remove_sorted(sorted_values.softmax(dim=-1), drop_mass)
    remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
    return values.masked_fill(remove, -math.inf)


def _top_p_remove_sorted(
    ascending_probs: torch.Tensor, drop_mass: torch.Tensor, mass_below: torch.Tensor | float = 0.0
) -> torch.Tensor:
    """The removal mask for rows of probabilities sorted ascending; ``mass_below`` is
    the mass of the tokens left out below the first column."""
    cumulative = ascending_probs.cumsum(dim=-1) + mass_below
    remove = cumulative <= drop_mass
    remove[:, -1] = False
    return remove


def _min_p(values: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    if all(p == 0.0 for p in min_ps):
        return values
    # HF's rule "prob < min_p * max prob", taken to logit space (divide by the shared
    # softmax denominator, take logs): "logit < max logit + log(min_p)". Same set up
    # to float rounding, without a softmax. log(0) = -inf keeps every token.
    log_min_p = torch.tensor(
        [math.log(p) if p > 0 else -math.inf for p in min_ps], dtype=values.dtype, device=values.device
    ).unsqueeze(1)
    # The most likely token is never below max + log(min_p) (log(min_p) < 0).
    return values.masked_fill(values < values.amax(dim=-1, keepdim=True) + log_min_p, -math.inf)


class _RowSubset:
    """A view-like handle on some rows of a batch: no copy when it is every row."""

    def __init__(self, scores: torch.Tensor, rows: list[int]):
        self.scores = scores
        self.all_rows = len(rows) == scores.shape[0]
        self.index = None if self.all_rows else torch.tensor(rows, device=scores.device)
        self.values = scores if self.all_rows else scores.index_select(0, self.index)

    def store(self, values: torch.Tensor) -> None:
        if self.all_rows:
            if values is not self.scores:
                self.scores.copy_(values)
        else:
            self.scores.index_copy_(0, self.index, values)


def _row_column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """Per-row scalars as an ``[n, 1]`` column in ``like``'s dtype and device."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _as_long_tensor(history: History | None, device: torch.device) -> torch.Tensor:
    if history is None:
        return torch.empty(0, dtype=torch.long, device=device)
    if isinstance(history, torch.Tensor):
        return history.detach().reshape(-1).to(device=device, dtype=torch.long)
    return torch.as_tensor(history, dtype=torch.long).reshape(-1).to(device)


# ---------------------------------------------------------------------------
# Sampling


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first index on ties (NaN counts as the largest, as argmax has
    it), by `max(dim=-1).indices`: the same indices as `argmax(dim=-1)` (tests/test_sampling.py
    compares them on ties, NaN and infinities), for about a third of its time on CPU: on
    Gemma's 262,144-entry rows 11 rows took 2.2 ms by argmax and 0.8 by max, every greedy
    step, a step of 4 rows of gemma3-270m being ~45 ms."""
    return logits.max(dim=-1).indices


def sampling_probs(processed: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The exact distribution :func:`sample` draws each row from: ``softmax(processed)``
    for sampled rows, a point mass at the argmax for greedy rows. This is the p (target)
    or q (draft) of speculative verification."""
    probs = processed.float().softmax(dim=-1)
    greedy_rows = [row for row, p in enumerate(params) if p._greedy]
    if greedy_rows:
        index = torch.tensor(greedy_rows, device=processed.device)
        one_hot = torch.zeros_like(probs[index])
        one_hot.scatter_(1, greedy_tokens(processed[index]).unsqueeze(1), 1.0)
        probs.index_copy_(0, index, one_hot)
    return probs


def sample(
    processed: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Draw one token per row of ``processed`` (the output of :func:`process_logits`).

    Greedy rows take the argmax (first index on ties) and need no generator. Every
    other row draws exactly from ``softmax(processed row)`` with its request's
    generator. Rows that share a generator (one request's verify positions) are drawn
    in one call, in row order, and no other row touches that generator, so a seeded
    request's tokens do not depend on which requests share its batch.
    """
    if len(params) != processed.shape[0] or len(generators) != processed.shape[0]:
        raise ValueError(
            f"need one SamplingParams and one generator per row: {processed.shape[0]} rows, "
            f"{len(params)} params, {len(generators)} generators"
        )
    greedy = [p._greedy for p in params]
    if all(greedy):
        return greedy_tokens(processed)
    rows_by_generator: dict[int, tuple[torch.Generator, list[int]]] = {}
    sampled: list[int] = []
    for row, (p, generator) in enumerate(zip(params, generators)):
        if p._greedy:
            continue
        if generator is None:
            raise ValueError(f"row {row} samples (temperature {p.temperature}) but has no generator")
        rows_by_generator.setdefault(id(generator), (generator, []))[1].append(row)
        sampled.append(row)

    # Each generator gives its rows' uniforms in one call, in row order (what makes a seeded
    # request independent of its batch mates); then one softmax and one draw for all rows: a
    # step of 8 sampled rows of 262,144 logits spent 3.4 ms in eight separate ones.
    place = {row: i for i, row in enumerate(sampled)}
    u = torch.empty((len(sampled), 1), dtype=torch.float64)
    for generator, rows in rows_by_generator.values():
        drawn = torch.rand((len(rows), 1), generator=generator, dtype=torch.float64, device=generator.device)
        u[[place[row] for row in rows]] = drawn.cpu()
    everyone = len(sampled) == processed.shape[0]
    index = None if everyone else torch.tensor(sampled, device=processed.device)
    drawn_tokens = draw_rows((processed if everyone else processed.index_select(0, index)).float(), u)
    if everyone:
        return drawn_tokens
    # argmax costs about as much as a draw on CPU: run it only where it is needed.
    return greedy_tokens(processed).index_copy_(0, index, drawn_tokens)


# A row whose finite entries lie in at most this many blocks of `DRAW_SCAN_BLOCK` columns
# (what a top-k, top-p or min-p cut leaves: every other entry -inf) is drawn from those blocks
# alone: `draw_rows`.
COMPACT_BLOCKS = 64
DRAW_SCAN_BLOCK = 256


def draw_rows(rows: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One exact draw per row from ``softmax(row)``, row r with the uniform ``uniforms[r]``
    ([rows, 1] float64 in [0, 1)).

    A row cut to few tokens (every entry outside a few blocks of columns -inf: a top-k, top-p
    or min-p cut) is drawn from those blocks alone: block maxima find them in one read of the
    row, and the inverse CDF of their weights exp(x - max) runs in float64, in column order
    (a -inf entry weighs 0 and is never drawn). The full-width route ran a softmax over the
    whole row and wrote a new one: with datagen's 64 rows of Gemma's 262,144 entries that was
    ~1 ms a row, a fifth of a step. Other rows take it (softmax, `inverse_cdf_draw`), and so
    does every row of a vocabulary under 4,096 tokens. Both are the exact inverse CDF of the
    row's distribution, and which one a row takes depends on the row alone, so a seeded row
    draws the same token whatever rows share its batch."""
    n, width = rows.shape
    if width < 16 * DRAW_SCAN_BLOCK:  # a small vocabulary: the full width costs little, the scan more
        return _draw_full_width(rows, uniforms)
    block = DRAW_SCAN_BLOCK
    whole = width // block * block
    maxima = rows[:, :whole].reshape(n, -1, block).amax(dim=-1)
    if whole < width:
        maxima = torch.cat([maxima, rows[:, whole:].amax(dim=1, keepdim=True)], dim=1)
    live = maxima != -math.inf  # NaN counts as live
    blocks = live.sum(dim=1)
    compact = blocks <= COMPACT_BLOCKS
    out = torch.empty(n, dtype=torch.long, device=rows.device)
    if not bool(compact.all()):
        wide = (~compact).nonzero().squeeze(1)
        out[wide] = _draw_full_width(rows.index_select(0, wide), uniforms[wide])
        if not bool(compact.any()):
            return out
    picked = compact.nonzero().squeeze(1)
    blocks = blocks[picked]
    at, which = live.index_select(0, picked).nonzero(as_tuple=True)  # row-major: blocks ascending
    slot = torch.arange(at.shape[0], device=rows.device) - (blocks.cumsum(0) - blocks)[at]
    columns = which[:, None] * block + torch.arange(block, device=rows.device)  # [live blocks, block]
    inside = columns < width
    columns = columns.clamp_max_(width - 1)
    values = rows[picked[at][:, None], columns].double().masked_fill_(~inside, -math.inf)
    span = int(blocks.max()) * block
    laid = torch.full((picked.shape[0], span // block, block), -math.inf, dtype=torch.float64, device=rows.device)
    laid[at, slot] = values
    cols = torch.zeros((picked.shape[0], span // block, block), dtype=torch.long, device=rows.device)
    cols[at, slot] = columns
    laid, cols = laid.view(-1, span), cols.view(-1, span)
    cdf = (laid - laid.amax(dim=1, keepdim=True)).exp_().cumsum_(dim=1)
    total = cdf[:, -1:]
    # strictly below the total, so some entry's cumulative weight exceeds it; one that weighs
    # 0 (-inf, or underflowed) never does first: the CDF does not rise there
    target = torch.minimum(uniforms[picked] * total, torch.nextafter(total, torch.zeros_like(total)))
    entry = torch.searchsorted(cdf, target, right=True).clamp_max_(span - 1)
    out[picked] = cols.gather(1, entry).squeeze(1)
    return out


def _draw_full_width(rows: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    # torch's softmax, not exp(x - max): its exp stays fast where most of a row underflows
    # (a low temperature), where torch.exp took 3-30x longer (stage 10)
    return inverse_cdf_draw(rows.softmax(dim=-1), uniforms=uniforms)


# Entries per block of the two-level CDF below: on Gemma's 262,144-entry rows a float64
# cumsum over the whole row cost 0.2-0.8 ms (more with a fresh 2 MB buffer per call); block
# sums plus one block's cumsum touch the row once, vectorized, and allocate ~2 KB.
DRAW_BLOCK = 1024


def inverse_cdf_draw(weights: torch.Tensor, generator: torch.Generator | None = None, block: int = DRAW_BLOCK,
                     uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One exact draw per row of ``weights`` (nonnegative, any positive total) from a
    single uniform per row: ``uniforms`` ([rows, 1] float64 in [0, 1)) when given, else
    drawn from ``generator``.

    Inverse CDF: the token is the first index whose cumulative weight exceeds ``u * total``.
    It needs one random number per row where ``torch.multinomial`` or an exponential race
    needs one per vocabulary entry. The CDF has two levels: the sums of blocks of ``block``
    entries, accumulated in float64, pick the block, and a float64 cumsum inside that block
    picks the entry, so no entry's chance is rounded away. An entry of weight 0 is never
    chosen: the CDF does not rise at it, and where rounding leaves the target past the
    chosen block's own sum the block's last positive entry is taken.
    """
    rows, width = weights.shape
    whole = width // block * block
    # Block sums in the weights' own precision (pairwise, ~1e-7 relative: float32 softmax's
    # own rounding), accumulated across blocks in float64.
    sums = weights[:, :whole].reshape(rows, -1, block).sum(dim=-1)
    if whole < width:
        sums = torch.cat([sums, weights[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    cdf = sums.double().cumsum_(dim=-1)
    total = cdf[:, -1:]
    u = uniforms if uniforms is not None else \
        torch.rand((rows, 1), generator=generator, dtype=torch.float64, device=generator.device)
    # Keep the target strictly below the total, so some block always exceeds it.
    target = torch.minimum(u.to(weights.device) * total, torch.nextafter(total, torch.zeros_like(total)))
    chosen = torch.searchsorted(cdf, target, right=True).clamp_max_(cdf.shape[1] - 1)
    below = torch.where(chosen > 0, cdf.gather(1, (chosen - 1).clamp_min(0)), torch.zeros_like(target))
    columns = chosen * block + torch.arange(block, device=weights.device)
    inside = columns < width
    segment = weights.gather(1, columns.clamp_max(width - 1)).double().masked_fill_(~inside, 0.0)
    entry = torch.searchsorted(segment.cumsum(dim=-1), target - below, right=True)
    last_positive = (torch.arange(block, device=weights.device) * (segment > 0)).amax(dim=-1, keepdim=True)
    entry = torch.where(entry >= block, last_positive, entry)
    return (chosen * block + entry).squeeze(1)


# ---------------------------------------------------------------------------
# Logprobs


class TokenLogprobs(NamedTuple):
    """Logprobs of the chosen tokens and of each row's ``k`` most likely tokens."""

    chosen: torch.Tensor  # [N] float32: logprob of tokens[i] in row i
    top_ids: torch.Tensor  # [N, k] int64, most likely first
    top_logprobs: torch.Tensor  # [N, k] float32


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> TokenLogprobs:
    """Logprobs of ``tokens`` and the top ``k`` alternatives, per row.

    Pass the *raw* model logits: like vLLM's default (``raw_logprobs``), the reported
    logprobs are the model's own distribution, before bias, penalties, temperature or
    truncation. Passing processed rows instead gives the sampled distribution's
    logprobs (``-inf`` for removed tokens). Rows with different ``SamplingParams.logprobs``
    share one call with the largest ``k``; slice each row's prefix.
    """
    if not _is_int(k) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    log_probs = logits.float().log_softmax(dim=-1)
    chosen = log_probs.gather(1, tokens.reshape(-1, 1).to(device=logits.device, dtype=torch.long)).squeeze(1)
    top = torch.topk(log_probs, min(k, log_probs.shape[1]), dim=-1)
    return TokenLogprobs(chosen=chosen, top_ids=top.indices, top_logprobs=top.values)
