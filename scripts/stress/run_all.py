"""``make stress``: the whole stress suite, one script after another, each against its own
server, each printing its figures; a summary at the end. Exit 1 if any script failed.

    python scripts/stress/run_all.py                       # about 2 minutes
    python scripts/stress/run_all.py --soak-seconds 1200   # with the 20-minute soak
    python scripts/stress/run_all.py --only burst,sigterm

Not part of ``make test``. Only 127.0.0.1; every script is bounded in time and count.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # benchkit

import burst  # noqa: E402
import disconnect  # noqa: E402
import fuzz  # noqa: E402
import hostile  # noqa: E402
import sigterm  # noqa: E402
import slow  # noqa: E402
import soak  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--soak-seconds", type=float, default=30.0)
    parser.add_argument("--fuzz-cases", type=int, default=300)
    parser.add_argument("--only", help="comma-separated script names")
    args = parser.parse_args(argv)
    scripts: dict[str, Callable[[], int]] = {
        "fuzz": lambda: fuzz.main(["--cases", str(args.fuzz_cases)]),
        "burst": lambda: burst.main([]),
        "hostile": lambda: hostile.main([]),
        "disconnect": lambda: disconnect.main([]),
        "slow": lambda: slow.main([]),
        "soak": lambda: soak.main(["--seconds", str(args.soak_seconds)]),
        "sigterm": lambda: sigterm.main([]),
    }
    chosen = args.only.split(",") if args.only else list(scripts)
    unknown = [name for name in chosen if name not in scripts]
    if unknown:
        parser.error(f"unknown script(s): {', '.join(unknown)} (known: {', '.join(scripts)})")
    results = {}
    for name in chosen:
        start = time.monotonic()
        print(f"== {name}", flush=True)
        try:
            code = scripts[name]()
        except Exception as exc:  # noqa: BLE001 - a crashed script is a failed one
            print(f"{name}: FAILED: {type(exc).__name__}: {exc}", flush=True)
            code = 1
        results[name] = (code, time.monotonic() - start)
    print("== summary")
    for name, (code, seconds) in results.items():
        print(f"  {name:<11} {'ok' if code == 0 else 'FAILED':<7} {seconds:6.1f} s")
    return 0 if all(code == 0 for code, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
