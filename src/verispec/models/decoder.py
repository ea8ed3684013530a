"""One decoder for llama / qwen2 / qwen3 / gemma3 / gemma4 (our own PyTorch; transformers is the oracle).

Per-family differences come from ModelArgs (config.py) and are visible where they apply:
  * qwen2: bias on q/k/v                       * qwen3, gemma3/4: RMSNorm over head_dim on q, k
  * gemma3: (1 + w) norms cast after the multiply, sandwich norms around attention and
    MLP, sqrt(hidden) embedding scale, gelu-tanh MLP, query_pre_attn_scalar, interleaved
    sliding-window layers with their own RoPE base, optional final-logit soft-cap
  * gemma4 on top: `x * w` norms, a weightless v-norm, attention scale 1, per-layer head size
    and KV heads (global layers: V = the raw k projection), proportional partial RoPE, a
    scalar per layer, KV sharing (a layer attends over an earlier layer's keys and values,
    exactly those that layer attended over in the same forward, and keeps no cache), per-layer
    embeddings, routed experts beside the MLP, double-wide MLPs on sharing layers
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

Checked by tests/test_models_vs_transformers.py (tiny random configs of every family, two
for gemma4 that between them set every switch of transformers' Gemma 4 text model:
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
    def __init__(self, args: ModelArgs, index: int, window: int | None):
        super().__init__()
        H, D = args.hidden_size, args.head_dim_at(index)
        self.index, self.window, self.head_dim = index, window, D
        self.kv_heads = args.kv_heads_at(index)
        self.kv_source = args.kv_source_at(index)  # == index: this layer computes and caches its own K/V
        self.own_kv = self.kv_source == index
        self.k_eq_v = args.k_eq_v_at(index)  # V is the raw k_proj output (gemma4 global layers)
        self.scale = args.attn_scale if args.attn_scale is not None else D**-0.5
        self.n_q = args.num_heads * D
        self.n_kv = self.kv_heads * D if self.own_kv else 0
        n_v = 0 if self.k_eq_v else self.n_kv
        self.attn_norm = nn.Parameter(torch.ones(H))
        self.qkv = Linear(H, self.n_q + self.n_kv + n_v, bias=args.attention_bias)
        self.o_proj = Linear(self.n_q, H, bias=args.o_proj_bias)
        self.mlp_norm = nn.Parameter(torch.ones(H))
        inter = args.intermediate_at(index)
        self.gate_up = Linear(H, 2 * inter, bias=args.mlp_bias)
        self.down = Linear(inter, H, bias=args.mlp_bias)
        if args.qk_norm:  # q_norm repeated over q heads, then k_norm over kv heads
            self.qk_norm = nn.Parameter(torch.ones(args.num_heads + (self.kv_heads if self.own_kv else 0), D))
        if args.sandwich_norms:
            self.post_attn_norm = nn.Parameter(torch.ones(H))
            self.post_mlp_norm = nn.Parameter(torch.ones(H))
        if args.layer_scalar:
            self.layer_scalar = nn.Parameter(torch.ones(1))
        if args.per_layer_input:  # gemma4 PLE: gate, per-layer input, projection, norm, residual
            P = args.per_layer_input
            self.ple_gate = Linear(H, P)
            self.ple_proj = Linear(P, H)
            self.ple_norm = nn.Parameter(torch.ones(H))
        if args.moe is not None:  # gemma4: routed experts beside the dense MLP
            E, I = args.moe.num_experts, args.moe.intermediate_size
            self.router = Linear(H, E)
            self.router_scale = nn.Parameter(torch.ones(H))
            self.expert_scale = nn.Parameter(torch.ones(E))
            self.experts_gate_up = nn.Parameter(torch.zeros(E, 2 * I, H))
            self.experts_down = nn.Parameter(torch.zeros(E, H, I))
            self.post_mlp_norm_1 = nn.Parameter(torch.ones(H))
            self.pre_moe_norm = nn.Parameter(torch.ones(H))
            self.post_moe_norm = nn.Parameter(torch.ones(H))


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        windows = args.layer_windows or (None,) * args.num_layers
        self.embed = nn.Parameter(torch.zeros(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(args, i, w) for i, w in enumerate(windows))
        if args.per_layer_input:  # gemma4 PLE: a token table and a projection of the embedding, per layer
            LP = args.num_layers * args.per_layer_input
            self.ple_embed = nn.Parameter(torch.zeros(args.per_layer_vocab, LP))
            self.ple_model_proj = Linear(args.hidden_size, LP)
            self.ple_proj_norm = nn.Parameter(torch.ones(args.per_layer_input))
        self.final_norm = nn.Parameter(torch.ones(args.hidden_size))
        self.lm_head = None if args.tie_word_embeddings else nn.Parameter(torch.zeros(args.vocab_size, args.hidden_size))
        self._ropes: dict[int | None, RotaryTable] = {}
        self.lm: Linear | None = None  # the lm_head's kernel, once prepare() chose one
        self.attention_kernel = "sdpa"  # or "invariant": verispec's per-query kernel (kernels/qlinear.cpp)
        self._fused = None  # with it, verispec's fused RoPE, SiLU * up and cache-write + attention
        self._act = F.silu if args.activation == "silu" else (lambda x: F.gelu(x, approximate="tanh"))
        self._head_dims = {layer.window: layer.head_dim for layer in self.layers}  # one head size per layer kind

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
        if self.args.norm_in_f32 and x.dtype != torch.float32:
            return (F.rms_norm(x.float(), x.shape[-1:], None, eps) * weight).to(x.dtype)
        if x.dtype == torch.float32 and weight.dim() == 1:
            return F.rms_norm(x, weight.shape, weight, eps)
        return weight * F.rms_norm(x, x.shape[-1:], None, eps)  # also per-head q/k norms

    def _rope(self, window: int | None) -> RotaryTable:
        table = self._ropes.get(window)
        if table is None:
            rope = self.args.rope_global if window is None else self.args.rope_local
            table = self._ropes[window] = RotaryTable(rope, self._head_dims[window], self.dtype, self.device)
        return table

    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype. On GPU it follows the weights. On CPU: the weights' bf16 where
        verispec's attention kernel reads the cache (`prepare(attention="invariant")`): it widens
        bf16 K/V to float32 on load, exactly, so the cache holds the same numbers as a float32 one
        in half the bytes, and attention gives the same bits (tests/test_qlinear.py, tests/test_kernel_plan.py). Float32
        otherwise: PyTorch's bf16 SDPA for one query row is 3.5x (100 keys) to 5.6x (1000 keys)
        slower than float32's here."""
        if self.device.type != "cpu":
            return self.dtype
        if self.dtype == torch.bfloat16 and self._fused is not None:
            return torch.bfloat16
        return torch.float32

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
            self.lm.float_out = True  # logits leave in float32, not through the model's dtype
        return self.lm

    def cast(self, dtype: torch.dtype) -> None:
        """Cast the parameters no kernel has taken yet to `dtype` (gemma's norm weights
        stay float32: its norms multiply there, models/loader.py)."""
        for name, p in self.named_parameters():
            if not p.numel() or p.dtype == dtype:
                continue
            if self.args.norm_in_f32 and "norm" in name:
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
        ple = self._per_layer_inputs(input_ids, h) if args.per_layer_input else None
        tapped = {-1: h} if -1 in taps else {}
        shared: dict[int, list] = {}  # KV-sharing source layer -> each row's (keys, values, mask) this forward
        for i, layer in enumerate(self.layers):
            h = self._layer(layer, h, batch, plans, rope[layer.window], ple, shared)
            if i in taps:
                tapped[i] = h
        for seq, n in zip(batch.seqs, batch.n_new):
            seq.advance(n)

        last = self._norm(h.index_select(0, logits_at), self.final_norm)
        logits = self._lm_logits(last).float()
        if args.final_logit_softcap:
            logits = torch.tanh(logits / args.final_logit_softcap) * args.final_logit_softcap
        return ForwardOutput(logits, tuple(tapped[t] for t in taps))

    @torch.inference_mode()
    def forward_shared(self, h: torch.Tensor, positions: torch.Tensor, shared: dict) -> torch.Tensor:
        """One token per row through a stack whose every layer attends over another model's KV
        (the gemma4 assistant: its layers' kv_source are negative, -1 - the target layer):
        `h` [R, hidden] the input embeddings, `shared[kv_source]` one (keys, values, mask) per
        row. Returns the final-normed hidden states [R, hidden]."""
        rope = {w: self._rope(w).lookup(positions) for w in self._head_dims}
        batch = BatchKV([], [1] * h.shape[0])
        for layer in self.layers:
            h = self._layer(layer, h, batch, None, rope[layer.window], None, shared)
        return self._norm(h, self.final_norm)

    def _per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """gemma4 PLE, [N, layers, P]: the token's row of the per-layer table (x sqrt(P)) plus the
        normed projection of its embedding (x 1/sqrt(H)), times 1/sqrt(2)."""
        a = self.args
        P = a.per_layer_input
        table = F.embedding(input_ids, self.ple_embed) * torch.tensor(P**0.5, dtype=h.dtype)
        proj = self.ple_model_proj(h) * a.hidden_size**-0.5
        proj = self._norm(proj.view(-1, a.num_layers, P), self.ple_proj_norm)
        return (proj + table.view(-1, a.num_layers, P)) * 2.0**-0.5

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:
            return self._fused.rmsnorm(x, weight, self.args.rms_norm_eps, self.args.norm_in_f32, None)[0]
        return self._norm(x, weight)

    def _layer(self, layer: DecoderLayer, h, batch: BatchKV, plans, rope, ple, shared) -> torch.Tensor:
        """One decoder layer; with `_fused` on verispec's kernels (kernels/qlinear.cpp): norms (+ the
        residual add before them), RoPE, the activation and the cache write + attention each one
        op, every one per row, so the layer stays batch-invariant."""
        args, fused = self.args, self._fused
        eps = args.rms_norm_eps
        x = self._rms(h, layer.attn_norm)
        qkv = layer.qkv(x)
        n_tok, D = qkv.shape[0], layer.head_dim
        n_qk = layer.n_q + layer.n_kv
        v = None
        if layer.own_kv:
            v = qkv[:, layer.n_q : n_qk] if layer.k_eq_v else qkv[:, n_qk:]
            v = v.view(n_tok, layer.kv_heads, D)
            if args.v_norm:  # scale-less, computed in float32 (gemma4)
                v = F.rms_norm(v.float(), (D,), None, eps).to(v.dtype)
        qk = self._qk(layer, qkv, n_tok, n_qk // D, rope)
        kv_dtype = batch.seqs[0].cache.dtype if batch.seqs else self.kv_dtype()
        if kv_dtype != qk.dtype:  # bf16 weights, float32 cache (kv_dtype()): cast once per layer
            qk = qk.to(kv_dtype)
            v = v.to(kv_dtype) if v is not None else None
        q, k = qk[:, : args.num_heads], qk[:, args.num_heads :]
        attn = self._attention(q, k, v, batch, plans, layer, shared)
        out = layer.o_proj(attn)
        if args.sandwich_norms:
            out = self._rms(out, layer.post_attn_norm)
        if fused is not None:
            x, h = fused.rmsnorm(h, layer.mlp_norm, eps, args.norm_in_f32, out)  # h + out, and its norm
        else:
            h = h + out
            x = self._norm(h, layer.mlp_norm)
        out = layer.down(self._gated(layer.gate_up(x)))
        if args.moe is not None:
            out = self._rms(out, layer.post_mlp_norm_1) + self._rms(self._experts(layer, h), layer.post_moe_norm)
        if args.sandwich_norms:
            out = self._rms(out, layer.post_mlp_norm)
        h = h + out
        if ple is not None:
            gated = self._act(layer.ple_gate(h)) * ple[:, layer.index]
            h = h + self._rms(layer.ple_proj(gated), layer.ple_norm)
        if args.layer_scalar:
            h = h * layer.layer_scalar
        return h

    def _qk(self, layer: DecoderLayer, qkv: torch.Tensor, n_tok: int, heads_qk: int, rope) -> torch.Tensor:
        """The q (and own k) heads of the fused projection, normed per head where the family does,
        rotated: [n, heads_qk, D]. (V, when it is the raw k projection, is read before this.)"""
        D, fused = layer.head_dim, self._fused
        if fused is None:
            qk = qkv[:, : heads_qk * D].view(n_tok, heads_qk, D)
            if self.args.qk_norm:
                qk = self._norm(qk, layer.qk_norm)
            return apply_rope(qk, *rope)
        cos, sin = rope[0].view(n_tok, D), rope[1].view(n_tok, D)
        if self.args.qk_norm:  # per-head norms (weight row per head), then RoPE in place on the result
            qk = fused.rmsnorm(qkv[:, : heads_qk * D].reshape(-1, D), layer.qk_norm, self.args.rms_norm_eps,
                               self.args.norm_in_f32, None)[0].view(n_tok, heads_qk, D)
            fused.rope_(qk, cos, sin)
            return qk
        fused.rope_qk_(qkv, heads_qk, D, cos, sin)  # RoPE in place on the q and k heads of the fused rows
        return qkv[:, : heads_qk * D].view(n_tok, heads_qk, D)

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:
            return self._fused.silu_mul(gate_up) if self.args.activation == "silu" else self._fused.gelu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self._act(gate) * up

    def _experts(self, layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
        """gemma4's routed experts on the post-attention residual `h`: top-k of a softmax router
        (its input normed without a weight, x router_scale / sqrt(H)), weights renormalized and
        scaled per expert; each expert a gated MLP on pre_moe_norm(h), summed in expert order."""
        moe, eps = self.args.moe, self.args.rms_norm_eps
        routed = F.rms_norm(h.float(), h.shape[-1:], None, eps).to(h.dtype) * layer.router_scale
        probs = F.softmax(layer.router(routed * self.args.hidden_size**-0.5), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, moe.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * layer.expert_scale[chosen]
        x = self._rms(h, layer.pre_moe_norm)
        out = torch.zeros_like(x)
        for expert in torch.unique(chosen).tolist():
            token, slot = torch.where(chosen == expert)
            gate, up = F.linear(x[token], layer.experts_gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(self._act(gate) * up, layer.experts_down[expert]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def _attention(self, q, k, v, batch: BatchKV, plans, layer: DecoderLayer, shared: dict) -> torch.Tensor:
        """Per row: write the row's new K/V into its cache, attend over its keys; a layer that shares
        another's KV (gemma4) attends over exactly the keys and values that layer attended over."""
        outs, attended = [], []
        keep = layer.own_kv and bool(self.args.kv_source)  # another layer will attend over this one's KV
        offset = 0
        for r, n in enumerate(batch.n_new):
            rows = slice(offset, offset + n)
            offset += n
            if layer.own_kv:
                key_plan = plans[r][layer.window]
                out, kv = self._attend_row(q[rows], k[rows], v[rows], batch.seqs[r], key_plan, layer, keep)
                if keep:
                    attended.append((*kv, key_plan.mask))
            else:
                keys, values, mask = shared[layer.kv_source][r]
                out = self._attend(q[rows], keys, values, mask, layer.scale)
            outs.append(out)
        if keep:
            shared[layer.index] = attended
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return out.reshape(out.shape[0], -1)

    def _attend_row(self, q, k_new, v_new, seq: SequenceKV, plan: KeyPlan, layer: DecoderLayer, keep: bool):
        """(attention output [n, heads, D], the keys and values attended over: only when `keep`
        on the fused path, where they are not otherwise needed)."""
        index = layer.index
        cache_k, cache_v = seq.keys[index], seq.values[index]
        if self._fused is not None and plan.gather is None:  # write + attend in one op
            out = self._fused.attend_cached(q, k_new, v_new, cache_k, cache_v, seq.length, plan.n_view, plan.mask,
                                            layer.scale).to(self.dtype)
            return out, (cache_k[:, : plan.n_view], cache_v[:, : plan.n_view]) if keep else None
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
        return self._attend(q, keys, values, plan.mask, layer.scale), (keys, values)

    def _attend(self, q, keys, values, mask, scale: float) -> torch.Tensor:
        """q [n, heads, D] over keys/values [kv_heads, S, D] -> [n, heads, D] in the model's dtype."""
        if self.attention_kernel == "invariant":
            from verispec import kernels

            return kernels.load().attention(q.float(), keys, values, mask, scale).to(self.dtype)
        if keys.dtype != q.dtype:  # a cache another model wrote in its own kv_dtype (the gemma4 assistant's)
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scale,
            enable_gqa=True)[0]  # [heads, n, D]
        return out.transpose(0, 1).to(self.dtype)
