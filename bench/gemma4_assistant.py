"""The Gemma 4 assistant drafter against plain decoding on a tiny random Gemma 4 target, same run.

Evidence that the KV-borrowing path is not pathologically slow, not a headline: the pair is
tiny and random (tests/tiny_models.build_gemma4_pair), so a target step is mostly per-op
overhead and the assistant costs about as much as the target. Two pairs: "random" (an
independent assistant: every first draft rejected, so the row pays the drafting and gains
nothing: the worst case) and "agreeing" (the pair made to agree often, so rounds keep several
drafts). Lanes: 1 row and 4 concurrent rows, greedy, 4 drafts per round (fixed), 96 new tokens;
best of --repeats runs. Every speculative output is checked equal to plain decoding's.

    .venv/bin/python bench/gemma4_assistant.py [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

import torch  # noqa: E402

from tests.tiny_models import CharTokenizer, build_gemma4_pair  # noqa: E402

NEW = 96
DRAFTS = 4


def run(model, provider, prompts, repeats: int) -> tuple[float, list[list[int]], float]:
    """(best tokens/s, outputs, tokens per target forward) for all prompts submitted together."""
    from verispec.engine.engine import Engine, EngineConfig
    from verispec.engine.request import Collector, GenerationRequest

    best, outputs, tau = 0.0, [], 1.0
    for _ in range(repeats):
        engine = Engine(model, CharTokenizer(), (), EngineConfig(kv_budget=2**28, num_draft_tokens=DRAFTS,
                                                                 adaptive_draft=False), drafter=provider)
        collectors = [Collector() for _ in prompts]
        start = time.perf_counter()
        for prompt, collector in zip(prompts, collectors):
            engine.submit(GenerationRequest(prompt, NEW), collector)
        engine.run_until_idle()
        elapsed = time.perf_counter() - start
        results = [c.result(0) for c in collectors]
        outputs = [r.token_ids for r in results]
        best = max(best, sum(len(o) for o in outputs) / elapsed)
        totals = engine.drafting.totals
        tau = totals.emitted / totals.rounds if totals.rounds else 1.0
    return best, outputs, tau


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from verispec.drafting.gemma4_assistant import AssistantProvider, Gemma4Assistant
    from verispec.models.kernel_plan import cpu_name
    from verispec.models.loader import load_folder

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 96, (n,), generator=g).tolist() for n in (12, 40, 25, 60)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("random", "agreeing"):
            folder = Path(tmp) / kind
            build_gemma4_pair(folder, kind, drafts=DRAFTS)
            model = load_folder(folder / "target")
            provider = AssistantProvider(Gemma4Assistant(folder / "assistant", model, torch.float32))
            for lane, batch in (("serial", prompts[:1]), ("batch4", prompts)):
                plain, expected, _ = run(model, None, batch, args.repeats)
                spec, got, tau = run(model, provider, batch, args.repeats)
                assert got == expected, f"{kind} {lane}: the assistant changed the output"
                rows.append({"pair": kind, "lane": lane, "plain_tok_s": round(plain, 1),
                             "assistant_tok_s": round(spec, 1), "speedup": round(spec / plain, 3), "tau": round(tau, 2)})

    print(f"\nGemma 4 assistant vs plain, tiny random target (4 layers, hidden 64) and assistant (2 layers), "
          f"{DRAFTS} drafts per round, {NEW} new tokens, best of {args.repeats}; {cpu_name()}, {args.threads} threads")
    print(f"{'pair':<10}{'lane':<8}{'plain tok/s':>12}{'assistant tok/s':>16}{'speedup':>9}{'tau':>6}")
    for r in rows:
        print(f"{r['pair']:<10}{r['lane']:<8}{r['plain_tok_s']:>12.1f}{r['assistant_tok_s']:>16.1f}"
              f"{r['speedup']:>8.2f}x{r['tau']:>6.2f}")
    print(json.dumps({"bench": "gemma4_assistant", "cpu": cpu_name(), "machine": platform.machine(),
                      "threads": args.threads, "drafts": DRAFTS, "new_tokens": NEW, "rows": rows}))


if __name__ == "__main__":
    main()
