"""A CLI that helps: --version, a fast --help, short commit ids with suggestions, a root
that is one directory off, capped tables, UTC times with Z, accepted crash tails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from conftest import Augmented
from logfactory import example_log

import ledger
from ledger.cli import CHECK_FAILED, main
from ledger.testing import take


@pytest.fixture
def root(tmp_path: Path) -> str:
    example_log(tmp_path / "log")
    return str(tmp_path / "log")


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def test_version() -> None:
    result = run("--version")
    assert (result.exit_code, result.stdout) == (0, f"ledger, version {ledger.__version__}\n")


def test_help_imports_no_heavy_module() -> None:
    # What `ledger --help` costs is measured by tools/bench_cli.py; here: what it imports.
    code = (
        "import sys\n"
        "from ledger.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('duckdb', 'pandas', 'pyarrow', 'torch', 'matplotlib', 'numpy', 'rich')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize("typed", ["5", "5-0", "000000000005-0000"])
def test_commit_by_step_or_step_attempt(root: str, typed: str) -> None:
    sql = "SELECT commit_id FROM commits WHERE is_head"
    result = run("audit", root, "--head", typed, "--format", "csv", "--sql", sql)
    assert (result.exit_code, result.stdout) == (0, "commit_id\n000000000005-0000\n")


@pytest.mark.parametrize(
    ("typed", "message"),
    [
        (
            "7",
            "2 commits are at step 7 in {root}: did you mean 000000000007-0001 or "
            "000000000007-0002?",
        ),
        (
            "3",
            "commit 3 does not exist under {root}: did you mean 000000000002-0000 or "
            "000000000004-0000 or 000000000005-0000?",
        ),
        (
            "6-0",
            "commit 000000000006-0000 does not exist under {root}: did you mean "
            "000000000005-0000 or 000000000006-0001 or 000000000007-0001?",
        ),
        ("x7", "'x7' is not a commit id: give STEP, STEP-ATTEMPT or the full id (e.g. 40, 40-1 or "
         "000000000040-0001)"),
    ],
)  # fmt: skip
def test_unknown_commit_gets_did_you_mean(root: str, typed: str, message: str) -> None:
    for args in (["audit", root, "--head", typed], ["reconstruct", root, "--commit", typed,
                                                     "--out", "x.parquet"]):  # fmt: skip
        result = run(*args)
        assert (result.exit_code, result.stdout) == (1, "")
        assert result.stderr == f"Error: {message.format(root=root)}\n"


def test_root_one_directory_off(root: str) -> None:
    parent = str(Path(root).parent)
    for command in ("audit", "verify"):
        result = run(command, parent)
        assert result.exit_code == 1
        assert result.stderr == (
            f"Error: {parent} holds no ledger run (no run.json); did you mean {root}?\n"
        )


def test_sql_table_is_capped_with_the_row_count_and_ids_whole(root: str) -> None:
    sql = (
        "SELECT range AS i, printf('%012d-%04d', range * 1000, range) AS commit_id, "
        "created_at FROM range(100), run"
    )
    result = run("audit", root, "--max-rows", "4", "--sql", sql)
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "┏━━━━┳━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━┓\n"
        "┃ i  ┃ commit_id         ┃ created_at           ┃\n"
        "┡━━━━╇━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━┩\n"
        "│ 0  │ 000000000000-0000 │ 2025-01-02T03:04:05Z │\n"
        "│ 1  │ 000000001000-0001 │ 2025-01-02T03:04:05Z │\n"
        "│ …  │ …                 │ …                    │\n"
        "│ 98 │ 000000098000-0098 │ 2025-01-02T03:04:05Z │\n"
        "│ 99 │ 000000099000-0099 │ 2025-01-02T03:04:05Z │\n"
        "└────┴───────────────────┴──────────────────────┘\n"
        "100 rows (4 shown)\n"
    )
    everything = run("audit", root, "--max-rows", "0", "--sql", sql)
    assert len(everything.stdout.splitlines()) == 100 + 4


def test_wide_table_cuts_no_value(root: str) -> None:
    sql = "SELECT " + ", ".join(f"'{i:012d}-0000' AS c{i}" for i in range(8))
    result = run("audit", root, "--sql", sql)
    assert result.exit_code == 0
    assert all(f"{i:012d}-0000" in result.stdout for i in range(8))


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ("csv", "created_at\n2025-01-02T03:04:05Z\n"),
        ("ndjson", '{"created_at": "2025-01-02T03:04:05Z"}\n'),
    ],
)
def test_times_are_iso_8601_utc_with_z(root: str, fmt: str, expected: str) -> None:
    result = run("audit", root, "--format", fmt, "--sql", "SELECT created_at FROM run")
    assert (result.exit_code, result.stdout) == (0, expected)


def _crashed_twice(root: str) -> None:
    """Attempt 0 commits after 2 batches and crashes 3 batches later; attempt 1 resumes,
    commits after 2 batches and crashes 1 batch later; attempt 2 resumes and commits."""
    token = None
    for committed, lost in ((2, 3), (2, 1), (1, 0)):
        loader = ledger.DataLoader(Augmented(40), batch_size=2, shuffle=True, seed=3, log=root)
        if token is not None:
            loader.load_state_dict(token)
        it = take(loader, committed + lost)
        for _ in range(committed):
            next(it)
        token = loader.state_dict()
        for _ in range(lost):
            next(it)  # journaled, never committed: what a kill loses


def test_check_accepts_crash_tails_up_to_a_limit(tmp_path: Path) -> None:
    root = str(tmp_path / "log")
    _crashed_twice(root)
    strict = run("audit", root, "--check", "abandoned", "--format", "csv")
    assert strict.exit_code == CHECK_FAILED
    assert strict.stdout == (
        "check,ok,detail\n"
        'abandoned,False,"journals hold 4 uncommitted batches (8 samples) in attempt(s) 0, 1"\n'
    )
    short = run(
        "audit", root, "--check", "abandoned", "--allow-uncommitted", "2", "--format", "csv"
    )
    assert short.exit_code == CHECK_FAILED
    assert short.stdout.endswith(
        "journals hold 3 uncommitted batches (6 samples) in attempt(s) 0 (over the 2 allowed)\n"
    )
    enough = run("audit", root, "--check", "all", "--allow-uncommitted", "3", "--format", "csv")
    assert enough.exit_code == 0, enough.output
    assert (
        "abandoned,True,every committed sample is in the lineage; 2 crash tails of 4 "
        "uncommitted batches accepted (at most 3 per attempt)\n"
    ) in enough.stdout
