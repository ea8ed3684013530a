"""Code prompts from the standard library (data/code_prompts.py). Oracle: Python's own parser.
A head, given a `pass` body, must parse back to a function of the same name whose docstring
`ast.get_docstring` reads as it reads the original's; a task names the function and its
docstring's first paragraph."""

from __future__ import annotations

import ast
import random
import textwrap

import pytest

from verispec.data.code_prompts import SOURCE, function_prompts, stdlib_code_prompts
from verispec.training.dspark.datagen import prompt_messages, read_prompts

MODULE = textwrap.dedent('''
    import os

    def documented(a, b=2, *rest, key=None):
        """Add two numbers and return the sum.

        The rest is ignored.
        """
        return a + b

    def _private(x):
        """Hidden helpers are not prompts, whatever they say."""

    def undocumented(x):
        return x

    class Box:
        @staticmethod
        @property
        def size(self, scale):
            \'\'\'How big the box is, in litres.\'\'\'
            return 1

        async def fetch(cls, url, *, timeout=3.0):
            r"""Fetch one url over the network, with a timeout."""
''')


def _with_pass(head: str) -> ast.Module:
    """The head with a `pass` body at its docstring's indentation."""
    lines = head.rstrip("\n").split("\n")
    tree = None
    for indent in sorted({len(line) - len(line.lstrip()) for line in lines[1:] if line.strip()} | {4}):
        try:
            tree = ast.parse(head + " " * indent + "pass\n")
            break
        except SyntaxError:
            continue
    assert tree is not None, head
    return tree


def _function(tree: ast.Module):
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(nodes) == 1
    return nodes[0]


def test_each_documented_public_function_gives_a_head_and_a_task():
    prompts = list(function_prompts(MODULE))
    originals = {n.name: n for n in ast.walk(ast.parse(MODULE)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names = [_function(_with_pass(head)).name for head, _ in prompts]
    assert sorted(names) == ["documented", "fetch", "size"]
    for head, task in prompts:
        fn = _function(_with_pass(head))
        assert ast.get_docstring(fn) == ast.get_docstring(originals[fn.name])
        assert [d.id for d in fn.decorator_list] == [d.id for d in originals[fn.name].decorator_list]
        summary = " ".join(ast.get_docstring(originals[fn.name]).split("\n\n")[0].split())
        assert task.startswith(f"Write a Python function `{fn.name}(") and task.endswith(": " + summary)
    tasks = dict((_function(_with_pass(h)).name, t) for h, t in prompts)
    assert "`documented(a, b=2, *rest, key=None)`" in tasks["documented"]
    assert "`size(scale)`" in tasks["size"] and "`fetch(url, *, timeout=3.0)`" in tasks["fetch"]


def test_a_module_that_does_not_parse_gives_nothing():
    assert list(function_prompts("def broken(:\n")) == []


def test_the_stdlib_prompts_parse_back_and_come_in_a_fixed_order():
    prompts = stdlib_code_prompts()
    assert len(prompts) > 1000 and prompts == stdlib_code_prompts()
    heads, tasks = prompts[0::2], prompts[1::2]
    assert all(t.startswith("Write a Python function `") for t in tasks)
    for head in random.Random(0).sample(heads, 300):
        fn = _function(_with_pass(head))
        assert ast.get_docstring(fn) and not fn.name.startswith("_")


def test_datagen_reads_them_as_single_turn_prompts():
    first = list(read_prompts(SOURCE, limit=3, skip=2))
    assert first == [(SOURCE, p) for p in stdlib_code_prompts()[2:5]]
    assert list(prompt_messages(SOURCE, "all", 3, 2)) == [(SOURCE, [{"role": "user", "content": p}]) for _, p in first]


def test_an_unknown_source_is_still_a_missing_file():
    from verispec.errors import UserError

    with pytest.raises(UserError, match="no such file"):
        list(read_prompts("python-stdlib.jsonl", limit=1))
