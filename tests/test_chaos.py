"""A handful of chaos trials (tools/chaos.py): random-time SIGKILLs, resume, exact stream.

The full run (200+ trials over every scenario) is a tool run, not a test; this one keeps
the tool working and catches a regression in the commonest paths.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "chaos.py"


@pytest.mark.parametrize(
    ("trials", "scenarios"),
    [
        # CI: a stream at 0 workers and a packed mixture at 2 (map-style SIGKILLs at 0
        # and 2 workers are test_sigkill's and test_example's).
        (2, "stream-0,mixpacked-2"),
        pytest.param(
            5, "map-2,stream-0,mixpacked-2,elastic,reshape-packed", marks=pytest.mark.long
        ),
    ],
)
def test_chaos_handful(tmp_path: Path, trials: int, scenarios: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(TOOL.parent.parent)}
    done = subprocess.run(
        [sys.executable, str(TOOL), "--trials", str(trials), "--seed", "1", "--timeout", "120",
         "--scenarios", scenarios, "--workdir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    all_row = next(line for line in done.stdout.splitlines() if "all" in line)
    cells = [c.strip() for c in all_row.strip("│ ").split("│")]
    assert cells == ["all", str(trials), "0", "0", "0"]
    assert "actual kills:" in done.stdout
