"""Live DSpark decoding for calibration and measurement: the drafter fed its own drafts.

`run_live` decodes prompts one request at a time through the engine with a DSpark source
and returns per request its speed and its rounds: every proposal's confidences, length and
how many of its drafts the target accepted (what calibrate fits and measure reports).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.engine.engine import Engine, EngineConfig
from verispec.engine.request import GenerationRequest
from verispec.engine.sampling import SamplingParams


@dataclass
class Round:
    confidences: list[float]  # sigmoid of every slot's confidence logit (the whole block)
    proposal_len: int
    accepted: int  # drafts kept (the stop token cut as DeepSpec does)
    logits: list[float] = field(default_factory=list)  # the raw confidence logits (what STS scales)


@dataclass
class LiveResult:
    tokens: int
    decode_s: float
    rounds: list[Round] = field(default_factory=list)
    speculation: dict | None = None


def make_engine(loaded, provider=None, adaptive: bool = True, num_draft_tokens: int = 8,
                verify_schedule: str = "cost", step_costs=None) -> Engine:
    """One request at a time; `step_costs`: the SPS table every arm of one run prices with."""
    return Engine(loaded.model, loaded.tokenizer, loaded.stop_ids,
                  EngineConfig(max_rows=1, adaptive_draft=adaptive, num_draft_tokens=num_draft_tokens,
                               verify_schedule=verify_schedule), drafter=provider, step_costs=step_costs)


def run_live(engine: Engine, prompt_ids: list[int], max_tokens: int, params: SamplingParams,
             stop_ids=(), rounds: bool = True) -> LiveResult:
    """One request through `engine`; with `rounds`, the provider traces every proposal and
    commit so the result lists its rounds (calibrate reads them; measure times without)."""
    import math

    provider = engine.drafting.provider if engine.drafting.active and rounds else None
    if provider is not None:
        provider.trace = []
    result = engine.generate(GenerationRequest(prompt_ids, max_tokens, params))
    live = LiveResult(max(0, result.completion_tokens - 1), result.decode_time or 0.0, speculation=result.speculation)
    if provider is not None:
        proposal = None
        for event in provider.trace:
            if event["event"] == "propose":
                proposal = event
            elif proposal is not None:
                kept = event["kept"][1:]
                accepted = next((i + 1 for i, t in enumerate(kept) if t in stop_ids), len(kept))
                logits = list(proposal["confidence_logits"] or [])
                confidences = [1 / (1 + math.exp(-c)) for c in logits]
                live.rounds.append(Round(confidences, proposal["proposal_len"], accepted, logits))
                proposal = None
        provider.trace = None
    return live
