"""What the tests of the drafters shipped in src/verispec/drafters/ share: the fit and size
check of a drafter against its model, and greedy decoding of prompts whose rows join a
running batch (the no-token-changed oracle runs it with and without the drafter)."""

from __future__ import annotations

import json
from pathlib import Path

from verispec.engine.engine import Engine, EngineConfig
from verispec.engine.request import Collector, GenerationRequest
from verispec.models.loader import read_config


def check_fits(shipped: Path, target_folder: Path, architecture: str, budget_mib: int) -> dict:
    """The shipped drafter's config.json, after checking it is built for this target and
    that its folder fits the budget."""
    config = json.loads((shipped / "config.json").read_text())
    target = read_config(target_folder)
    assert config["architectures"] == [architecture]
    assert config["hidden_size"] == target["hidden_size"]
    assert max(config["target_layer_ids"]) < target["num_hidden_layers"]
    on_disk = sum(f.stat().st_size for f in shipped.iterdir())
    assert on_disk <= budget_mib * 2**20, f"{on_disk / 2**20:.1f} MiB shipped"
    return config


def staggered_greedy(loaded, drafter, prompts: list[list[int]], limits: list[int]):
    """Greedy results of the prompts, each joining the batch 3 steps after the one before."""
    engine = Engine(loaded.model, loaded.tokenizer, loaded.stop_ids, EngineConfig(kv_budget=2**30), drafter=drafter)
    collectors = []
    for i, (ids, n) in enumerate(zip(prompts, limits)):
        collectors.append(Collector())
        engine.submit(GenerationRequest(ids, n), collectors[-1])
        for _ in range(3 * i):
            engine.step()
    engine.run_until_idle()
    return [c.result(0) for c in collectors]
