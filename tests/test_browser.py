"""The pages in a real browser: Debian's ``chromium``, headless, driven by Playwright for
Python (``executable_path``: no browser is ever downloaded). The dashboard of a real
``inference-lab serve`` follows the server as load comes and goes, shows 529s after a
``/control/capacity`` change and says so when the engine dies; a ``sim --report`` file
renders its charts. No console error in either; screenshots go to the test's directory.

Skipped, with the reason, where chromium or Playwright is missing (``.ci/run`` installs
chromium with apt-get before ``make test``).
"""

from __future__ import annotations

import http.client
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from inference_lab import cli

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parent.parent
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
#: Browser-side waits (milliseconds): generous, as the machine may be busy.
WAIT_MS = 30_000

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="Playwright for Python is not installed (pip install playwright)"
)
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason="no chromium at /usr/bin/chromium (apt-get install chromium; .ci/run does)",
)


class Browser:
    """One headless chromium with a fresh profile; records console errors."""

    def __init__(self, playwright: Any, profile: Path) -> None:
        self.context = playwright.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            args=FLAGS,
            headless=True,
            viewport={"width": 1400, "height": 1000},
        )
        self.errors: list[str] = []
        self.page = self.context.new_page()
        self.page.on(
            "console",
            lambda m: self.errors.append(m.text) if m.type == "error" else None,
        )
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def value(self, element_id: str) -> float:
        return float(self.page.get_attribute(f"#{element_id}", "data-value") or "nan")

    def wait_value(self, element_id: str, test: str) -> None:
        """Wait until the tile's number satisfies ``test`` (a JS expression of v)."""
        self.page.wait_for_function(
            f"""() => {{ const e = document.getElementById({element_id!r});
                if (!e || e.dataset.value === undefined || e.dataset.value === "") return false;
                const v = Number(e.dataset.value); return {test}; }}""",
            timeout=WAIT_MS,
        )


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    with sync_api.sync_playwright() as p:
        b = Browser(p, tmp_path / "profile")
        try:
            yield b
        finally:
            b.context.close()


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _stream(url: str, max_tokens: int, done: threading.Event) -> None:
    """One streaming completion, read until it ends or ``done`` is set."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    body = {
        "model": "gpt-oss-20b",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,  # runs to max_tokens: the model's own stop would end it early
        "stream": True,
    }
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"}
        )
        response = conn.getresponse()
        while not done.is_set() and response.read1(65536):
            pass
    except OSError:
        pass  # the server stopped at the end of the test
    finally:
        conn.close()


def test_the_dashboard_follows_the_server_in_a_real_browser(
    browser: Browser, tmp_path: Path
) -> None:
    """Six long streams on a batch of 4: running reaches 4 and queued 2; after
    ``max_waiting`` drops to 1 a new request is refused and 529/s appears, with the
    change listed; a killed engine brings the page's 503 message. No console error."""
    from benchkit import ServerProcess

    args = ["--config", "gpt-oss-20b", "--max-num-seqs", "4", "--max-waiting", "8"]
    with ServerProcess([*args, "--enable-test-harness"], log=tmp_path / "server.log") as server:
        done = threading.Event()
        threads = [
            threading.Thread(target=_stream, args=(server.url, 30_000, done), daemon=True)
            for _ in range(6)
        ]
        try:
            browser.page.goto(server.url + "/control/dashboard")
            browser.page.wait_for_selector('#status[data-state="live"]', timeout=WAIT_MS)
            for t in threads:
                t.start()
            browser.wait_value("v-running", "v === 4")
            browser.wait_value("v-queued", "v === 2")
            assert browser.value("v-max_num_seqs") == 4
            assert browser.value("v-refused") == 0
            browser.wait_value("v-tokens_per_s", "v > 0")

            status, _ = _post(server.url, "/control/capacity", {"max_waiting": 1})
            assert status == 200
            status, _ = _post(
                server.url,
                "/v1/chat/completions",
                {"model": "gpt-oss-20b", "messages": [{"role": "user", "content": "x"}]},
            )
            assert status == 529
            browser.wait_value("v-refused", "v === 1")
            browser.wait_value("v-refused_per_s", "v > 0")
            browser.wait_value("v-max_waiting", "v === 1")
            change = browser.page.text_content("#changes li.change") or ""
            assert "max_num_seqs 4 · max_waiting 1" in change
            browser.page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)

            status, _ = _post(
                server.url, "/control/engine", {"model": "gpt-oss-20b", "action": "kill"}
            )
            assert status == 200
            browser.page.wait_for_selector("#banner:not([hidden])", timeout=WAIT_MS)
            banner = browser.page.text_content("#banner") or ""
            assert "not running" in banner and "503" in banner
            browser.wait_value("v-running", "v === 0")
            browser.page.screenshot(path=str(tmp_path / "dashboard-dead.png"), full_page=True)
        finally:
            done.set()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    assert browser.errors == []


def test_a_sim_report_renders_its_charts_in_a_real_browser(
    browser: Browser, tmp_path: Path
) -> None:
    """The report of a run with two replicas opens from disk (no network), draws every
    chart (series, per-replica, distributions) and logs no console error."""
    config = tmp_path / "two.toml"
    text = (ROOT / "configs" / "gpt-oss-20b.toml").read_text()
    config.write_text(text.replace("[hardware.b200]", "[hardware.b200]\nreplicas = 2", 1))
    out = tmp_path / "report.html"
    rc = cli.main(
        ["sim", "--config", str(config), "--hardware", "b200", "--workload", "quick", "-q",
         "--report", str(out)]
    )  # fmt: skip
    assert rc == 0
    browser.page.goto(out.as_uri())
    browser.page.wait_for_function("() => document.body.dataset.charts", timeout=WAIT_MS)
    charts = int(browser.page.evaluate("document.body.dataset.charts"))
    canvases = browser.page.locator("canvas").count()
    assert charts == canvases >= 7 + 3 + 8  # series, per replica, CDFs and histograms
    assert browser.page.is_visible("#replica-section")
    browser.page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
    assert browser.errors == []
