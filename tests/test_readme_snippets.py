"""The README's client snippets run as written against a live server.

Every ```python block of README.md that talks to `http://127.0.0.1:8000` (the OpenAI
chat, Responses and Anthropic Messages examples) is executed with that address pointed at
a live server of the default model, its max_tokens left as the README has them. Oracle:
the snippet finishes without an exception and prints an answer. So the docs cannot drift
from the API.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from verispec.server.launch import live_server

pytestmark = pytest.mark.real_model

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "127.0.0.1:8000" in b]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    with live_server("--dtype", "float32", "--default-max-tokens", "48",
                     log=tmp_path_factory.mktemp("readme") / "serve.log") as url:
        yield url


def test_the_readme_has_the_client_snippets():
    assert len(SNIPPETS) >= 3 and any("anthropic" in s for s in SNIPPETS) and any("responses" in s for s in SNIPPETS)


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.split("\n")[0][:40])
def test_a_readme_snippet_runs_as_written(base_url, snippet):
    code = snippet.replace("http://127.0.0.1:8000", base_url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    assert out.getvalue().strip(), "the snippet printed nothing"
