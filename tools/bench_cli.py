"""How long `ledger --help` and `ledger --version` take beyond a bare interpreter start.

Runs `python -c pass`, `python -m ledger.cli --help` and `--version` alternately, N times
each, and prints the medians and the overhead over `python -c pass` (the goal: 0.3 s).
Usage: python tools/bench_cli.py [N]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "ledger --help": [sys.executable, "-m", "ledger.cli", "--help"],
    "ledger --version": [sys.executable, "-m", "ledger.cli", "--version"],
    "ledger audit --help": [sys.executable, "-m", "ledger.cli", "audit", "--help"],
}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    times: dict[str, list[float]] = {k: [] for k in COMMANDS}
    for _ in range(n):
        for name, cmd in COMMANDS.items():
            t = time.perf_counter()
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["python -c pass"])
    print(f"{'command':<22} {'median s':>9} {'over python -c pass':>20}   (n={n})")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<22} {m:>9.3f} {m - base:>+19.3f}s")
    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
