"""The ``ledger`` command, through click's CliRunner, with exact expected output."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result
from logfactory import RUN_ID, example_log

from ledger.cli import main


@pytest.fixture
def root(tmp_path: Path) -> str:
    example_log(tmp_path / "log")
    return str(tmp_path / "log")


def run(*args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=stdin)


def assert_user_error(result: Result, line: str | None = None) -> None:
    """Exit 1, nothing on stdout, one ``Error:`` line on stderr (``line`` exactly if given)."""
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    assert result.stderr.startswith("Error: ")
    assert result.stderr.count("\n") == 1 and result.stderr.endswith("\n")
    assert "Traceback" not in result.stderr
    if line is not None:
        assert result.stderr == line + "\n"


# ---------------------------------------------------------------- --sql


def test_sql_csv(root: str) -> None:
    result = run(
        "audit", root, "--format", "csv", "--sql",
        "SELECT commit_id, parent, in_lineage, rows FROM commits ORDER BY commit_id",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "commit_id,parent,in_lineage,rows\n"
        "000000000002-0000,,True,6\n"
        "000000000004-0000,000000000002-0000,True,7\n"
        "000000000005-0000,000000000004-0000,False,3\n"
        "000000000006-0001,000000000004-0000,True,7\n"
        "000000000007-0001,000000000006-0001,True,3\n"
        "000000000007-0002,000000000007-0001,True,0\n"
    )


def test_sql_json(root: str) -> None:
    result = run(
        "audit", root, "--format", "json", "--sql",
        "SELECT attempt, parent, created_at, sum(pid) AS pids FROM attempts "
        "WHERE attempt < 2 GROUP BY ALL ORDER BY attempt",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "[\n"
        "  {\n"
        '    "attempt": 0,\n'
        '    "parent": null,\n'
        '    "created_at": "2025-01-02T00:00:00Z",\n'
        '    "pids": 1000\n'
        "  },\n"
        "  {\n"
        '    "attempt": 1,\n'
        '    "parent": "000000000004-0000",\n'
        '    "created_at": "2025-01-02T01:00:00Z",\n'
        '    "pids": 1001\n'
        "  }\n"
        "]\n"
    )


def test_sql_ndjson_from_stdin(root: str) -> None:
    sql = "SELECT epoch, count(*) AS samples FROM lineage WHERE kind = 'sample' GROUP BY 1\n"
    sql += "ORDER BY 1"
    result = run("audit", root, "--format", "ndjson", "--sql", "-", stdin=sql)
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        '{"epoch": 0, "samples": 9}\n{"epoch": 1, "samples": 9}\n{"epoch": 2, "samples": 3}\n'
    )


def test_sql_lineage_of_a_given_head(root: str) -> None:
    sql = "SELECT DISTINCT commit_id FROM lineage ORDER BY 1"
    result = run("audit", root, "--head", "000000000005-0000", "--format", "csv", "--sql", sql)
    assert result.exit_code == 0, result.output
    assert result.stdout == "commit_id\n000000000002-0000\n000000000004-0000\n000000000005-0000\n"


def test_sql_table(root: str) -> None:
    result = run("audit", root, "--sql", "SELECT 1 AS one, NULL AS nothing, '[b]x[/b]' AS s")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[3] == "│ 1   │ NULL    │ [b]x[/b] │"


@pytest.mark.parametrize(("fmt", "expected"), [("csv", "x,y\n"), ("json", "[]\n"), ("ndjson", "")])
def test_sql_empty_result(root: str, fmt: str, expected: str) -> None:
    result = run("audit", root, "--format", fmt, "--sql", "SELECT 1 AS x, 2 AS y WHERE false")
    assert (result.exit_code, result.stdout) == (0, expected)


# ---------------------------------------------------------------- summary


def test_summary_json(root: str) -> None:
    result = run("audit", root, "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "run_id": RUN_ID,
        "dataset_len": 10,
        "attempts": [
            {
                "attempt": 0,
                "parent": None,
                "commits": 3,
                "events": 16,
                "uncommitted_batches": 0,
                "uncommitted_samples": 0,
                "world_size": 1,
            },
            {
                "attempt": 1,
                "parent": "000000000004-0000",
                "commits": 2,
                "events": 10,
                "uncommitted_batches": 0,
                "uncommitted_samples": 0,
                "world_size": 1,
            },
            {
                "attempt": 2,
                "parent": "000000000007-0001",
                "commits": 1,
                "events": 0,
                "uncommitted_batches": 0,
                "uncommitted_samples": 0,
                "world_size": 1,
            },
            {
                "attempt": 3,
                "parent": "000000000007-0002",
                "commits": 0,
                "events": 0,
                "uncommitted_batches": 0,
                "uncommitted_samples": 0,
                "world_size": 1,
            },
        ],
        "commits": 6,
        "head": "000000000007-0002",
        "epochs": [
            {
                "epoch": 0,
                "samples": 9,
                "distinct": 9,
                "coverage": 0.9,
                "duplicates": 0,
                "skipped": 1,
                "skipped_distinct": 1,
                "covered": 10,
                "errors": 0,
                "rolled_back": 0,
            },
            {
                "epoch": 1,
                "samples": 9,
                "distinct": 8,
                "coverage": 0.8,
                "duplicates": 1,
                "skipped": 1,
                "skipped_distinct": 1,
                "covered": 9,
                "errors": 0,
                "rolled_back": 0,
            },
            {
                "epoch": 2,
                "samples": 3,
                "distinct": 3,
                "coverage": 0.3,
                "duplicates": 0,
                "skipped": 0,
                "skipped_distinct": 0,
                "covered": 3,
                "errors": 0,
                "rolled_back": 0,
            },
        ],
        "abandoned_commits": 1,
        "abandoned_samples": 3,
        "last_position": {"epoch": 2, "position": 2},
        "ranks": [
            {"rank": 0, "epoch": 2, "epoch_batch": 1, "batch": 7, "samples": 21, "behind": 0}
        ],
        "skew": None,
        "unreadable_journal_records": 0,
        "bad_samples": [],
        "skipped_batches": [],
    }
    ndjson = run("audit", root, "--format", "ndjson")
    assert ndjson.stdout.count("\n") == 1
    assert json.loads(ndjson.stdout) == json.loads(result.stdout)


def test_summary_table(root: str) -> None:
    result = run("audit", root, "--head", "000000000005-0000")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[:2] == [
        f"run {RUN_ID}, dataset of 10 samples",
        "4 attempts, 6 commits, head 000000000005-0000",
    ]
    assert (
        "│ 1       │ 000000000004-0000 │ 1     │ 2       │ 10     │ 0                   │" in lines
    )
    assert "│ 0     │ 9       │ 9        │ 90.00%   │ 0          │ 1       │" in lines
    assert "│ 1     │ 6       │ 6        │ 60.00%   │ 0          │ 0       │" in lines
    assert lines[-2:] == [
        "furthest committed position: epoch 1, position 5",
        "commits not in the lineage: 3, with 9 samples seen by discarded models",
    ]


# ---------------------------------------------------------------- user errors


def test_missing_root(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    assert_user_error(
        run("audit", str(missing)), f"Error: {missing} holds no ledger run (no run.json)"
    )


def test_unknown_head(root: str) -> None:
    assert_user_error(
        run("audit", root, "--head", "000000000099-0000"),
        f"Error: commit 000000000099-0000 does not exist under {root}: did you mean "
        "000000000006-0001 or 000000000007-0001 or 000000000007-0002?",
    )


def test_broken_chain(root: str) -> None:
    Path(root, "commits/000000000006-0001.json").unlink()
    assert_user_error(
        run("audit", root),
        "Error: commit 000000000007-0001 names parent 000000000006-0001, which does not exist",
    )


@pytest.mark.parametrize(
    ("sql", "prefix"),
    [
        ("SELECT * FROM nope", "Error: Catalog Error: Table with name nope does not exist!"),
        ("SELEC 1", "Error: Parser Error: syntax error at or near"),
        ("SELECT 1/0::INT + 'a'", "Error: Conversion Error"),
    ],
)
def test_bad_sql(root: str, sql: str, prefix: str) -> None:
    result = run("audit", root, "--sql", sql)
    assert_user_error(result)
    assert result.stderr.startswith(prefix)


def test_summary_has_no_csv_form(root: str) -> None:
    assert_user_error(
        run("audit", root, "--format", "csv"),
        "Error: the summary is several tables and has no csv form: use --format json, "
        "or --sql with --format csv",
    )


def test_sql_cannot_read_other_files(root: str) -> None:
    result = run("audit", root, "--sql", "SELECT * FROM read_csv('/etc/passwd')")
    assert_user_error(
        result,
        'Error: Permission Error: Cannot access file "/etc/passwd" - file system operations '
        "are disabled by configuration",
    )


def test_sql_cannot_write_files(root: str, tmp_path: Path) -> None:
    target = tmp_path / "out.csv"
    result = run("audit", root, "--sql", f"COPY (SELECT * FROM events) TO '{target}'")
    assert_user_error(result)
    assert "Permission Error" in result.stderr
    assert not target.exists()


# ---------------------------------------------------------------- help


def commands(group: click.Group) -> list[click.Command]:
    out: list[click.Command] = [group]
    for command in group.commands.values():
        out += commands(command) if isinstance(command, click.Group) else [command]
    return out


@pytest.mark.parametrize("command", commands(main), ids=lambda c: c.name)
def test_every_command_has_an_example(command: click.Command) -> None:
    assert re.search(r"^\s*Example:$", command.help or "", re.MULTILINE)
    assert len(commands(main)) >= 2  # the group and `audit` at least


def test_help_shows_the_example_unwrapped() -> None:
    result = run("audit", "--help")
    assert result.exit_code == 0
    example = 'echo "SELECT * FROM commits" | ledger audit /runs/exp7 --sql - --format json'
    assert f"\n      {example}\n" in result.stdout
