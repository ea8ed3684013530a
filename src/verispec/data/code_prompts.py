"""Python code prompts from the interpreter's own standard library: drafter training data
for the code half of the eval sets, on every machine, with no download.

Why: gemma3-270m's regenerated ShareGPT pack held code in 119 of 3,831 answers (3% of its
answer tokens), while two of the four eval sets (humaneval, mbpp) are Python. A drafter
learns the target's continuations of what it was shown; it had hardly been shown code.

Each documented function or method of the standard library (its `.py` sources; tests,
`idlelib`, `lib2to3`, `turtledemo` and `site-packages` left out) gives one prompt, in one of
two shapes, alternating in a fixed shuffled order:

* **head**: the function's signature and docstring as they stand in the source, dedented
  (a base model writes the body, as code completion asks it to);
* **task**: "Write a Python function `name(args)`: <the docstring's first paragraph>" (an
  instruction the model answers with prose or code).

Both are decontaminated like every training prompt (datagen drops any that shares an 8-word
run with an eval prompt). The standard library differs between Python versions, so the
prompts do too; a pack's records carry their own ids and token ids, so nothing depends on
regenerating the same list.

Oracle: tests/test_code_prompts.py (every head parses back, with a `pass` body, to a
function whose docstring is the original's by `ast.get_docstring`; the order is fixed; no
prompt shares an 8-word run with an eval prompt).
"""

from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

SOURCE = "python-stdlib"
SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages", "__pycache__"}
MAX_DOC_CHARS = 1500  # longer docstrings make prompts past datagen's token cap anyway
SEED = 20261205


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIP_PARTS & set(p.relative_to(root).parts))


def function_prompts(source: str) -> Iterator[tuple[str, str]]:
    """(head, task) for each documented function or method in one module's source."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) > MAX_DOC_CHARS or len(doc.split()) < 4:
            continue
        expr = node.body[0]
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        # dedent by the def's own column (a function defined under an `if` may have docstring
        # lines indented less than its def, which textwrap.dedent would leave alone)
        col = node.col_offset
        head = "\n".join(line[min(col, len(line) - len(line.lstrip())):]
                         for line in lines[start - 1 : expr.end_lineno]) + "\n"
        summary = " ".join(doc.split("\n\n")[0].split())
        args = node.args
        if args.args and args.args[0].arg in ("self", "cls"):  # a method: the task names what a caller passes
            args = ast.arguments(args.posonlyargs, args.args[1:], args.vararg, args.kwonlyargs, args.kw_defaults,
                                 args.kwarg, args.defaults[-len(args.args[1:]):] if args.args[1:] else [])
        task = f"Write a Python function `{node.name}({ast.unparse(args)})`: {summary}"
        yield head, task


def stdlib_code_prompts(root: Path | None = None) -> list[str]:
    """Every prompt, in a fixed shuffled order (a slice of it spans the library), heads and tasks
    alternating."""
    pairs = []
    seen = set()
    for path in stdlib_files(root):
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for head, task in function_prompts(source):
            if head not in seen:
                seen.add(head)
                pairs.append((head, task))
    random.Random(SEED).shuffle(pairs)
    return [pair[i % 2] for i, pair in enumerate(pairs)]
