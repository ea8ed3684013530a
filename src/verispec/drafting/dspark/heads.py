"""DSpark's light sequential heads and its confidence head (paper Eq 5-7).

All of them start from W1[x_prev], a rank-r embedding of the previous token (the anchor
for block slot 0, the drafted token after it), and add a bias W2 . z to the parallel
backbone's base logits of the slot:

    vanilla Markov (Eq 5)   z = W1[x_prev]
    gated                   z = sigmoid(G [h; W1[x_prev]]) * W1[x_prev]          (DeepSpec extra)
    RNN (Eq 6)              z_in = [s; W1[x_prev]; h];  g, c, o = split(J z_in)
                            s' = sigmoid(g) * s + (1 - sigmoid(g)) * tanh(c);    z = tanh(o)
                            (the bias uses o from the OLD state; s starts at 0 per block)
    confidence (Eq 7)       c = sigmoid(w . [h; W1[x_prev]] + b)  (or w . h + b), a logit here

Parameter names are DeepSpec's (`markov_head.markov_w1`, `markov_w2` as a Linear whose
weight is [V_out, r], `gate_proj`, `joint_proj` split gate|candidate|output,
`confidence_head.proj`), so its checkpoints load as they are. V_out is the draft head's
vocabulary: the target's, or a subset of it (config.draft_vocab_size).
"""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    kind = "vanilla"

    def __init__(self, vocab_size: int, rank: int, out_size: int, hidden_size: int):
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, out_size, bias=False)

    def prev_embedding(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev_ids.long())

    def initial_state(self, leading: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        return None

    def latent(self, prev_emb: torch.Tensor, h: torch.Tensor, state):
        """(z, next state) for one block slot; the slot's bias is markov_w2(z)."""
        return prev_emb, state

    def step(self, prev_emb: torch.Tensor, h: torch.Tensor, state):
        """(bias over the draft vocabulary, next state) for one block slot."""
        z, state = self.latent(prev_emb, h, state)
        return self.markov_w2(z), state

    def block_bias(self, prev_emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Teacher forcing (training): every slot's bias at once, [..., gamma, V_out] from
        prev_emb [..., gamma, r] and h [..., gamma, H]; the (small) recurrence runs slot by
        slot, the projection to the vocabulary once."""
        state = self.initial_state(prev_emb.shape[:-2], h)
        latents = []
        for j in range(prev_emb.shape[-2]):
            z, state = self.latent(prev_emb[..., j, :], h[..., j, :], state)
            latents.append(z)
        return self.markov_w2(torch.stack(latents, dim=-2))


class GatedMarkovHead(MarkovHead):
    kind = "gated"

    def __init__(self, vocab_size: int, rank: int, out_size: int, hidden_size: int):
        super().__init__(vocab_size, rank, out_size, hidden_size)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def latent(self, prev_emb, h, state):
        gate = torch.sigmoid(self.gate_proj(torch.cat([h, prev_emb.to(h.dtype)], dim=-1))).to(prev_emb.dtype)
        return gate * prev_emb, state


class RNNHead(MarkovHead):
    kind = "rnn"

    def __init__(self, vocab_size: int, rank: int, out_size: int, hidden_size: int):
        super().__init__(vocab_size, rank, out_size, hidden_size)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def initial_state(self, leading, like):
        return torch.zeros(*leading, self.rank, dtype=like.dtype, device=like.device)

    def latent(self, prev_emb, h, state):
        gate, candidate, output = self.joint_proj(torch.cat([state, prev_emb.to(h.dtype), h], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        new_state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return torch.tanh(output).to(prev_emb.dtype), new_state


HEADS = {"vanilla": MarkovHead, "gated": GatedMarkovHead, "rnn": RNNHead}


class ConfidenceHead(nn.Module):
    """Predicts P(draft slot k accepted | slots before it accepted), as a logit."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1).float()
