"""Kill a real loader process with SIGKILL anywhere, resume, compare streams."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

CHILD = os.path.join(os.path.dirname(__file__), "sigkill_child.py")
TOTAL = 25


def _run(args, kill_after_line=None):
    proc = subprocess.Popen([sys.executable, CHILD, *args], stdout=subprocess.PIPE, text=True)
    if kill_after_line is not None:
        for seen, _line in enumerate(proc.stdout, start=1):
            if seen == kill_after_line:
                os.kill(proc.pid, signal.SIGKILL)
                break
    proc.communicate(timeout=120)
    return proc.returncode


def _effective_stream(path):
    """For each step the line written last (the resumed run redoes steps after the commit)."""
    lines = {}
    with open(path) as f:
        for line in f:
            step, rest = line.split(" ", 1)
            lines[int(step)] = rest
    return [lines[s] for s in sorted(lines)]


# After a commit, inside one, after an epoch's end (line 10, after the second commit, is
# the long tier's).
@pytest.mark.parametrize("kill_after_line", [5, pytest.param(10, marks=pytest.mark.long), 19, 31])
def test_sigkill_then_resume_gives_the_uninterrupted_stream(
    tmp_path, sigkill_reference, kill_after_line
):
    out, ckpt = tmp_path / "run.txt", tmp_path / "ck.json"
    args = [str(tmp_path / "log"), str(out), str(ckpt), str(TOTAL)]
    rc = _run(args, kill_after_line=kill_after_line)
    assert rc == -signal.SIGKILL
    assert ckpt.exists()
    assert _run([*args, "--resume"]) == 0
    reference = sigkill_reference  # one uninterrupted run for every kill point
    resumed = _effective_stream(out)
    assert len(reference) == len(resumed) == TOTAL
    differing = [i for i, (a, b) in enumerate(zip(reference, resumed, strict=True)) if a != b]
    assert differing == []


def test_sigkill_a_packed_stream_then_resume(tmp_path):
    from conftest import text_shards

    shards = text_shards(tmp_path / "shards", 3, 9, "z", 3)
    extra = ["--shards", str(shards)]
    ref = tmp_path / "ref.txt"
    args_ref = [str(tmp_path / "ref"), str(ref), str(tmp_path / "ref.json"), str(TOTAL), *extra]
    assert _run(args_ref) == 0
    out, ckpt = tmp_path / "run.txt", tmp_path / "ck.json"
    args = [str(tmp_path / "log"), str(out), str(ckpt), str(TOTAL), *extra]
    assert _run(args, kill_after_line=23) == -signal.SIGKILL
    assert _run([*args, "--resume"]) == 0
    reference, resumed = _effective_stream(ref), _effective_stream(out)
    assert len(reference) == len(resumed) == TOTAL
    assert [i for i, (a, b) in enumerate(zip(reference, resumed, strict=True)) if a != b] == []
