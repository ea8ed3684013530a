"""One decoder for llama / qwen2 / qwen3 / gemma3 (our own PyTorch; transformers is the oracle).

Per-family differences come from ModelArgs (config.py) and are visible where they apply:
  * qwen2: bias on q/k/v                       * qwen3, gemma3: RMSNorm over head_dim on q, k
  * gemma3: (1 + w) norms cast after the multiply, sandwich norms around attention and
    MLP, sqrt(hidden) embedding scale, gelu-tanh MLP, query_pre_attn_scalar, interleaved
    sliding-window layers with their own RoPE base, optional final-logit soft-cap
  * llama 3.x: rope scaling (config.RopeArgs)

Data path. A forward takes the new tokens of several rows packed flat ([N] ids, [N]
positions) plus one SequenceKV per row. Projections and MLPs run once over all N tokens;
attention runs per row against that row's own cache (so rows never pad to each other
and joining a batch copies nothing). Positions are per token, always. The lm_head runs
only on the positions listed in `logits_at` (default: each row's last token), and
hidden states of the layers listed in `taps` are returned (-1 = embedding output, i =
output of layer i, before the final norm), costing nothing when none are asked.

Speed notes (CPU decode is dominated by per-op host overhead, measured with
bench/decode.py): q/k/v and gate/up are fused into one matmul each at load time; the
q- and k-norm weights are laid out per head so one norm op serves both; RoPE is applied
to q and k in one op; the attention mask is built once per row and layer kind, not per
layer.

Checked by tests/test_models_vs_transformers.py (tiny random configs of every family:
float32 logits close to transformers', identical greedy tokens, batched rows of
different lengths) and tests/test_real_models.py (SmolLM2 and Gemma-3 real weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from verispec.models.kv_cache import DEFAULT_MAX_ROLLBACK, KeyPlan, KVCache, SequenceKV
from verispec.models.config import ModelArgs, RopeArgs
from verispec.models.linear import Linear, packing_enabled


LINEAR_ROLES = ("qkv", "o_proj", "gate_up", "down", "lm_head")


@dataclass
class BatchKV:
    """The rows of one forward: each row's cache and how many new tokens it brings."""

    seqs: list[SequenceKV]
    n_new: list[int]

    def positions(self, device=None) -> torch.Tensor:
        """Positions of the new tokens, packed flat (each row continues its cache)."""
        return torch.cat([torch.arange(s.length, s.length + n, device=device) for s, n in zip(self.seqs, self.n_new)])

    def last_indices(self, device=None) -> torch.Tensor:
        """Flat index of each row's last new token."""
        ends = torch.tensor(self.n_new, device=device).cumsum(0)
        return ends - 1


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [len(logits_at), vocab] float32
    hidden: tuple[torch.Tensor, ...] = field(default=())  # one [N, hidden] per tap, in order asked


class RotaryTable:
    """cos/sin for one RoPE kind, computed in float32 like transformers and grown on
    demand; looked up by position, so every token carries its own position."""

    def __init__(self, rope: RopeArgs, head_dim: int, dtype: torch.dtype, device):
        self.inv_freq = rope.inv_freq(head_dim).to(device)
        self.dtype = dtype
        self.cos = self.sin = torch.empty(0, head_dim, dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        needed = int(positions.max()) + 1
        if needed > self.cos.shape[0]:
            self._grow(max(needed, 2 * self.cos.shape[0], 256))
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def _grow(self, size: int) -> None:
        freqs = torch.arange(size, dtype=torch.float32, device=self.inv_freq.device)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        # rotate_half(x) * sin == x[..., swap halves] * (sign * sin): fold the sign into
        # the table so applying RoPE is one gather-free roll, two muls and an add.
        half = emb.shape[-1] // 2
        sin = emb.sin()
        sin[:, :half] = -sin[:, :half]
        self.cos = emb.cos().to(self.dtype)
        self.sin = sin.to(self.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; transformers' rotate_half convention (halves, not pairs)."""
    return x * cos + torch.roll(x, shifts=x.shape[-1] // 2, dims=-1) * sin_signed


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, window: int | None):
        super().__init__()
        H, D = args.hidden_size, args.head_dim
        self.window = window
        self.n_q = args.num_heads * D
        self.n_kv = args.num_kv_heads * D
        self.attn_norm = nn.Parameter(torch.ones(H))
        self.qkv = Linear(H, self.n_q + 2 * self.n_kv, bias=args.attention_bias)
        self.o_proj = Linear(self.n_q, H, bias=args.o_proj_bias)
        self.mlp_norm = nn.Parameter(torch.ones(H))
        self.gate_up = Linear(H, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down = Linear(args.intermediate_size, H, bias=args.mlp_bias)
        if args.qk_norm:  # q_norm repeated over q heads, then k_norm over kv heads
            self.qk_norm = nn.Parameter(torch.ones(args.num_heads + args.num_kv_heads, D))
        if args.sandwich_norms:
            self.post_attn_norm = nn.Parameter(torch.ones(H))
            self.post_mlp_norm = nn.Parameter(torch.ones(H))


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        windows = args.layer_windows or (None,) * args.num_layers
        self.embed = nn.Parameter(torch.zeros(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(args, w) for w in windows)
        self.final_norm = nn.Parameter(torch.ones(args.hidden_size))
        self.lm_head = None if args.tie_word_embeddings else nn.Parameter(torch.zeros(args.vocab_size, args.hidden_size))
        self._ropes: dict[int | None, RotaryTable] = {}
        self.lm: Linear | None = None  # the lm_head's kernel, once prepare() chose one
        self.attention_kernel = "sdpa"  # or "invariant": verispec's per-query kernel (kernels/qlinear.cpp)
        self._fused = None  # with it, verispec's fused RoPE, SiLU * up and cache-write + attention
        self._act = F.silu if args.activation == "silu" else (lambda x: F.gelu(x, approximate="tanh"))
        self._scale = args.attn_scale if args.attn_scale is not None else args.head_dim**-0.5

    # -- small pieces ---------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm computed in float32, as transformers does. Llama/qwen round the
        normalized value to the input dtype, then apply the weight; gemma multiplies by
        (1 + w) in float32 and rounds once (its weights carry the +1, see loader.py).
        F.rms_norm upcasts internally, so on bf16 input it equals transformers'
        float32-then-round bit for bit in one op instead of six."""
        eps = self.args.rms_norm_eps
        if self.args.norm_offset and x.dtype != torch.float32:
            return (F.rms_norm(x.float(), x.shape[-1:], None, eps) * weight).to(x.dtype)
        if x.dtype == torch.float32 and weight.dim() == 1:
            return F.rms_norm(x, weight.shape, weight, eps)
        return weight * F.rms_norm(x, x.shape[-1:], None, eps)  # also per-head q/k norms

    def _rope(self, window: int | None) -> RotaryTable:
        table = self._ropes.get(window)
        if table is None:
            rope = self.args.rope_global if window is None else self.args.rope_local
            table = self._ropes[window] = RotaryTable(rope, self.args.head_dim, self.dtype, self.device)
        return table

    def kv_dtype(self) -> torch.dtype:
        """float32 KV on CPU whatever the weights: PyTorch's bf16 SDPA for one query row
        is 3.5x (100 keys) to 5.6x (1000 keys) slower than float32's here, and bf16
        values upcast exactly, so the cache holds the same numbers at twice the bytes.
        On GPU the cache follows the weights."""
        return torch.float32 if self.device.type == "cpu" else self.dtype

    def new_cache(self, max_rollback: int = DEFAULT_MAX_ROLLBACK) -> KVCache:
        return KVCache(self.args, dtype=self.kv_dtype(), device=self.device, max_rollback=max_rollback)

    def lm_weight(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    def pack_for_cpu(self) -> bool:
        """Pre-pack every matrix for oneDNN (see linear.py); no-op off CPU or when
        VERISPEC_NO_PACK=1. The lm_head gets a packed copy (the embedding table it may
        be tied to stays dense for lookups). The plan PyTorch-only kernels give."""
        if not packing_enabled(self.device):
            return False
        return self.prepare({role: "onednn" for role in LINEAR_ROLES}, "sdpa")

    def linears(self) -> dict[str, list[Linear]]:
        """Every matrix by role (its shape class): what a kernel plan assigns kernels to."""
        roles: dict[str, list[Linear]] = {r: [] for r in LINEAR_ROLES}
        for layer in self.layers:
            roles["qkv"].append(layer.qkv)
            roles["o_proj"].append(layer.o_proj)
            roles["gate_up"].append(layer.gate_up)
            roles["down"].append(layer.down)
        if self.lm is not None:
            roles["lm_head"].append(self.lm)
        return roles

    def prepare(self, linear: dict[str, str], attention: str = "sdpa", roles=None) -> bool:
        """Give every matrix (of `roles`, default all) its role's kernel (models/kernel_plan.py
        chooses them) and the attention its kernel; a kernel that cannot run leaves that
        matrix on F.linear. True when every matrix got the kernel asked for."""
        self.ensure_lm()
        ok = True
        for role, layers in self.linears().items():
            if roles is not None and role not in roles:
                continue
            for layer in layers:
                if layer.kernel == "aten" and layer.weight.numel():
                    ok = layer.use(linear.get(role, "aten")) and ok
        if self.lm.kernel != "aten" and self.lm_head is not None:
            self.lm_head = nn.Parameter(torch.empty(0, dtype=self.dtype), requires_grad=False)  # kept by the kernel
        self.attention_kernel = attention
        self._fused = None
        if attention == "invariant":
            from verispec import kernels

            self._fused = kernels.load()  # the decode-step helpers of kernels/qlinear.cpp
        return ok

    def ensure_lm(self) -> Linear:
        """The lm_head as a Linear (sharing a tied embedding's tensor until a kernel takes it)."""
        if self.lm is None:
            weight = self.lm_weight()
            self.lm = Linear(weight.shape[1], weight.shape[0])
            self.lm.weight = nn.Parameter(weight, requires_grad=False)
        return self.lm

    def cast(self, dtype: torch.dtype) -> None:
        """Cast the parameters no kernel has taken yet to `dtype` (gemma's norm weights
        stay float32: its norms multiply there, models/loader.py)."""
        for name, p in self.named_parameters():
            if not p.numel() or p.dtype == dtype:
                continue
            if self.args.norm_offset and "norm" in name:
                continue
            p.data = p.data.to(dtype)
        self._ropes.clear()

    def _lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.lm is not None:
            return self.lm(h)
        return F.linear(h, self.lm_weight())

    # -- forward --------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        batch: BatchKV,
        positions: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        taps: Sequence[int] = (),
    ) -> ForwardOutput:
        args = self.args
        if positions is None:
            positions = batch.positions(self.device)
        if logits_at is None:
            logits_at = batch.last_indices(self.device)
        plans = [seq.plan(n) for seq, n in zip(batch.seqs, batch.n_new)]
        rope = {w: self._rope(w).lookup(positions) for w in plans[0]}

        h = F.embedding(input_ids, self.embed)
        if args.embed_scale != 1.0:
            h = h * torch.tensor(args.embed_scale, dtype=h.dtype)
        tapped = {-1: h} if -1 in taps else {}
        for i, layer in enumerate(self.layers):
            h = self._layer(layer, h, batch, plans, rope[layer.window], i)
            if i in taps:
                tapped[i] = h
        for seq, n in zip(batch.seqs, batch.n_new):
            seq.advance(n)

        last = self._norm(h.index_select(0, logits_at), self.final_norm)
        logits = self._lm_logits(last).float()
        if args.final_logit_softcap:
            logits = torch.tanh(logits / args.final_logit_softcap) * args.final_logit_softcap
        return ForwardOutput(logits, tuple(tapped[t] for t in taps))

    def _layer(self, layer: DecoderLayer, h, batch: BatchKV, plans, rope, index: int) -> torch.Tensor:
        if self._fused is not None:
            return self._fused_layer(layer, h, batch, plans, rope, index)
        args = self.args
        x = self._norm(h, layer.attn_norm)
        qkv = layer.qkv(x)
        n_tok = qkv.shape[0]
        D = args.head_dim
        qk = qkv[:, : layer.n_q + layer.n_kv].view(n_tok, -1, D)
        v = qkv[:, layer.n_q + layer.n_kv :].view(n_tok, args.num_kv_heads, D)
        if args.qk_norm:
            qk = self._norm(qk, layer.qk_norm)
        qk = apply_rope(qk, *rope)
        kv_dtype = batch.seqs[0].cache.dtype
        if kv_dtype != qk.dtype:  # bf16 weights, float32 cache (kv_dtype()): cast once per layer
            qk, v = qk.to(kv_dtype), v.to(kv_dtype)
        q, k = qk[:, : args.num_heads], qk[:, args.num_heads :]
        attn = self._attention(q, k, v, batch, plans, layer.window, index)
        out = layer.o_proj(attn)
        if args.sandwich_norms:
            out = self._norm(out, layer.post_attn_norm)
        h = h + out
        x = self._norm(h, layer.mlp_norm)
        gate, up = layer.gate_up(x).chunk(2, dim=-1)
        out = layer.down(self._act(gate) * up)
        if args.sandwich_norms:
            out = self._norm(out, layer.post_mlp_norm)
        return h + out

    def _fused_layer(self, layer: DecoderLayer, h, batch: BatchKV, plans, rope, index: int) -> torch.Tensor:
        """The same layer on verispec's kernels (kernels/qlinear.cpp): norms (+ the residual
        add before them), RoPE, the activation and the cache write + attention each one op,
        every one per row, so the layer stays batch-invariant."""
        args, fused = self.args, self._fused
        eps, offset = args.rms_norm_eps, bool(args.norm_offset)
        x = fused.rmsnorm(h, layer.attn_norm, eps, offset, None)[0]
        qkv = layer.qkv(x)
        n_tok = qkv.shape[0]
        D = args.head_dim
        heads_qk = args.num_heads + args.num_kv_heads
        cos, sin = rope[0].view(n_tok, D), rope[1].view(n_tok, D)
        if args.qk_norm:  # per-head norms (weight row per head), then RoPE in place on the result
            qk = fused.rmsnorm(qkv[:, : layer.n_q + layer.n_kv].reshape(-1, D), layer.qk_norm, eps, offset, None)[0]
            qk = qk.view(n_tok, heads_qk, D)
            fused.rope_(qk, cos, sin)
        else:  # RoPE in place on the q and k heads of the fused rows
            fused.rope_qk_(qkv, heads_qk, D, cos, sin)
            qk = qkv[:, : layer.n_q + layer.n_kv].view(n_tok, -1, D)
        v = qkv[:, layer.n_q + layer.n_kv :].view(n_tok, args.num_kv_heads, D)
        q, k = qk[:, : args.num_heads], qk[:, args.num_heads :]
        attn = self._attention(q, k, v, batch, plans, layer.window, index)
        out = layer.o_proj(attn)
        if args.sandwich_norms:
            out = fused.rmsnorm(out, layer.post_attn_norm, eps, offset, None)[0]
        x, h = fused.rmsnorm(h, layer.mlp_norm, eps, offset, out)  # h + out, and its norm
        gate_up = layer.gate_up(x)
        out = layer.down(fused.silu_mul(gate_up) if args.activation == "silu" else fused.gelu_mul(gate_up))
        if args.sandwich_norms:
            out = fused.rmsnorm(out, layer.post_mlp_norm, eps, offset, None)[0]
        return h + out

    def _attention(self, q, k, v, batch: BatchKV, plans, window, index: int) -> torch.Tensor:
        """Per row: write the row's new K/V into its cache, attend over its keys."""
        if len(batch.seqs) == 1:
            out = self._attend_row(q, k, v, batch.seqs[0], plans[0][window], index)
            return out.reshape(out.shape[0], -1)
        outs = []
        offset = 0
        for seq, n, plan in zip(batch.seqs, batch.n_new, plans):
            rows = slice(offset, offset + n)
            offset += n
            outs.append(self._attend_row(q[rows], k[rows], v[rows], seq, plan[window], index))
        out = torch.cat(outs, dim=0)
        return out.reshape(out.shape[0], -1)

    def _attend_row(self, q, k_new, v_new, seq: SequenceKV, plan: KeyPlan, index: int) -> torch.Tensor:
        cache_k, cache_v = seq.keys[index], seq.values[index]
        if self._fused is not None and plan.gather is None:  # write + attend in one op
            return self._fused.attend_cached(q, k_new, v_new, cache_k, cache_v, seq.length, plan.n_view, plan.mask,
                                             self._scale).to(self.dtype)
        k_new, v_new = k_new.transpose(0, 1), v_new.transpose(0, 1)  # [kv_heads, n, D]
        if plan.gather is None:
            cache_k[:, plan.write] = k_new
            cache_v[:, plan.write] = v_new
            keys, values = cache_k[:, : plan.n_view], cache_v[:, : plan.n_view]
        else:  # long chunk after a sliding ring wrapped: older window + new, then write
            keys = torch.cat([cache_k[:, plan.gather], k_new], dim=1)
            values = torch.cat([cache_v[:, plan.gather], v_new], dim=1)
            cache_k[:, plan.write] = k_new[:, plan.write_from :]
            cache_v[:, plan.write] = v_new[:, plan.write_from :]
        if self.attention_kernel == "invariant":
            from verispec import kernels

            return kernels.load().attention(q, keys, values, plan.mask, self._scale).to(self.dtype)
        out = self._sdpa(q.transpose(0, 1), keys, values, plan.mask)  # [heads, n, D]
        return out.transpose(0, 1).to(self.dtype)

    def _sdpa(self, q, keys, values, mask):
        return F.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=self._scale, enable_gqa=True
        )[0]
