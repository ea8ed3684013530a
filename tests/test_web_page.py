"""The browser page at `/`, in a real headless Chromium (Debian's `chromium` package,
driven by Playwright through its `executable_path`; Playwright's own browser download
does not work on these machines).

Oracle: what the server says over its API. The test types the API key, sends a message,
waits for the streamed answer, and checks that the page shows the answer the chat route
gives for the same conversation (greedy), the message's tok/s and tau (from its usage
block), and a stats panel that has counted the request (/stats). A screenshot lands in
the test's tmp dir. Without chromium or playwright the test is skipped with the reason.
"""

from __future__ import annotations

import re
import shutil

import httpx
import pytest

from verispec.server.launch import live_server

pytestmark = pytest.mark.real_model

KEY = "page-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# as the machine probe runs it: no background networking on a closed network
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def base_url(smollm2_folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("page") / "serve.log"
    with live_server("-m", str(smollm2_folder), "--served-model-name", "smollm2", "--dtype", "float32",
                     "--api-key", KEY, log=log) as url:
        yield url


def test_the_page_is_one_self_contained_file(base_url):
    r = httpx.get(base_url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert not re.search(r"""(src|href)=["']https?://""", r.text), "nothing loaded from outside the server"


def test_a_message_streams_with_its_stats_and_the_panel_follows(base_url, tmp_path):
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    prompt = "Name three primary colours."
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 800})
            page.goto(base_url + "/")
            page.fill("#key", KEY)
            page.dispatch_event("#key", "change")
            page.wait_for_function("document.getElementById('model').textContent === 'smollm2'", timeout=30_000)
            before = int(page.get_attribute("#panel", "data-finished") or 0)
            page.fill("#temperature", "0")
            page.fill("#prompt", prompt)
            page.click("#send")
            page.wait_for_selector(".msg.assistant[data-done]", timeout=120_000)
            message = page.locator(".msg.assistant").last
            assert message.get_attribute("data-done") == "1", message.inner_text()
            shown = message.locator(".text").inner_text()
            stats = message.locator(".stats").inner_text()
            page.wait_for_function(f"Number(document.getElementById('panel').dataset.finished) > {before}",
                                   timeout=10_000)
            page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
        finally:
            browser.close()
    # the same conversation through the API, greedy as the page's request
    r = httpx.post(base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"model": "smollm2", "temperature": 0,
                         "messages": [{"role": "user", "content": prompt}]}).json()
    assert shown == r["choices"][0]["message"]["content"]
    assert re.search(r"\d+(\.\d+)? tok/s", stats), stats
    assert re.search(r"tau \d\.\d\d", stats), stats  # the default model speculates (n-gram)
    # the page's own request's counters (a second run drafts differently: n-gram's confidence
    # table learns online; only the text is the same)
    kept, drafted = map(int, re.search(r"(\d+)/(\d+) drafts kept", stats).groups())
    assert 0 <= kept <= drafted and "by position" in stats
    assert (tmp_path / "page.png").stat().st_size > 10_000
