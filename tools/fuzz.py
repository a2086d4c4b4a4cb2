"""Fuzz every reader of the log and the token check with 10^4 examples per reader.

Runs ``tests/test_fuzz.py`` (hypothesis) with ``LEDGER_FUZZ_EXAMPLES`` examples per test
(default 10,000; CI runs 150) and prints hypothesis's statistics: examples run per test and
how many raised. Every test asserts that only :mod:`ledger.errors` types come out of the
reader (and nothing at all out of the journal reader).

``--damage`` runs ``tools/damage.py`` instead (its options after ``--``): real logs of
five kinds (map-style, packed stream, mixture, compacted, elastic 2 -> 1 ranks) damaged
file by file and field by field, every command and a resume run on each.

Example:
    nice -n 10 python tools/fuzz.py                 # 10^4 examples per reader (minutes)
    python tools/fuzz.py --examples 2000 -k journal
    nice -n 10 python tools/fuzz.py --damage -- --logs compacted,elastic --no-json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=10_000, help="examples per test")
    p.add_argument("-k", default=None, help="only the tests matching this pytest expression")
    p.add_argument("--damage", action="store_true", help="run tools/damage.py instead")
    p.add_argument("rest", nargs="*", help="with --damage: tools/damage.py's options")
    a = p.parse_args(argv)
    if a.damage:
        sys.path.insert(0, str(REPO / "tools"))
        import damage

        damage.main(a.rest)
        return
    env = {
        **os.environ,
        "LEDGER_FUZZ_EXAMPLES": str(a.examples),
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(REPO / "tests" / "test_fuzz.py"), "--hypothesis-show-statistics"]  # fmt: skip
    if a.k:
        cmd += ["-k", a.k]
    sys.exit(subprocess.run(cmd, env=env, cwd=REPO).returncode)


if __name__ == "__main__":
    main()
