"""Prometheus text exposition (format 0.0.4) of the engine's metrics, for GET /metrics.

Written by hand rather than through prometheus_client: a dozen series read straight off
EngineMetrics, and each server instance (tests start several) owns its numbers.
Checked by tests/test_server.py, which parses the output with prometheus_client's own
parser and compares the counters with what the requests did.
"""

from __future__ import annotations

from collections import Counter

from verispec.engine.engine import Engine
from verispec.engine.metrics import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in labels.items())
    return "{" + inner + "}"


class _Writer:
    def __init__(self):
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        self.lines += [f"{name}{_labels(labels)} {value}" for labels, value in samples]

    def histogram(self, name: str, help_text: str, h: Histogram) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        self.lines += [f'{name}_bucket{{le="{bound}"}} {count}' for bound, count in h.cumulative()]
        self.lines += [f"{name}_sum {h.sum}", f"{name}_count {h.count}"]

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(engine: Engine, http_requests: Counter, grammar_cache: dict | None = None) -> str:
    m, stats = engine.metrics, engine.stats()
    w = _Writer()
    w.metric("verispec_requests_total", "counter", "Requests finished, by finish reason.",
             [({"reason": r}, n) for r, n in sorted(m.requests_finished.items())] or [({"reason": "stop"}, 0)])
    w.metric("verispec_requests_rejected_total", "counter", "Requests refused before any work (4xx).",
             [({}, m.requests_rejected)])
    w.metric("verispec_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", [({}, m.prompt_tokens)])
    w.metric("verispec_generation_tokens_total", "counter", "Tokens generated.", [({}, m.generation_tokens)])
    w.metric("verispec_engine_steps_total", "counter", "Engine steps (batched forwards).", [({}, m.steps)])
    w.metric("verispec_queue_depth", "gauge", "Requests waiting for admission.", [({}, stats["waiting"])])
    w.metric("verispec_running_requests", "gauge", "Requests in the running batch.", [({}, stats["running"])])
    w.metric("verispec_kv_bytes_in_use", "gauge", "Bytes of KV cache held by running requests.",
             [({}, stats["kv_bytes_in_use"])])
    w.metric("verispec_kv_budget_bytes", "gauge", "KV cache budget for admission.", [({}, stats["kv_budget_bytes"])])
    w.metric("verispec_prefill_tokens_total", "counter", "Prompt tokens computed (prefix-cache hits are not).",
             [({}, m.prefill_tokens)])
    prefix = stats.get("prefix_cache")
    if prefix is not None:
        w.metric("verispec_prefix_cache_bytes", "gauge", "Bytes held by the prefix cache (within the KV budget).",
                 [({}, prefix["bytes"])])
        w.metric("verispec_prefix_cache_hit_tokens_total", "counter", "Prompt tokens restored from the prefix cache.",
                 [({}, prefix["hit_tokens"])])
        w.metric("verispec_prefix_cache_hit_rate", "gauge", "Restored prompt tokens / prompt tokens looked up.",
                 [({}, prefix["hit_rate"])])
    w.histogram("verispec_time_to_first_token_seconds", "Arrival to first generated token.", m.ttft)
    w.histogram("verispec_inter_token_latency_seconds", "Time between a request's consecutive tokens.", m.inter_token)
    w.histogram("verispec_e2e_request_latency_seconds", "Arrival to finish.", m.e2e)
    drafting = engine.drafting
    t = drafting.totals
    if drafting.active:
        w.metric("verispec_spec_drafted_tokens_total", "counter", "Draft tokens proposed and verified.", [({}, t.drafted)])
        w.metric("verispec_spec_accepted_tokens_total", "counter", "Draft tokens accepted.", [({}, t.accepted)])
        w.metric("verispec_spec_rounds_total", "counter", "Decode rounds (target forwards) of speculating rows.",
                 [({}, t.rounds)])
        w.metric("verispec_spec_emitted_tokens_total", "counter", "Tokens those rounds emitted (bonus included).",
                 [({}, t.emitted)])
        w.metric("verispec_spec_position_acceptance", "gauge",
                 "P(draft at position j accepted | drafts before it accepted).",
                 [({"position": str(j)}, a / r) for j, (a, r) in enumerate(zip(drafting.accepted_at, drafting.reached_at))
                  if r])
        w.histogram("verispec_spec_verify_tokens", "Drafted tokens a speculating row sent to verification per step "
                    "(what the verify schedule chose).", drafting.verify_lengths)
    if stats.get("sps_table"):
        w.metric("verispec_sps_steps_per_second", "gauge",
                 "The SPS table: target forwards per second at this many tokens (measured at start, cached).",
                 [({"tokens": str(r["tokens"])}, r["steps_per_s"]) for r in stats["sps_table"]])
    w.metric("verispec_forced_drafted_tokens_total", "counter",
             "Structured output: tokens a grammar forced, verified as drafts.", [({}, t.forced_drafted)])
    w.metric("verispec_forced_accepted_tokens_total", "counter", "Forced drafts accepted.", [({}, t.forced_accepted)])
    if grammar_cache is not None:
        w.metric("verispec_grammar_compiles_total", "counter", "Grammars compiled (cache misses).",
                 [({}, grammar_cache["compiles"])])
        w.metric("verispec_grammar_cache_hits_total", "counter", "Requests served a cached grammar.",
                 [({}, grammar_cache["hits"])])
        w.metric("verispec_grammar_cache_bytes", "gauge", "Estimated bytes of compiled grammars kept.",
                 [({}, grammar_cache["bytes"])])
    w.metric("verispec_http_requests_total", "counter", "HTTP requests, by route and status.",
             [({"route": route, "status": status}, n) for (route, status), n in sorted(http_requests.items())])
    return w.text()
