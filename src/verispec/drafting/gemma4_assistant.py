"""The Gemma 4 assistant drafter (transformers' `gemma4_assistant`): drafts without a KV cache of
its own by attending over the target's.

An assistant is a small Gemma 4 text stack whose every layer shares KV: a layer of type t
attends over the target row's keys and values of the target's last own-KV layer of type t
(transformers' "store" layers). A draft step feeds one vector per row: pre_projection of
[the target's embedding of the last token (x sqrt(H)); the target's final-normed hidden state
at the position before it], at the constant position current_length - 1. The stack's output
(final-normed) gives the logits (lm_head, or the centroid-masked head when
`use_ordered_embeddings`) and, through post_projection, the hidden state the next step feeds
instead of the target's. Proposals are the argmax and carry no q: verification keeps drafts
while they match what the target samples, so drafting is lossless at any temperature.

What it sees of the target's KV is what transformers' Gemma4AssistantCandidateGenerator gives
it: the positions below the current length that the target's latest forward wrote, which after
a rejection includes the rejected draft's K/V at the newest token's position (the slot O(1)
rollback leaves in place: SequenceKV.written_end); global layers see all of them, sliding layers
the last sliding_window + 1 (transformers' bidirectional window is inclusive). Deviation: once a
sequence outgrows the target's own sliding window, transformers' sliding states are its sliding
cache plus the whole verify forward, rejected drafts past the newest token included; we keep
the rule above there too (and never more than the target's sliding ring holds).

The assistant's layers run on models/decoder.py (Decoder.forward_shared; its layers' kv_source
are -1 - the target layer they read). Checked by tests/test_gemma4_assistant.py: drafts and
output equal to transformers' assisted generation with the same tiny random pair, greedy output
equal to plain decoding inside continuous batching.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from verispec.engine.draft import MAX_DRAFT_TOKENS, Draft, DraftProvider, DraftSource, SourceContext
from verispec.models.config import ModelArgs, from_hf_config, read_config
from verispec.models.decoder import Decoder
from verispec.models.families import UnsupportedModelError

MODEL_TYPE = "gemma4_assistant"


class AssistantMismatchError(ValueError):
    """The assistant cannot draft for this target."""


def is_assistant(config: dict) -> bool:
    return config.get("model_type") == MODEL_TYPE or "Gemma4AssistantForCausalLM" in (config.get("architectures") or [])


def store_layers(target: ModelArgs) -> dict[str, int]:
    """Per layer type ('full_attention' / 'sliding_attention'): the target's last layer of that
    type that computes its own K/V, the one an assistant layer of that type reads."""
    found = {}
    for i, window in enumerate(target.layer_windows or (None,) * target.num_layers):
        if target.kv_source_at(i) == i:
            found["full_attention" if window is None else "sliding_attention"] = i
    return found


def assistant_args(config: dict, target: ModelArgs) -> ModelArgs:
    """ModelArgs of the assistant's stack, each layer reading its type's store layer of the target."""
    text = dict(config.get("text_config") or {})
    if text.get("hidden_size_per_layer_input") or text.get("enable_moe_block") or text.get("use_double_wide_mlp"):
        raise AssistantMismatchError("a gemma4 assistant has no per-layer embeddings, MoE or double-wide MLPs")
    text.update(model_type="gemma4_text", num_kv_shared_layers=0, hidden_size_per_layer_input=0)
    args = from_hf_config(text)
    stores = store_layers(target)
    sources = []
    for i, window in enumerate(args.layer_windows):
        kind = "full_attention" if window is None else "sliding_attention"
        if kind not in stores:
            raise AssistantMismatchError(f"the assistant's layer {i} is {kind}; the target has no such layer")
        source = stores[kind]
        if (args.head_dim_at(i), args.kv_heads_at(i)) != (target.head_dim_at(source), target.kv_heads_at(source)):
            raise AssistantMismatchError(
                f"the assistant's layer {i} (KV heads {args.kv_heads_at(i)} of {args.head_dim_at(i)}) cannot attend over "
                f"the target's layer {source} ({target.kv_heads_at(source)} KV heads of {target.head_dim_at(source)})")
        sources.append(-1 - source)
    return dataclasses.replace(args, kv_source=tuple(sources), layer_kv_heads=(), layer_k_eq_v=())


class Gemma4Assistant:
    """The assistant's weights: its stack (a Decoder), the projections and the output head."""

    def __init__(self, folder: Path, target: Decoder, dtype: torch.dtype):
        from verispec.models.loader import build_model, convert_state_dict, read_tensors

        config = read_config(folder)
        if not is_assistant(config):
            raise AssistantMismatchError(f"{folder} is not a gemma4 assistant (model_type {config.get('model_type')!r})")
        t = target.args
        if not t.v_norm or t.model_type != "gemma4_text":
            raise AssistantMismatchError(f"a gemma4 assistant drafts for Gemma 4 targets, not {t.model_type}")
        backbone = int(config.get("backbone_hidden_size", 1536))
        if backbone != t.hidden_size:
            raise AssistantMismatchError(f"the assistant was trained for a target of hidden size {backbone}; "
                                         f"this one has {t.hidden_size}")
        self.args = args = assistant_args(config, t)
        if args.vocab_size != t.vocab_size:
            raise AssistantMismatchError(f"vocabulary {args.vocab_size} vs the target's {t.vocab_size}")
        tensors = {k.removeprefix("model."): v for k, v in read_tensors(folder).items()}
        take = lambda name: tensors.pop(name).to(dtype)  # noqa: E731
        self.pre_projection = take("pre_projection.weight")  # [H_a, 2 H_t]
        self.post_projection = take("post_projection.weight")  # [H_t, H_a]
        lm_head = tensors.pop("lm_head.weight", None)
        self.centroids = self.ordering = None
        if config.get("use_ordered_embeddings"):
            self.centroids = take("masked_embedding.centroids.weight")  # [C, H_a]
            self.ordering = tensors.pop("masked_embedding.token_ordering").long()
            self.top_k = int(config.get("centroid_intermediate_top_k", 32))
            self.per_centroid = args.vocab_size // self.centroids.shape[0]
        self.model = build_model(args, convert_state_dict(args, dict(tensors), dtype), dtype, target.device)
        self.lm_head = lm_head.to(dtype) if lm_head is not None else self.model.embed
        self.target = target

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[R, V]; with ordered embeddings only the top centroids' tokens get their logit, the rest
        the smallest of those minus one (transformers' masked embedder)."""
        if self.centroids is None:
            return F.linear(h, self.lm_head).float()
        top = F.linear(h, self.centroids).topk(self.top_k, dim=-1).indices  # [R, k]
        chosen = self.ordering.view(-1, self.per_centroid)[top].flatten(1)  # [R, k * per_centroid]
        scores = torch.einsum("rh,rkh->rk", h, self.lm_head[chosen]).float()
        out = torch.full((h.shape[0], self.args.vocab_size), float(scores.min()) - 1.0, device=h.device)
        return out.scatter_(1, chosen, scores)

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, shared: dict):
        """One draft position for every row: (argmax tokens [R], the hidden state to feed next [R, H_t])."""
        target = self.target
        embedded = F.embedding(tokens, target.embed) * torch.tensor(target.args.embed_scale, dtype=target.dtype)
        x = F.linear(torch.cat([embedded, hidden.to(embedded.dtype)], dim=-1).to(self.pre_projection.dtype),
                     self.pre_projection)
        h = self.model.forward_shared(x, positions, shared)
        return self.logits(h).argmax(dim=-1), F.linear(h, self.post_projection)

    def visible_kv(self, seq) -> dict:
        """{kv_source: (keys, values, None)} of one target row: what every assistant layer reads."""
        end = min(seq.length + 1, max(seq.written_end, seq.length))
        out = {}
        for layer in self.model.layers:
            if layer.kv_source in out:
                continue
            source = -1 - layer.kv_source
            ring = seq.slots[source]
            target_window = seq.cache.layer_windows[source]
            if layer.window is None and target_window is None:
                keys, values = seq.keys[source][:, :end], seq.values[source][:, :end]
            else:
                start = max(0, end - (layer.window + 1 if layer.window is not None else end))
                if target_window is not None:
                    start = max(start, seq.written_end - ring)
                slots = torch.arange(start, end, device=seq.keys[source].device) % ring
                keys, values = seq.keys[source][:, slots], seq.values[source][:, slots]
            out[layer.kv_source] = (keys, values, None)
        return out


class AssistantSource(DraftSource):
    def __init__(self, provider: "AssistantProvider", context: SourceContext):
        if context.kv is None:
            raise AssistantMismatchError("the gemma4 assistant needs the row's target KV cache")
        self.provider = provider
        self.context = context
        self.last_hidden: torch.Tensor | None = None  # the target's final-normed state before the pending token

    def _keep(self, hidden) -> None:
        if hidden is not None and hidden[0].shape[0]:
            target = self.provider.assistant.target
            self.last_hidden = target._norm(hidden[0][-1:], target.final_norm)[0]

    def prefill(self, tokens, hidden) -> None:
        self._keep(hidden)

    def commit(self, kept, next_token, hidden) -> None:
        self._keep(hidden)

    def draft(self, pending: int, max_n: int) -> Draft:
        return self.provider.draft_batch([(self, pending, max_n)])[0]


class AssistantProvider(DraftProvider):
    name = "gemma4-assistant"
    max_draft = MAX_DRAFT_TOKENS

    def __init__(self, assistant: Gemma4Assistant, label: str = "gemma4 assistant"):
        self.assistant = assistant
        self.taps = (assistant.target.args.num_layers - 1,)
        self.label = label
        self.trace: list | None = None  # tests: one record per drafted row and round

    def new_source(self, context: SourceContext) -> AssistantSource:
        return AssistantSource(self, context)

    def describe(self) -> str:
        a = self.assistant.args
        return f"{self.label} ({a.num_layers} layers, hidden {a.hidden_size}, borrowing the target's KV)"

    def kv_bytes(self, capacity: int) -> int:
        return 0  # it reads the target's cache

    def draft_costs(self, target_costs) -> tuple[float, float]:
        """Per drafted token: one assistant step over 256 target positions, in target steps."""
        a, t = self.assistant, self.assistant.target
        kv = {"device": t.device, "dtype": t.kv_dtype()}  # as the target's KV cache holds them
        shared = {}
        for layer in a.model.layers:
            source = -1 - layer.kv_source
            shape = (t.args.kv_heads_at(source), 256, t.args.head_dim_at(source))
            shared[layer.kv_source] = [(torch.randn(shape, **kv), torch.randn(shape, **kv), None)]
        args = (torch.zeros(1, dtype=torch.long, device=t.device),
                torch.zeros(1, t.args.hidden_size, device=t.device, dtype=t.dtype),
                torch.tensor([255], device=t.device), shared)
        a.step(*args)
        _synchronize(t.device)
        start = time.perf_counter()
        for _ in range(5):
            a.step(*args)
        _synchronize(t.device)
        return 0.0, (time.perf_counter() - start) / 5 / target_costs.base_seconds

    @torch.inference_mode()
    def draft_batch(self, requests: list[tuple[DraftSource, int, int]]) -> list[Draft]:
        active = [(s, p, n) for s, p, n in requests if n > 0 and s.last_hidden is not None]
        drafts = {id(s): Draft() for s, _, _ in requests}
        if active:
            a = self.assistant
            rows = [a.visible_kv(s.context.kv) for s, _, _ in active]
            shared = {source: [row[source] for row in rows] for source in rows[0]}
            device = a.target.device
            tokens = torch.tensor([p for _, p, _ in active], dtype=torch.long, device=device)
            hidden = torch.stack([s.last_hidden for s, _, _ in active])
            positions = torch.tensor([s.context.kv.length for s, _, _ in active], device=device)
            steps = []
            for _ in range(max(n for _, _, n in active)):
                tokens, hidden = a.step(tokens, hidden, positions, shared)
                steps.append(tokens.tolist())
            for r, (source, _, n) in enumerate(active):
                drafts[id(source)] = Draft([step[r] for step in steps[:n]])
                if self.trace is not None:
                    self.trace.append({"source": id(source), "length": source.context.kv.length,
                                       "tokens": drafts[id(source)].tokens})
        return [drafts[id(s)] for s, _, _ in requests]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_assistant(target, folder: str | Path, dtype: torch.dtype, label: str | None = None) -> AssistantProvider:
    """`--draft-model` of a gemma4 assistant folder (or hub id, resolved) for a LoadedModel target."""
    try:
        assistant = Gemma4Assistant(Path(folder), target.model, dtype)
    except (KeyError, UnsupportedModelError) as e:
        raise AssistantMismatchError(f"not a gemma4 assistant checkpoint we can read ({e})") from None
    return AssistantProvider(assistant, label or "gemma4 assistant")
