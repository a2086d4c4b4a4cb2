"""``ledger audit --check``, ``where``, ``show``, ``reconstruct``, ``verify`` and
``report`` through click's CliRunner, with exact expected output on the fixed log of
``logfactory.example_log`` (and, for ``--materialize``, a log a real loader wrote)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner, Result
from conftest import Augmented
from logfactory import example_log

import ledger
from ledger.cli import CHECK_FAILED, main
from ledger.digest import batch_digest
from ledger.testing import take

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture
def root(tmp_path: Path) -> str:
    example_log(tmp_path / "log")
    return str(tmp_path / "log")


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


# ---------------------------------------------------------------- audit --check


def test_checks_table_and_exit_status(root: str) -> None:
    result = run("audit", root, "--check", "all")
    assert result.exit_code == CHECK_FAILED, result.output
    assert result.stdout == (
        "┏━━━━━━━━━━━━┳━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┓\n"
        "┃ check      ┃ result ┃ detail                                                 ┃\n"
        "┡━━━━━━━━━━━━╇━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┩\n"
        "│ coverage   │ FAIL   │ epoch 1: 1 samples neither consumed nor skipped        │\n"
        "│ duplicates │ FAIL   │ duplicate consumptions: epoch 1: 1                     │\n"
        "│ skips      │ pass   │ 2 samples skipped, at most 2 per epoch                 │\n"
        "│ abandoned  │ FAIL   │ 1 commits off the lineage hold 3 samples; 1 orphan     │\n"
        "│            │        │ segments                                               │\n"
        "│            │        │ (events/attempt=0/rank=0/seg-000000000006.parquet ...) │\n"
        "│ progress   │ pass   │ 1 ranks at epoch 2, batch 7; none went back            │\n"
        "│ skew       │ pass   │ one rank: no skew                                      │\n"
        "└────────────┴────────┴────────────────────────────────────────────────────────┘\n"
    )


def test_passing_checks_exit_0_and_csv(root: str) -> None:
    result = run("audit", root, "--check", "skips", "--check", "progress", "--format", "csv")
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "check,ok,detail\n"
        'skips,True,"2 samples skipped, at most 2 per epoch"\n'
        'progress,True,"1 ranks at epoch 2, batch 7; none went back"\n'
    )


def test_checks_on_an_older_head(root: str) -> None:
    # The lineage of 000000000004-0000: epoch 0 complete, epoch 1 begun, no duplicate yet.
    result = run(
        "audit", root, "--head", "000000000004-0000", "--check", "coverage",
        "--check", "duplicates", "--format", "json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [
        {
            "check": "coverage",
            "ok": True,
            "detail": "1 finished epochs cover all 10 samples; epoch 1 at 30.00%",
        },
        {"check": "duplicates", "ok": True, "detail": "no sample consumed twice in 2 epochs"},
    ]


def test_check_and_sql_exclude_each_other(root: str) -> None:
    result = run("audit", root, "--check", "coverage", "--sql", "SELECT 1")
    assert result.exit_code == 2
    assert "--check and --sql cannot be combined" in result.stderr


def test_skew_limit(root: str) -> None:
    result = run("audit", root, "--check", "skew", "--max-skew", "0", "--format", "ndjson")
    assert result.exit_code == 0
    assert result.stdout == '{"check": "skew", "ok": true, "detail": "one rank: no skew"}\n'


# ---------------------------------------------------------------- where


def test_where_table(root: str) -> None:
    result = run("where", root, "--sample", "5")
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "sample 5: 3 consumptions, 3 in the lineage of 000000000007-0002\n"
        "┏━━━━━━━━━┳━━━━━━┳━━━━━━━┳━━━━━━━┳━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━┓\n"
        "┃ attempt ┃ rank ┃ epoch ┃ batch ┃ position ┃ commit            ┃ lineage ┃\n"
        "┡━━━━━━━━━╇━━━━━━╇━━━━━━━╇━━━━━━━╇━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━┩\n"
        "│ 0       │ 0    │ 0     │ 1     │ 5        │ 000000000002-0000 │ yes     │\n"
        "│ 0       │ 0    │ 1     │ 3     │ 0        │ 000000000004-0000 │ yes     │\n"
        "│ 1       │ 0    │ 1     │ 5     │ 7        │ 000000000006-0001 │ yes     │\n"
        "└─────────┴──────┴───────┴───────┴──────────┴───────────────────┴─────────┘\n"
        "commits whose model saw it: 6\n"
        "000000000002-0000, 000000000004-0000, 000000000005-0000, 000000000006-0001, "
        "000000000007-0001, 000000000007-0002\n"
    )


def test_where_json_matches_the_rows_written(root: str, tmp_path: Path) -> None:
    """Ground truth: every committed row of sample 1, and the commits downstream of them."""
    factory = example_log(tmp_path / "again")
    result = run("where", str(factory.root), "--sample", "1", "--format", "json")
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    expected = sorted(
        (cid, row[0], row[4], row[5])
        for cid, rows in factory.committed.items()
        for row in rows
        if row[6] == 1 and row[7] == "sample"
    )
    assert (
        sorted(
            (c["commit_id"], c["attempt"], c["batch"], c["position"]) for c in got["consumptions"]
        )
        == expected
    )
    # 1 is in batch 0 (commit 2-0000) and batch 4 of both branches: every commit saw it.
    assert got["commits"] == [
        "000000000002-0000", "000000000004-0000", "000000000005-0000",
        "000000000006-0001", "000000000007-0001", "000000000007-0002",
    ]  # fmt: skip
    lineage = {c["commit_id"]: c["in_lineage"] for c in got["consumptions"]}
    assert lineage["000000000005-0000"] is False and lineage["000000000006-0001"] is True


def test_where_a_sample_only_an_abandoned_model_saw(tmp_path: Path) -> None:
    root = str(tmp_path / "log")
    loader = ledger.DataLoader(Augmented(12), batch_size=3, shuffle=True, seed=4, log=root)
    it = iter(loader)
    next(it)
    token = loader.state_dict()
    lost = next(it)["id"].tolist()
    loader.state_dict()  # commits batch 1, then the run resumes from batch 0's token
    resumed = ledger.DataLoader(Augmented(12), batch_size=3, shuffle=True, seed=4, log=root)
    resumed.load_state_dict(token)
    redo = next(iter(resumed))["id"].tolist()
    assert redo == lost
    resumed.state_dict()
    got = json.loads(run("where", root, "--sample", str(lost[0]), "--format", "json").stdout)
    assert [(c["attempt"], c["in_lineage"]) for c in got["consumptions"]] == [
        (0, False),
        (1, True),
    ]
    assert got["commits"] == ["000000000002-0000", "000000000002-0001"]


def test_where_a_sample_never_consumed(root: str) -> None:
    # Sample 4: skipped by drop_last in epoch 0 (position 9), in no consumed batch since.
    result = run("where", root, "--sample", "4")
    assert result.exit_code == 0
    assert result.stdout == (
        "sample 4: 0 consumptions, 0 in the lineage of 000000000007-0002\n"
        "commits whose model saw it: 0\n"
    )


def test_where_a_sample_outside_the_dataset(root: str) -> None:
    for sample in ("10", "-1"):
        result = run("where", root, "--sample", sample)
        assert result.exit_code == 2
        assert result.stderr.endswith(
            f"Error: Invalid value for '--sample': sample {sample} is outside the dataset: "
            "its ids are 0 to 9\n"
        )


# ---------------------------------------------------------------- show


def test_show_table(root: str) -> None:
    result = run("show", root, "--batch", "5")
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "batch 5 of rank 0: epoch 1, worker 1, commit 000000000006-0001, 3 events\n"
        "recorded digest:     -\n"
        "┏━━━━━━━━━━┳━━━━━━━━━━━┳━━━━━━━━┳━━━━━━━━━━━━━┳━━━━━━━━━━━┳━━━━━━━━┳━━━━━━━┓\n"
        "┃ position ┃ sample_id ┃ kind   ┃ token_start ┃ token_end ┃ length ┃ value ┃\n"
        "┡━━━━━━━━━━╇━━━━━━━━━━━╇━━━━━━━━╇━━━━━━━━━━━━━╇━━━━━━━━━━━╇━━━━━━━━╇━━━━━━━┩\n"
        "│ 6        │ 7         │ sample │             │           │        │       │\n"
        "│ 7        │ 5         │ sample │             │           │        │       │\n"
        "│ 8        │ 3         │ sample │             │           │        │       │\n"
        "└──────────┴───────────┴────────┴─────────────┴───────────┴────────┴───────┘\n"
    )


def test_show_takes_the_batch_from_the_lineage(root: str) -> None:
    # Batch 4 exists on both branches (same samples); the head's lineage is attempt 1's.
    lineage = json.loads(run("show", root, "--batch", "4", "--format", "json").stdout)
    old = json.loads(
        run("show", root, "--batch", "4", "--head", "000000000005-0000", "--format", "json").stdout
    )
    assert lineage["commit_id"] == "000000000006-0001"
    assert old["commit_id"] == "000000000005-0000"
    assert [e["sample_id"] for e in lineage["events"]] == [2, 9, 1]


def test_show_a_batch_not_in_the_lineage(root: str) -> None:
    result = run("show", root, "--batch", "7")
    assert result.exit_code == 1
    assert result.stderr == (
        f"Error: the lineage of the default head in {root} holds no batch 7 of rank 0: it "
        "was not reached, or not committed\n"
    )


def test_show_materialize_reproduces_the_recorded_digest(tmp_path: Path) -> None:
    root = str(tmp_path / "log")
    loader = ledger.DataLoader(Augmented(20), batch_size=4, shuffle=True, seed=3, log=root)
    received = list(loader)
    loader.state_dict()
    conftest = str(Path(__file__).with_name("conftest.py"))
    result = run(
        "show", root, "--batch", "2", "--materialize", "--dataset", f"{conftest}:Augmented",
        "--dataset-kwargs", '{"n": 20}', "--format", "json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    digest = batch_digest(received[2])
    assert got["digest"] == got["materialized_digest"] == digest
    assert got["matches"] is True
    assert [e["sample_id"] for e in got["events"]] == received[2]["id"].tolist()
    table = run(
        "show", root, "--batch", "2", "--materialize", "--dataset", f"{conftest}:Augmented",
        "--dataset-kwargs", '{"n": 20}',
    )  # fmt: skip
    assert table.stdout.splitlines()[1:3] == [
        f"recorded digest:     {digest}",
        f"materialized digest: {digest} (matches)",
    ]


class Shifted(Augmented):
    """Another dataset of the same length: materialising with it must be detected."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(i)
        item["x"] = item["x"] + 1
        return item


def test_show_materialize_detects_another_dataset(tmp_path: Path) -> None:
    root = str(tmp_path / "log")
    loader = ledger.DataLoader(Augmented(20), batch_size=4, log=root)
    list(loader)
    loader.state_dict()
    result = run(
        "show", root, "--batch", "0", "--materialize", "--dataset",
        f"{__file__}:Shifted", "--dataset-kwargs", '{"n": 20}',
    )  # fmt: skip
    assert result.exit_code == CHECK_FAILED
    assert "(DIFFERS)" in result.stdout.splitlines()[2]


def test_show_materialize_needs_a_dataset(root: str) -> None:
    result = run("show", root, "--batch", "0", "--materialize")
    assert result.exit_code == 2
    assert "--materialize needs --dataset" in result.stderr


class _Raises(Augmented):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        raise KeyError(f"row {i} is missing")


def _no_dataset() -> None:
    return None


_NOT_CALLABLE = 3


def _ids_only(batch: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """A collate function of the run's own (``--collate`` names it as it is)."""
    return torch.stack([sample["id"] for sample in batch])


def test_show_materialize_with_the_runs_collate_function(tmp_path: Path) -> None:
    root = str(tmp_path / "log")
    loader = ledger.DataLoader(Augmented(20), batch_size=4, log=root, collate_fn=_ids_only)
    received = list(loader)
    loader.state_dict()
    result = run(
        "show", root, "--batch", "1", "--materialize", "--dataset", f"{__file__}:Augmented",
        "--dataset-kwargs", '{"n": 20}', "--collate", f"{__file__}:_ids_only", "--format", "json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert got["matches"] is True and got["digest"] == batch_digest(received[1])


@pytest.mark.parametrize(
    ("extra", "code", "said"),
    [
        (["--dataset", "{here}:Augmented"], 2, "Augmented(**{}) raised TypeError"),
        (["--dataset", "{here}:_no_dataset"], 2, "gave NoneType, not a dataset"),
        (["--dataset", "os:path"], 2, "gave module, not a dataset"),
        (
            ["--dataset", "{here}:Augmented", "--dataset-kwargs", '{"n": 20}', "--collate",
             "{here}:_NOT_CALLABLE"],
            2, "_NOT_CALLABLE is int, not callable",
        ),
        (
            ["--dataset", "{here}:_Raises", "--dataset-kwargs", '{"n": 20}'],
            1, "re-creating batch 0: the dataset or collate function raised KeyError",
        ),
    ],
)  # fmt: skip
def test_show_materialize_names_the_users_mistake(tmp_path: Path, extra, code, said) -> None:
    """What the user's ``--dataset`` or ``--collate`` gets wrong is said as theirs (a usage
    error, or an ``Error:`` naming the dataset's exception), not as a bug of ledger's."""
    root = str(tmp_path / "log")
    loader = ledger.DataLoader(Augmented(20), batch_size=4, log=root)
    list(loader)
    loader.state_dict()
    args = [a.replace("{here}", __file__) for a in extra]
    result = run("show", root, "--batch", "0", "--materialize", *args)
    assert result.exit_code == code, result.output
    assert said in result.stderr
    assert "a bug in ledger" not in result.stderr


def test_json_output_has_no_nan_or_infinity(root: str) -> None:
    """JSON has no NaN or Infinity: DuckDB's ``x / 0`` and ``0.0 / 0`` are ``null``."""
    query = "SELECT 1.0 / 0 AS inf, 0.0 / 0 AS nan, 2.5 AS fine, [1.0 / 0, 1.0] AS listed"
    for fmt in ("json", "ndjson"):
        result = run("audit", root, "--format", fmt, "--sql", query)
        assert result.exit_code == 0, result.output
        rows = (
            [json.loads(line) for line in result.stdout.splitlines()]
            if fmt == "ndjson"
            else (json.loads(result.stdout))
        )
        assert rows == [{"inf": None, "nan": None, "fine": 2.5, "listed": [None, 1.0]}]


# ---------------------------------------------------------------- reconstruct


def test_reconstruct_writes_the_lineage_in_order(root: str, tmp_path: Path) -> None:
    out = tmp_path / "seen.parquet"
    result = run("reconstruct", root, "--commit", "000000000006-0001", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert result.stdout == (f"wrote 18 events of the lineage of 000000000006-0001 to {out}\n")
    factory_rows = example_log(tmp_path / "truth").committed
    expected = [
        (row[4], row[6])
        for cid in ("000000000002-0000", "000000000004-0000", "000000000006-0001")
        for row in factory_rows[cid]
        if row[7] == "sample"
    ]
    table = pq.read_table(out)
    assert list(zip(table["batch"].to_pylist(), table["sample_id"].to_pylist(), strict=True)) == (
        expected
    )
    assert table["ordinal"].to_pylist() == list(range(18))
    assert set(table["commit_id"].to_pylist()) == {
        "000000000002-0000", "000000000004-0000", "000000000006-0001",
    }  # fmt: skip


def test_reconstruct_of_a_damaged_log_leaves_the_previous_output(root: str, tmp_path: Path) -> None:
    out = tmp_path / "seen.parquet"
    assert (
        run("reconstruct", root, "--commit", "000000000002-0000", "--out", str(out)).exit_code == 0
    )
    before = out.read_bytes()
    segment = sorted(Path(root, "events", "attempt=1").rglob("*.parquet"))[0]
    segment.write_bytes(segment.read_bytes()[:-1] + b"x")  # one byte altered
    result = run("reconstruct", root, "--commit", "000000000006-0001", "--out", str(out))
    assert result.exit_code == 1
    assert "SHA-256" in result.stderr or "sha256" in result.stderr.lower(), result.stderr
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".seen")) == []


def test_reconstruct_an_unknown_commit(root: str, tmp_path: Path) -> None:
    result = run("reconstruct", root, "--commit", "000000000099-0000", "--out", str(tmp_path / "x"))
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and "000000000099-0000" in result.stderr


# ---------------------------------------------------------------- verify


def test_verify_table(root: str) -> None:
    result = run("verify", root)
    assert result.exit_code == CHECK_FAILED  # the example lineage repeats a sample
    assert result.stdout == (
        "┏━━━━━━━━━━━━┳━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┓\n"
        "┃ check      ┃ result ┃ detail                                                 ┃\n"
        "┡━━━━━━━━━━━━╇━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┩\n"
        "│ markers    │ pass   │ 6 commit markers parse                                 │\n"
        "│ chain      │ pass   │ every parent exists, steps never go back               │\n"
        "│ segments   │ pass   │ 5 segments match their markers (26 events)             │\n"
        "│ duplicates │ FAIL   │ epoch 1: 1 duplicates                                  │\n"
        "│ orphans    │ pass   │ 1 orphan segments, ignored by replay                   │\n"
        "│            │        │ (events/attempt=0/rank=0/seg-000000000006.parquet ...) │\n"
        "│ manifest   │ pass   │ 0 manifests match their markers' rank tables; 6 older  │\n"
        "│            │        │ markers name none                                      │\n"
        "└────────────┴────────┴────────────────────────────────────────────────────────┘\n"
        f"5 segments, 26 events, {_size(root)} bytes\n"
    )


def _size(root: str) -> int:
    return sum(
        s["bytes"]
        for p in sorted(Path(root, "commits").glob("*.json"))
        for s in json.loads(p.read_text())["segments"]
    )


def test_verify_a_clean_log_and_a_tampered_one(tmp_path: Path) -> None:
    root = str(tmp_path / "log")
    loader = ledger.DataLoader(Augmented(12), batch_size=3, shuffle=True, log=root)
    for i, _ in enumerate(loader):
        if i % 2:
            loader.state_dict()
    loader.state_dict()
    result = run("verify", root, "--format", "json")
    assert result.exit_code == 0, result.output
    checks = json.loads(result.stdout)
    assert [r["ok"] for r in checks] == [True] * 6
    assert checks[-1]["check"] == "manifest"
    segment = sorted(Path(root, "events").rglob("*.parquet"))[0]
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF
    segment.write_bytes(bytes(data))
    result = run("verify", root, "--format", "json")
    assert result.exit_code == CHECK_FAILED
    got = {r["check"]: r for r in json.loads(result.stdout)}
    assert got["segments"]["ok"] is False
    assert "has another SHA-256 than its marker" in got["segments"]["detail"]
    assert got["duplicates"] == {
        "check": "duplicates", "ok": False, "detail": "not checked: the log is damaged",
    }  # fmt: skip


def test_verify_finds_a_broken_chain(root: str) -> None:
    Path(root, "commits", "000000000004-0000.json").unlink()
    result = run("verify", root, "--format", "json")
    assert result.exit_code == CHECK_FAILED
    chain = json.loads(result.stdout)[1]
    assert chain["check"] == "chain" and chain["ok"] is False
    assert "000000000005-0000: parent 000000000004-0000 is missing" in chain["detail"]


# ---------------------------------------------------------------- report


def test_report_writes_a_page(root: str, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    result = run("report", root, "--out", str(out))
    assert result.exit_code == 0, result.output
    assert result.stdout == f"wrote {out}\n"
    assert out.read_text().lstrip().lower().startswith("<!doctype html>")


# ---------------------------------------------------------------- docs


def test_every_command_is_documented_in_the_readme() -> None:
    readme = README.read_text()
    for name in main.commands:
        assert re.search(rf"`ledger {name}\b", readme), f"`ledger {name}` not in README.md"
        help_text = main.commands[name].help or ""
        assert "Example:" in help_text, f"ledger {name} --help has no example"
    for check in ("coverage", "duplicates", "skips", "abandoned", "progress", "skew"):
        assert f"`{check}`" in readme, f"check {check} not in README.md"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["show", "{root}", "--batch", str(2**64)], "--batch': 18446744073709551616 is not in"),
        (["audit", "{root}", "--sql", " "], "Invalid value for '--sql': the query is empty"),
    ],
)
def test_a_batch_beyond_int64_or_an_empty_query_is_a_usage_error(tmp_path, args, match):
    """Not an 'unexpected TypeError' from Arrow, nor an AttributeError on no result."""
    root = str(tmp_path / "log")
    loader = ledger.DataLoader(list(range(8)), batch_size=2, seed=0, log=root)
    list(take(loader, 1))
    loader.state_dict()
    result = CliRunner().invoke(main, [a.format(root=root) for a in args])
    assert result.exit_code == 2 and match in result.output, result.output
