"""The framework recipes end to end, on CPU with tiny models built from configs (nothing
downloaded): run ``examples/hf_trainer.py`` and ``examples/lightning_recipe.py``,
SIGKILL one run mid-training, resume it from its last checkpoint, and require the batches
it trained on to equal those of a run that never stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ledger.audit import connect
from ledger.audit.checks import check

REPO = Path(__file__).resolve().parents[1]
STEPS, SAVE, SAMPLES = 20, 5, 36  # 9 batches of 4 per epoch: epochs end mid-run
KILL_AFTER_STEP = 7  # past the step-5 checkpoint, before the step-10 one (if in time)

pytestmark = pytest.mark.slow


def _cmd(script: str, out: Path, record: Path, *extra: str) -> list[str]:
    return [
        sys.executable, str(REPO / "examples" / script), "--out", str(out),
        "--steps", str(STEPS), "--save-steps", str(SAVE), "--samples", str(SAMPLES),
        "--seed", "3", "--record", str(record), *extra,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "a") as out:
        proc = subprocess.run(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT, timeout=900)
    assert proc.returncode == 0, log.read_text()[-3000:]


def _run_and_kill(cmd: list[str], record: Path, log: Path) -> None:
    """Start ``cmd`` and SIGKILL it once it has trained past step KILL_AFTER_STEP."""
    with open(log, "a") as out:
        proc = subprocess.Popen(
            cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline and proc.poll() is None:
                if record.exists() and any(r["step"] >= KILL_AFTER_STEP for r in _records(record)):
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.01)
        finally:
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]


def _lineage(root: Path) -> list[tuple]:
    con = connect(str(root))
    try:
        return con.execute(
            "SELECT epoch, batch, list(sample_id ORDER BY position) FROM lineage "
            "WHERE kind = 'sample' GROUP BY ALL ORDER BY batch"
        ).fetchall()
    finally:
        con.close()


@pytest.mark.parametrize("script", ["hf_trainer.py", "lightning_recipe.py"])
def test_sigkill_and_resume_trains_on_the_uninterrupted_batches(
    tmp_path: Path, script: str
) -> None:
    ref, crash = tmp_path / "ref", tmp_path / "crash"
    ref_record, crash_record = tmp_path / "ref.jsonl", tmp_path / "crash.jsonl"
    with ThreadPoolExecutor(2) as pool:
        done = [
            pool.submit(_run, _cmd(script, ref, ref_record), tmp_path / "ref.log"),
            pool.submit(
                _run_and_kill, _cmd(script, crash, crash_record), crash_record,
                tmp_path / "crash.log",
            ),
        ]  # fmt: skip
        for future in done:
            future.result()
    killed_lines = len(_records(crash_record))
    _run(_cmd(script, crash, crash_record, "--resume"), tmp_path / "crash.log")

    want = {r["step"]: r["input_ids"] for r in _records(ref_record)}
    assert sorted(want) == list(range(STEPS))
    got = _records(crash_record)
    resumed = got[killed_lines:]
    # The resumed process starts at a checkpoint step, before the kill point...
    assert resumed[0]["step"] % SAVE == 0 and resumed[0]["step"] <= KILL_AFTER_STEP + 1
    assert [r["step"] for r in resumed] == list(range(resumed[0]["step"], STEPS))
    # ...and every batch either process trained on is the uninterrupted run's batch of
    # that step (the killed one's lost steps included: they are trained again, the same).
    assert all(r["input_ids"] == want[r["step"]] for r in got), got
    # The log: the final lineage holds the same batches, and nothing was seen twice.
    assert _lineage(crash / "log") == _lineage(ref / "log")
    results = check(str(crash / "log"), ("coverage", "duplicates", "progress"))
    assert all(r.ok for r in results), results
    # Same seeds, CPU kernels, restored optimizer and RNG state: the same final weights.
    assert (crash / "final.sha256").read_text() == (ref / "final.sha256").read_text()
