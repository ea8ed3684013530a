"""The package rule: data flows server -> engine -> models, drafting and grammar are
participants of the engine's step, training tools sit above the engine.

Two oracles: every import statement in the source (module level and inside functions,
read with `ast`), and what a fresh interpreter actually loads when it imports each
package (`python -c`: an import hidden behind a re-export or `importlib` shows there).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "verispec"

# package -> packages it must never import
FORBIDDEN = {
    "models": ("engine", "server", "drafting", "training", "grammar"),
    "engine": ("server", "training", "drafting"),
    "grammar": ("engine", "server", "drafting", "training", "models"),
    "drafting": ("server", "training"),
    "server": ("training",),
    # a client over HTTP: servers it starts, the registry for model files, never the engine
    "bench": ("engine", "training", "grammar"),
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {name for name in found if name.startswith("verispec.")}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_statement_breaks_the_package_rule(package):
    broken = []
    for path in sorted((SRC / package).rglob("*.py")):
        for name in _imports(path):
            top = name.split(".")[1]
            if top in FORBIDDEN[package]:
                broken.append(f"{path.relative_to(SRC)} imports {name}")
    assert not broken, "\n".join(broken)


CHECK = """
import importlib, json, pkgutil, sys
package = sys.argv[1]
root = importlib.import_module("verispec." + package)
for info in pkgutil.walk_packages(root.__path__, root.__name__ + "."):
    importlib.import_module(info.name)
print(json.dumps(sorted({m.split(".")[1] for m in sys.modules if m.startswith("verispec.") and m.count(".") >= 1})))
"""


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_importing_a_package_loads_nothing_it_must_not(package):
    done = subprocess.run([sys.executable, "-c", CHECK, package], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert not loaded & set(FORBIDDEN[package]), f"verispec.{package} loads {sorted(loaded & set(FORBIDDEN[package]))}"


def test_no_module_is_called_spec_and_no_old_paths_remain():
    """`spec` named six things; the drafting package, the KV cache and verification moved."""
    assert not (SRC / "spec").exists()
    for old in ("engine/kv_cache.py", "drafting/verify.py", "grammar/spec.py", "drafting/dspark/train.py"):
        assert not (SRC / old).exists(), old
