"""Sequential Temperature Scaling (STS, DSpark paper §3.2.1): calibrated prefix survival.

The confidence head predicts c_k = P(draft k accepted | drafts before it accepted), so the
probability that a round keeps its first k drafts is the product a_k = prod_{i<=k} c_i.
STS calibrates that product, not each c_k alone: left to right, position k gets the
temperature T_k (c_k = sigmoid(logit_k / T_k)) that minimizes the expected calibration
error of a_k against "the first k drafts were all accepted", on held-out live rounds,
with the temperatures of earlier positions held fixed. A 1-D grid search, as the paper
says; temperature scaling is order-preserving, so it never changes which draft a
threshold on c_k alone would keep first.

Oracle: tests/test_sts.py draws rounds from a known model whose logits are a known
temperature away from the truth and checks that STS finds it (and that the ECE after is
at sampling-noise level), and checks `ece` against a plain per-bin loop. DeepSpec does
not implement STS; this module follows the paper's text (spec §1.7).

Rounds are (confidence logits of the whole block, drafts accepted, proposal length): a
position k counts only in rounds whose proposal reached it (calibrate drafts full
blocks, so only rounds cut by max_tokens lose positions).
"""

from __future__ import annotations

import math

import torch

BINS = 20
# log-spaced from 1/8 to 8 (121 points, ratio ~1.035 apart), and 1 exactly
TEMPERATURE_GRID = sorted({round(math.exp(math.log(8.0) * (i / 60 - 1)), 6) for i in range(121)} | {1.0})


def ece(probs: torch.Tensor, labels: torch.Tensor, bins: int = BINS) -> float:
    """Expected calibration error (Naeini et al.): equal-width bins over [0, 1], per bin
    |mean predicted - observed rate|, weighted by the bin's share of the samples."""
    n = probs.numel()
    if n == 0:
        return float("nan")
    index = (probs.double() * bins).long().clamp_(0, bins - 1)
    count = torch.bincount(index, minlength=bins).double()
    pred = torch.bincount(index, weights=probs.double(), minlength=bins)
    hit = torch.bincount(index, weights=labels.double(), minlength=bins)
    return float((pred - hit).abs().sum() / n)


def ece_floor(probs: torch.Tensor, bins: int = BINS, draws: int = 20, seed: int = 0) -> float:
    """The ECE a perfectly calibrated predictor shows on this many samples: the mean ECE
    of these predictions against labels drawn from them. With a few thousand rounds it is
    1-4%, so a measured ECE near it is sampling noise, not miscalibration."""
    if probs.numel() == 0:
        return float("nan")
    g = torch.Generator().manual_seed(seed)
    p = probs.double()
    return sum(ece(p, torch.rand(p.shape, generator=g, dtype=torch.float64) < p, bins) for _ in range(draws)) / draws


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (the Mann-Whitney statistic, ties counted half)."""
    pos, neg = scores[labels.bool()].double(), scores[~labels.bool()].double()
    if pos.numel() == 0 or neg.numel() == 0:
        return float("nan")
    ranks = _average_ranks(torch.cat([pos, neg]))
    return float((ranks[: pos.numel()].sum() - pos.numel() * (pos.numel() + 1) / 2) / (pos.numel() * neg.numel()))


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(x)
    sorted_x = x[order]
    ranks = torch.empty_like(x)
    i, n = 0, x.numel()
    values = sorted_x.tolist()
    while i < n:
        j = i
        while j + 1 < n and values[j + 1] == values[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


class Rounds:
    """Live rounds as tensors: logits [R, g], accepted [R], proposal length [R]."""

    def __init__(self, rounds: list[tuple[list[float], int, int]], positions: int):
        kept = [(lg[:positions], a, p) for lg, a, p in rounds if len(lg) >= positions]
        self.positions = positions
        self.logits = torch.tensor([lg for lg, _, _ in kept], dtype=torch.float64).reshape(-1, positions)
        self.accepted = torch.tensor([a for _, a, _ in kept], dtype=torch.long)
        self.proposal = torch.tensor([p for _, _, p in kept], dtype=torch.long)

    def __len__(self) -> int:
        return self.accepted.numel()

    def survival(self, temperatures: list[float] | None) -> torch.Tensor:
        """a_k per round and position under these temperatures (None: identity)."""
        t = torch.ones(self.positions, dtype=torch.float64) if temperatures is None else \
            torch.tensor(temperatures, dtype=torch.float64)
        return torch.cumprod(torch.sigmoid(self.logits / t), dim=1)

    def tested(self, k: int) -> torch.Tensor:
        """Rounds whose proposal reached position k (0-based)."""
        return self.proposal > k

    def survived(self, k: int) -> torch.Tensor:
        """Whether the first k + 1 drafts were all accepted."""
        return self.accepted > k


def fit_sts(rounds: Rounds, grid: list[float] = TEMPERATURE_GRID, bins: int = BINS) -> list[float]:
    """Per-position temperatures, left to right, each the grid point minimizing the ECE of
    the cumulative product with the earlier positions' temperatures fixed (ties: the one
    closest to 1, so a position without evidence keeps its raw confidence)."""
    temperatures: list[float] = []
    prefix = torch.ones(len(rounds), dtype=torch.float64)
    by_closeness = sorted(grid, key=lambda t: abs(math.log(t)))
    for k in range(rounds.positions):
        mask = rounds.tested(k)
        labels = rounds.survived(k)[mask]
        logits, before = rounds.logits[mask, k], prefix[mask]
        best_t, best = 1.0, float("inf")
        if mask.any():
            for t in by_closeness:
                e = ece(before * torch.sigmoid(logits / t), labels, bins)
                if e < best - 1e-12:
                    best_t, best = t, e
        temperatures.append(best_t)
        prefix = prefix * torch.sigmoid(rounds.logits[:, k] / best_t)
    return temperatures


def report(rounds: Rounds, temperatures: list[float] | None, bins: int = BINS) -> list[dict]:
    """Per position: rounds tested, survival rate, ECE and AUC of the cumulative product,
    the ECE a calibrated predictor would show on as many rounds (`ece_floor`), and the
    reliability bins (mean predicted, observed, count)."""
    survival = rounds.survival(temperatures)
    out = []
    for k in range(rounds.positions):
        mask = rounds.tested(k)
        p, y = survival[mask, k], rounds.survived(k)[mask]
        index = (p * bins).long().clamp(0, bins - 1)
        table = []
        for b in range(bins):
            members = index == b
            if members.any():
                table.append({"bin": [b / bins, (b + 1) / bins], "n": int(members.sum()),
                              "predicted": float(p[members].mean()), "observed": float(y[members].double().mean())})
        out.append({"position": k, "tested": int(mask.sum()),
                    "survival": float(y.double().mean()) if y.numel() else None,
                    "ece": ece(p, y, bins), "ece_floor": ece_floor(p, bins), "auc": auc(p, y), "bins": table})
    return out
