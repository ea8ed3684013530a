"""The DSpark drafter: a DFlash parallel block backbone with multi-layer KV injection,
a light sequential head and a confidence head (paper §2.2, §3; dspark-spec.md §2-4).

Backbone (Eq 2-3). The target's hidden states from `target_layer_ids` are concatenated
per position, projected by `fc` and normalized once (`hidden_norm`): that context H_ctx
is shared by every draft layer, which projects it with its own k_proj / v_proj (then
k-norm and RoPE at the context's absolute positions; no input norm on the context) and
puts it in front of the block's own K/V. The block is [anchor, MASK x (gamma - 1)] at
positions anchor .. anchor + gamma - 1; its queries attend bidirectionally to the whole
block and to context strictly before the anchor. Slot j predicts the token at position
anchor + j + 1; in training its target distribution is the target's next-token
distribution at position anchor + j.

Draft layers follow the target family's flavour (models/config.py ModelArgs of the
drafter config, which is the target's config with DSpark fields): q/k norms (qwen3,
gemma3/4), q/k/v bias (qwen2), (1 + w) norms, sandwich norms, sqrt(H) embedding scale,
query_pre_attn_scalar, gelu-tanh and final-logit soft-cap (gemma3, soft-cap applied to
the base logits before the Markov bias, as DeepSpec does for Gemma); gemma4 (DeepSpec's
Gemma4DSparkModel): the target's global-layer geometry (global head size, its KV heads,
V = the raw k projection when attention_k_eq_v), a weightless v-norm, attention scale 1,
proportional partial RoPE, `x * w` norms and a stored scalar per layer.

Two ways through the backbone, one set of layer math:
* training (training/dspark/forward.py): sequences with sampled anchor blocks and a
  dense boolean mask;
* decoding, here: per row an incremental `ContextCache` of the projected context K/V
  (only the context is cached; the block's K/V are recomputed every round, which is
  DeepSpec's "crop to start"), rows packed for projections and MLPs, attention per row
  (`draft_hidden`), then the sequential head slot by slot (`propose`). On CPU the
  linear layers are pre-packed for oneDNN (drafting/dspark/packing.py).

Parameter names are DeepSpec's, so its checkpoints load with a plain state dict.
Checked by tests/test_dspark.py against tests/fixtures/deepspec-tiny and
deepspec-gemma4-tiny (module outputs, loss terms, greedy traces round by round).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verispec.models.config import ModelArgs
from verispec.models.decoder import RotaryTable, apply_rope
from verispec.drafting.dspark.config import DSparkConfig
from verispec.drafting.dspark.heads import HEADS, ConfidenceHead


class RMSNorm(nn.Module):
    """transformers' RMSNorm conventions: llama/qwen `w * norm(x)` (normalized in float32,
    cast back, then scaled); gemma3 `norm(x) * (1 + w)` in float32, cast once; gemma4
    `norm(x) * w` in float32, cast once (`in_f32` without an offset)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0, in_f32: bool = False):
        super().__init__()
        self.eps, self.offset, self.in_f32 = eps, offset, in_f32 or bool(offset)
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    @classmethod
    def of(cls, dim: int, args: ModelArgs) -> "RMSNorm":
        return cls(dim, args.rms_norm_eps, args.norm_offset, args.norm_in_f32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), x.shape[-1:], None, self.eps)
        if self.in_f32:
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


class DraftAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        # every draft layer is a global one: gemma4's global head size, KV heads and K = V
        H, D = args.hidden_size, args.head_dim_at(0)
        self.heads, self.kv_heads, self.head_dim = args.num_heads, args.kv_heads_at(0), D
        self.k_eq_v, self.v_norm, self.eps = args.k_eq_v_at(0), args.v_norm, args.rms_norm_eps
        self.q_proj = nn.Linear(H, self.heads * D, bias=args.attention_bias)
        self.k_proj = nn.Linear(H, self.kv_heads * D, bias=args.attention_bias)
        if not self.k_eq_v:  # gemma4 with attention_k_eq_v: V is the raw k_proj output, no v_proj
            self.v_proj = nn.Linear(H, self.kv_heads * D, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.heads * D, H, bias=args.o_proj_bias)
        self.qk_norm = args.qk_norm
        if args.qk_norm:
            self.q_norm = RMSNorm.of(D, args)
            self.k_norm = RMSNorm.of(D, args)
        self.scale = args.attn_scale if args.attn_scale is not None else D**-0.5

    def keys_values(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., N, H] -> K (normed, rotated), V (gemma4: normed without a weight): [..., N, kv_heads, D]."""
        k = self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        v = k if self.k_eq_v else self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        if self.v_norm:
            v = F.rms_norm(v.float(), v.shape[-1:], None, self.eps).to(v.dtype)
        if self.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k, *rope), v

    def queries(self, u: torch.Tensor, rope) -> torch.Tensor:
        q = self.q_proj(u).unflatten(-1, (self.heads, self.head_dim))
        if self.qk_norm:
            q = self.q_norm(q)
        return apply_rope(q, *rope)

    def attend_block(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Decoding: a block's queries q [g, heads, D] over one row's keys and values
        [kv_heads, S, D], every key visible -> [g, heads * D]. Two batched matmuls over the
        query heads of each KV head: torch's SDPA takes its math path for grouped heads on
        CPU, twice as slow at these sizes (checked against it by tests/test_dspark.py's
        traces, which decode through here)."""
        g, heads, D = q.shape
        kv = keys.shape[0]
        group = heads // kv
        grouped = q.view(g, kv, group, D).permute(1, 2, 0, 3).reshape(kv, group * g, D)
        weights = torch.bmm(grouped * self.scale, keys.transpose(1, 2)).softmax(dim=-1)
        out = torch.bmm(weights, values)  # [kv, group * g, D]
        return out.view(kv, group, g, D).permute(2, 0, 1, 3).reshape(g, heads * D)

    def attend(self, q, k, v, mask=None) -> torch.Tensor:
        """q [..., Q, heads, D], k/v [..., K, kv_heads, D] -> [..., Q, heads * D]."""
        out = F.scaled_dot_product_attention(
            q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2),
            attn_mask=mask, scale=self.scale, enable_gqa=True, is_causal=False,
        )
        return out.transpose(-3, -2).flatten(-2)


class DraftMLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        H, I = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=args.mlp_bias)
        self.up_proj = nn.Linear(H, I, bias=args.mlp_bias)
        self.down_proj = nn.Linear(I, H, bias=args.mlp_bias)
        self.act = F.silu if args.activation == "silu" else (lambda x: F.gelu(x, approximate="tanh"))

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        H = args.hidden_size
        self.self_attn = DraftAttention(args)
        self.mlp = DraftMLP(args)
        self.input_layernorm = RMSNorm.of(H, args)
        self.post_attention_layernorm = RMSNorm.of(H, args)
        self.sandwich = args.sandwich_norms
        if self.sandwich:  # gemma: post_attention_layernorm normalizes the attention output
            self.pre_feedforward_layernorm = RMSNorm.of(H, args)
            self.post_feedforward_layernorm = RMSNorm.of(H, args)
        self.scaled = args.layer_scalar
        if self.scaled:  # gemma4: a stored (never trained) scale of the layer's output
            self.register_buffer("layer_scalar", torch.ones(1))

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual around attention, then the MLP block (then gemma4's layer scalar)."""
        out = self.self_attn.o_proj(attn_out)
        if self.sandwich:
            x = x + self.post_attention_layernorm(out)
            x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        else:
            x = x + out
            x = x + self.mlp(self.post_attention_layernorm(x))
        return x * self.layer_scalar if self.scaled else x


class ContextCache:
    """One row's projected context K/V for every draft layer, [kv_heads, capacity, D]
    (positions 0 .. length-1); a round writes its block's K/V into the slots right after
    them, where they are attended over and then overwritten by the next round."""

    def __init__(self, drafter: "DSparkDrafter", capacity: int):
        a = drafter.config.args
        shape = (a.kv_heads_at(0), capacity, a.head_dim_at(0))
        dtype, device = drafter.kv_dtype(), drafter.device
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in drafter.layers]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in drafter.layers]
        self.capacity = capacity
        self.length = 0
        self.nbytes = sum(t.nelement() * t.element_size() for t in self.keys + self.values)


class DSparkDrafter(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.config = config
        a = config.args
        H, V = a.hidden_size, a.vocab_size
        self.block_size = config.block_size
        self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.ModuleList(DraftLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm.of(H, a)
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm.of(H, a)
        out = config.draft_vocab_size or V
        self.lm_head = nn.Linear(H, out, bias=False)
        if config.draft_vocab_size:
            # draft head row i is target token draft_vocab_ids[i]
            self.register_buffer("draft_vocab_ids", torch.arange(out, dtype=torch.long))
        else:
            self.draft_vocab_ids = None
        rows = out + 1 if config.markov_vocab == "draft" else V  # + 1: the row shared by tokens outside the draft vocabulary
        self.markov_head = HEADS[config.markov_head_type](rows, config.markov_rank, out, H) if config.has_markov else None
        self._markov_rows = None  # (draft_vocab_ids tensor, its version, target id -> embedding row)
        self.confidence_head = None
        if config.enable_confidence_head:
            self.confidence_head = ConfidenceHead(H + (config.markov_rank if config.confidence_head_with_markov else 0))
        self._ropes: dict = {}

    # -- small pieces ------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def kv_dtype(self) -> torch.dtype:
        return torch.float32 if self.device.type == "cpu" else self.dtype  # as the target's cache (decoder.py)

    def rope(self, positions: torch.Tensor):
        key = (self.dtype, self.device)
        table = self._ropes.get(key)
        if table is None:
            table = self._ropes[key] = RotaryTable(self.config.args.rope_global, self.config.args.head_dim_at(0), *key)
        return table.lookup(positions)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target features [..., m * H] -> the injected context [..., H] (Eq 2)."""
        return self.hidden_norm(self.fc(features))

    def embed_block(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        scale = self.config.args.embed_scale
        return x * torch.tensor(scale, dtype=x.dtype) if scale != 1.0 else x

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h)
        cap = self.config.args.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_vocab_ids is None else self.draft_vocab_ids[draft_ids]

    def markov_embedding(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """The Markov head's embedding of previous tokens given as target ids."""
        if self.config.markov_vocab == "draft":
            prev_ids = self.markov_rows().to(prev_ids.device)[prev_ids.long()]
        return self.markov_head.prev_embedding(prev_ids)

    def markov_rows(self) -> torch.Tensor:
        """target id -> row of a draft-vocabulary Markov embedding (the last row for any
        token outside the draft vocabulary); rebuilt when draft_vocab_ids is replaced or
        written in place (loading, training's vocabulary choice)."""
        vocab = self.draft_vocab_ids
        version = 0 if vocab.is_inference() else vocab._version  # inference tensors keep no version
        cached = self._markov_rows
        if cached is None or cached[0] is not vocab or cached[1] != version:
            with torch.inference_mode(False):  # a plain tensor, usable by training after an inference-mode call
                rows = torch.full((self.config.args.vocab_size,), len(vocab), dtype=torch.long, device=vocab.device)
                rows[vocab] = torch.arange(len(vocab), device=vocab.device)
            cached = self._markov_rows = (vocab, version, rows)
        return cached[2]

    def confidence(self, h: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        if self.config.confidence_head_with_markov:
            return self.confidence_head(torch.cat([h, prev_emb.to(h.dtype)], dim=-1))
        return self.confidence_head(h)

    # -- decoding ---------------------------------------------------------------------

    def new_cache(self, capacity: int) -> ContextCache:
        return ContextCache(self, capacity)

    @torch.inference_mode()
    def draft_hidden(self, caches: list[ContextCache], new_features: list[torch.Tensor | None],
                     anchors: list[int]) -> torch.Tensor:
        """One backbone pass per row: each row's new context rows (features [n_i, m*H] at
        positions cache.length ..), then its block [anchor, MASK...] at the positions
        right after them. The new context K/V stay in the row's cache; the block's do not.
        Returns the block hidden states [R, gamma, H]."""
        g, device = self.block_size, self.device
        R = len(caches)
        n_new = [0 if f is None else f.shape[0] for f in new_features]
        feats = [f for f in new_features if f is not None and f.shape[0]]
        ctx = self.context(torch.cat(feats).to(self.dtype)) if feats else None
        ctx_pos = torch.cat([torch.arange(c.length, c.length + n, device=device) for c, n in zip(caches, n_new)])
        starts = [c.length + n for c, n in zip(caches, n_new)]
        blk_pos = torch.cat([torch.arange(s, s + g, device=device) for s in starts])
        ids = torch.full((R, g), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[:, 0] = torch.tensor(anchors, dtype=torch.long, device=device)
        x = self.embed_block(ids.view(-1))  # [R*g, H]
        ctx_rope = self.rope(ctx_pos) if ctx is not None else None
        blk_rope = self.rope(blk_pos)
        kv_dtype = self.kv_dtype()
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            u = layer.input_layernorm(x)
            if ctx is not None:
                k_ctx, v_ctx = attn.keys_values(ctx, ctx_rope)
                at = 0
                for cache, n in zip(caches, n_new):
                    if n:
                        cache.keys[i][:, cache.length : cache.length + n] = k_ctx[at : at + n].transpose(0, 1)
                        cache.values[i][:, cache.length : cache.length + n] = v_ctx[at : at + n].transpose(0, 1)
                        at += n
            q = attn.queries(u, blk_rope)
            k_blk, v_blk = attn.keys_values(u, blk_rope)
            outs = []
            for r, (cache, n) in enumerate(zip(caches, n_new)):
                end = cache.length + n
                rows = slice(r * g, (r + 1) * g)
                if end + g <= cache.capacity:  # the block's K/V in the slots after the context
                    cache.keys[i][:, end : end + g] = k_blk[rows].transpose(0, 1)
                    cache.values[i][:, end : end + g] = v_blk[rows].transpose(0, 1)
                    keys, values = cache.keys[i][:, : end + g], cache.values[i][:, : end + g]
                else:
                    keys = torch.cat([cache.keys[i][:, :end], k_blk[rows].transpose(0, 1).to(kv_dtype)], dim=1)
                    values = torch.cat([cache.values[i][:, :end], v_blk[rows].transpose(0, 1).to(kv_dtype)], dim=1)
                outs.append(attn.attend_block(q[rows].to(kv_dtype), keys, values).to(x.dtype))
            x = layer.finish(x, torch.cat(outs) if R > 1 else outs[0])
        for cache, n in zip(caches, n_new):
            cache.length += n
        return self.norm(x).view(R, g, -1)

    @torch.inference_mode()
    def propose(self, h: torch.Tensor, anchors: list[int], choose, ends=None,
                slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sequential stage over a block's hidden states h [R, gamma, H]: slot by slot,
        the Markov/RNN bias from the previous token (the anchor, then the token chosen for
        the slot before), the slot's confidence logit, then `choose(slot, logits [R,
        V_draft]) -> draft-vocab ids [R]`. Returns (target-vocab tokens [R, L], confidence
        logits [R, L'] or None).

        `ends(slot, confidence logits [R] or None) -> [bool] * R`, when given, says which
        rows' proposals end before this slot; once every row's has, the rest of the block is
        not computed (L' = L + 1: the slot that ended the last one has its confidence, not
        its token). A slot's confidence reads only its h and the token before it, so a
        proposal cut there is the same as DeepSpec's, which computes the whole block and
        then cuts. Without `ends`, L = L' = gamma. `slots`: at most this many (the longest
        proposal any row may make)."""
        R, g = h.shape[:2]
        g = g if slots is None else min(g, slots)
        prev = torch.tensor(anchors, dtype=torch.long, device=h.device)
        state = self.markov_head.initial_state((R,), h) if self.markov_head is not None else None
        tokens, confidences = [], []
        base = None
        ended = [False] * R
        for j in range(g):
            prev_emb = None
            if self.markov_head is not None:
                prev_emb = self.markov_embedding(prev)
            conf = self.confidence(h[:, j], prev_emb)
            if conf is not None:
                confidences.append(conf)
            if ends is not None:
                ended = [e or x for e, x in zip(ended, ends(j, conf))]
                if all(ended):
                    break
            if base is None:  # the draft head over every slot at once (one pass over its weights)
                base = self.base_logits(h[:, :g])
            logits = base[:, j]
            if self.markov_head is not None:
                bias, state = self.markov_head.step(prev_emb, h[:, j], state)
                logits = logits + bias
            prev = self.to_target_ids(choose(j, logits))
            tokens.append(prev)
        out = torch.stack(tokens, dim=1) if tokens else torch.empty(R, 0, dtype=torch.long, device=h.device)
        return out, (torch.stack(confidences, dim=1) if confidences else None)

    def prepare_for_inference(self, pack: bool = True, int8: str = "off") -> "DSparkDrafter":
        """Eval mode, no gradients and, on CPU, every linear layer's weight pre-packed for
        oneDNN, or with int8 "auto" in q8_0 where that measures faster (drafting/dspark/
        packing.py: the drafts may then differ from the exact drafter's at near-ties). The
        state dict is unchanged; `kernel_note` says what was chosen."""
        from verispec.drafting.dspark.packing import pack_linears

        self.eval().requires_grad_(False)
        if pack:
            self.kernel_note = pack_linears(self, int8=int8, rows=(1, self.block_size))
        return self


def calibrated_confidences(confidence_logits: torch.Tensor, temperatures: list[float] | None = None) -> list[float]:
    """Each slot's conditional acceptance: sigmoid(logit), or sigmoid(logit / T_slot) with
    the STS temperatures `verispec dspark calibrate` fits."""
    logits = confidence_logits.float()
    if temperatures is not None:
        logits = logits / torch.tensor(temperatures[: logits.shape[-1]], dtype=torch.float32, device=logits.device)
    return torch.sigmoid(logits).tolist()


def slot_thresholds(threshold, length: int) -> list[float]:
    """The confidence threshold as one number per slot (it may be given as one for all)."""
    return list(threshold) if isinstance(threshold, (list, tuple)) else [threshold] * length


def first_below(confidences: list[float] | None, threshold, length: int) -> int:
    """DeepSpec's truncation on given confidences: the index of the first slot whose
    confidence is below the threshold (so 0 is possible), or the whole block; a threshold
    <= 0 keeps all. The threshold may be one number or one per slot."""
    if confidences is None:
        return length
    per_slot = slot_thresholds(threshold, length)
    if all(t <= 0 for t in per_slot):
        return length
    return next((j for j, (c, t) in enumerate(zip(confidences, per_slot)) if t > 0 and c < t), length)


def confident_prefix(confidence_logits: torch.Tensor | None, threshold, length: int,
                     temperatures: list[float] | None = None) -> int:
    """DeepSpec's truncation from the confidence logits (`first_below` of their calibrated
    sigmoids)."""
    if confidence_logits is None:
        return length
    return first_below(calibrated_confidences(confidence_logits, temperatures), threshold, length)
