"""Regenerate the README's picture, ``docs/dashboard.png``: the live dashboard of a real
``inference-lab serve`` while ``inference-lab load`` runs and ``max_num_seqs`` is lowered,
then restored, through ``POST /control/capacity``.

The server serves gpt-oss-20b on b200 with ``max_num_seqs`` 16 and ``max_waiting`` 8;
twenty closed-loop clients of 300-token answers (``--retry-after``) fill the batch; after
8 s ``max_num_seqs`` drops to 8 (the queue fills and 529s start), after 16 s it is 16
again; the page is photographed at 24 s in Debian's headless chromium (Playwright,
``executable_path``; no browser is downloaded).

Run: ``python scripts/make_readme_picture.py [--out docs/dashboard.png]`` (about 30 s).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import ServerProcess, post_capacity  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    args = parser.parse_args()
    if not Path(CHROMIUM).exists():
        print(f"{CHROMIUM} is missing: apt-get install chromium", file=sys.stderr)
        return 1
    import trio
    from playwright.sync_api import sync_playwright

    server_args = ["--config", "gpt-oss-20b", "--max-num-seqs", "16", "--max-waiting", "8"]
    with ServerProcess(server_args) as server, sync_playwright() as p:
        profile = tempfile.mkdtemp(prefix="inference-lab-chromium-")
        browser = p.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            args=FLAGS,
            headless=True,
            viewport={"width": 1400, "height": 1000},
            device_scale_factor=1,
        )
        page = browser.new_page()
        page.goto(server.url + "/control/dashboard")
        page.wait_for_selector('#status[data-state="live"]')
        load = subprocess.Popen(
            [sys.executable, "-m", "inference_lab.cli", "load", "--url", server.url,
             "--model", "gpt-oss-20b", "--concurrency", "20", "--max-tokens", "300",
             "--duration", "26", "--retry-after"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            start = time.monotonic()
            for at, seqs in ((8.0, 8), (16.0, 16)):
                time.sleep(max(0.0, start + at - time.monotonic()))
                trio.run(lambda seqs=seqs: post_capacity(server.url, max_num_seqs=seqs))
            time.sleep(max(0.0, start + 24.0 - time.monotonic()))
            page.screenshot(path=str(args.out), full_page=True)
        finally:
            load.terminate()
            load.wait()
            browser.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
