"""Damage real logs every which way and run every command and a resume on each.

Builds five small logs with the library's own writers (map-style, packed stream, a
mixture of two streams, a compacted map-style log, a 2-rank log resumed on 1 rank), each
with an abandoned branch and uncommitted batches. For every kind of file in them (the
oldest, the newest and the head's of each kind) it applies each damage (delete, empty,
a flipped byte in the middle and near the end, truncate, append garbage, a directory in
its place; for JSON: every field, at any depth, set to null, -1, 2**70, a RTL unicode
string, [], {}, 1.5, true, a path escaping the root), then runs ``ledger audit``,
``audit --check all``, ``verify``, ``where``, ``show`` (and ``--materialize`` on the
map-style log), ``reconstruct``, ``audit --sql``, ``report`` and ``compact`` in
process, and resumes from the head's token with ``load_state_dict``.

A *bug* is: an exception that is not a :class:`ledger.errors.LedgerError` (the CLI's
"unexpected ... a bug in ledger" line, or one out of ``load_state_dict``), an exit
status other than 0, 1 or 3, more than one ``Error:`` line, a command that ran past
``--timeout`` seconds, or (``--silent``) an exit status 0 with another output than the
undamaged log's (review these by hand: attempt records and journals are informational,
and a deleted newest marker is indistinguishable from a crash before that commit).
Prints each bug as it is found, and a count per log; exits 1 if any.

Example:
    nice -n 10 python tools/damage.py                   # every log (tens of minutes)
    python tools/damage.py --logs compacted --no-json   # the binary damages only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tools")]

from click.testing import CliRunner  # noqa: E402
from conftest import Augmented, packed_stream  # noqa: E402

import ledger  # noqa: E402
from ledger.cli import main as cli  # noqa: E402
from ledger.errors import LedgerError  # noqa: E402
from ledger.stream import ShardedSource, Stream  # noqa: E402
from ledger.testing import take  # noqa: E402

ODD: tuple[Any, ...] = (None, -1, 2**70, "é\u202e", [], {}, 1.5, True, "../../x")
COMMANDS = [
    ["audit"], ["audit", "--check", "all", "--format", "csv"], ["verify", "--format", "csv"],
    ["where", "--sample", "1"], ["show", "--batch", "1"], ["show", "--batch", "3"],
    ["reconstruct", "--commit", "{head}", "--out", "{out}"],
    ["audit", "--sql", "SELECT count(*) FROM lineage"], ["report", "--out", "{html}"],
    ["compact"],
]  # fmt: skip
CONFTEST = str(REPO / "tests" / "conftest.py")
MATERIALIZE = ["show", "--batch", "1", "--materialize", "--dataset", f"{CONFTEST}:Augmented",
               "--dataset-kwargs", '{{"n": 24}}']  # fmt: skip


class Timeout(Exception):
    pass


def _texts(rows: list[dict[str, Any]]) -> list[str]:
    return [r["text"] for r in rows]


def _loaders(shards: Path) -> dict[str, Callable[[str], ledger.DataLoader]]:
    def map_style(root: str) -> ledger.DataLoader:
        return ledger.DataLoader(Augmented(24), batch_size=3, shuffle=True, seed=3, log=root)

    def stream(root: str) -> ledger.DataLoader:
        return ledger.DataLoader(
            packed_stream(str(shards), shuffle_buffer=3), batch_size=2, shuffle=True, seed=5,
            log=root,
        )  # fmt: skip

    def mix(root: str) -> ledger.DataLoader:
        sources = {
            "a": Stream(ShardedSource(str(shards / "p0.parquet")), shuffle_buffer=2),
            "b": Stream(ShardedSource(str(shards / "p[12].parquet")), shuffle_buffer=3),
        }
        return ledger.DataLoader(
            ledger.Mixture(sources, weights={"a": 0.5, "b": 0.5}), batch_size=3, shuffle=True,
            seed=5, log=root, collate_fn=_texts,
        )  # fmt: skip

    return {"map": map_style, "stream": stream, "mix": mix, "compacted": map_style}


def build(
    kind: str, base: Path, make: Callable[[str], ledger.DataLoader] | None
) -> tuple[str, dict]:
    """The log of ``kind`` under ``base`` and its head's token: 8 batches committed every
    2, a resume from batch 4 that commits at 7 (the 8-0 branch abandoned), one batch
    uncommitted."""
    root = str(base / kind / "log")
    if kind == "elastic":
        import scale

        token = scale.build(root, 3, 2, 4)  # 2 ranks, 3 commits
        again = scale.loader(root, 4)  # on 1 rank
        again.load_state_dict(token)
        list(take(again, 2))
        token = again.state_dict()
        list(take(again, 1))
        return root, token
    assert make is not None
    first = make(root)
    tokens = [first.state_dict() for i, _ in enumerate(take(first, 8)) if i % 2 == 1]
    again = make(root)
    again.load_state_dict(tokens[1])
    list(take(again, 3))
    token = again.state_dict()
    list(take(again, 1))
    if kind == "compacted":
        from ledger.compaction import compact

        compact(root)
    return root, token


def damages(rel: str, data: bytes, fields: bool) -> Iterator[tuple[str, bytes | str | None]]:
    """``(name, new contents)``: ``None`` deletes the file, ``"DIR"`` puts a folder there."""
    mid = len(data) // 2
    yield "delete", None
    yield "empty", b""
    yield "flip", data[:mid] + bytes([data[mid] ^ 0x5A]) + data[mid + 1 :] if data else b"x"
    yield "flip-end", data[:-3] + bytes([data[-3] ^ 1]) + data[-2:] if len(data) > 3 else b"x"
    yield "truncate", data[: len(data) * 2 // 3]
    yield "append", data + b"\x00garbage\xff" * 3
    yield "dir", "DIR"
    if not (fields and rel.endswith(".json")):
        return
    doc = json.loads(data)

    def walk(node: Any, at: tuple = ()) -> Iterator[tuple]:
        pairs = (
            node.items()
            if isinstance(node, dict)
            else enumerate(node[:2])
            if isinstance(node, list)
            else ()
        )
        for k, v in pairs:
            yield (*at, k)
            yield from walk(v, (*at, k))

    for at in list(walk(doc)):
        for new in ODD:
            changed = json.loads(json.dumps(doc))
            node = changed
            for k in at[:-1]:
                node = node[k]
            node[at[-1]] = new
            yield f"set {'.'.join(map(str, at))}={new!r}", json.dumps(changed).encode()


def chosen(root: str, head: str) -> list[str]:
    """Per kind of file (its path with digits as N): the first, the last and the head's."""
    groups: dict[str, list[str]] = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_file():
            rel = str(p.relative_to(root))
            groups.setdefault(re.sub(r"\d+", "N", rel), []).append(rel)
    out: list[str] = []
    for files in groups.values():
        out += sorted(
            {files[0], files[-1], *(f for f in files if head in f or f"seg-{head[:12]}" in f)}
        )
    return out


def run(kind: str, root: str, token: dict, timeout: float) -> list[tuple[str, int, str]]:
    """``(command, exit status, output)`` of each command, ``-1`` for one that timed out;
    the resume's outcome as the last row (0 resumed, 1 a LedgerError, 2 anything else)."""
    tmp = Path(root).parent
    commands = COMMANDS + (
        [[*MATERIALIZE[:-1], '{{"n": 24}}']] if kind in ("map", "compacted") else []
    )
    out = []
    for args in commands:
        if kind == "mix" and args[0] == "where":
            args = [*args, "--source", "a"]
        argv = [
            a.format(head=token["commit"], out=tmp / "o.parquet", html=tmp / "r.html") for a in args
        ]
        signal.alarm(int(timeout))
        try:
            r = CliRunner().invoke(cli, [argv[0], root, *argv[1:]])
            status, text = r.exit_code, r.output
            if r.exception is not None and not isinstance(r.exception, SystemExit):
                status, text = 2, f"{type(r.exception).__name__}: {r.exception}"
        except Timeout:
            status, text = -1, "timed out"
        finally:
            signal.alarm(0)
        out.append((" ".join(args), status, text.replace(root, "<root>")))
    signal.alarm(int(timeout))
    try:
        loader = _LOADERS[kind](root)
        loader.load_state_dict(token)
        list(take(loader, 2))
        loader.state_dict()
        out.append(("resume", 0, ""))
    except LedgerError as e:
        out.append(("resume", 1, str(e)))
    except Timeout:
        out.append(("resume", -1, "timed out"))
    except Exception as e:  # what this tool looks for
        where = traceback.extract_tb(e.__traceback__)[-1]
        out.append(("resume", 2, f"{type(e).__name__}: {e} at {where.filename}:{where.lineno}"))
    finally:
        signal.alarm(0)
    return out


def bugs(
    found: list[tuple[str, int, str]], pristine: dict[str, tuple[int, str]], silent: bool
) -> Iterator[str]:
    for name, status, text in found:
        if status == -1:
            yield f"{name}: timed out"
        elif status == 2 or status not in (0, 1, 3) or "unexpected" in text:
            yield f"{name}: {text.strip()[-300:]}"
        elif name != "resume" and status == 1 and len(text.strip().splitlines()) != 1:
            yield f"{name}: more than one line: {text.strip()[-300:]}"
        elif (
            silent
            and status == 0
            and pristine.get(name, (0, text)) != (0, text)
            and name != "compact"
        ):
            yield f"{name}: exit 0, another output than the undamaged log's"


_LOADERS: dict[str, Callable[[str], ledger.DataLoader]] = {}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--logs", default="map,stream,mix,compacted,elastic", help="comma-separated")
    p.add_argument("--no-json", action="store_true", help="skip the JSON field damages")
    p.add_argument("--silent", action="store_true", help="also flag exit 0 with changed output")
    p.add_argument("--timeout", type=float, default=120, help="seconds per command")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    a = p.parse_args(argv)

    def alarm(*_: Any) -> None:
        raise Timeout

    signal.signal(signal.SIGALRM, alarm)
    base = Path(a.dir or tempfile.mkdtemp(prefix="ledger-damage-"))
    shards = base / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    for s in range(3):
        rows = [f"shard {s} doc {i} " + "x" * (3 * i) for i in range(6)]
        pq.write_table(pa.table({"text": rows}), shards / f"p{s}.parquet", row_group_size=2)
    _LOADERS.update(_loaders(shards))
    import scale

    _LOADERS["elastic"] = lambda root: scale.loader(root, 4)
    total = 0
    for kind in a.logs.split(","):
        root, token = build(kind, base, _LOADERS.get(kind))
        work = base / kind / "work"
        # Every run is on a fresh copy of the log, the undamaged one's too: the resume
        # appends to the log it runs on (an attempt record, a journal).
        if work.exists():
            shutil.rmtree(work)
        shutil.copytree(root, work)
        pristine = {
            name: (status, text) for name, status, text in run(kind, str(work), token, a.timeout)
        }
        found = 0
        for rel in chosen(root, token["commit"]):
            data = Path(root, rel).read_bytes()
            for how, new in damages(rel, data, not a.no_json):
                if work.exists():
                    shutil.rmtree(work)
                shutil.copytree(root, work)
                os.unlink(work / rel)
                if new == "DIR":
                    (work / rel).mkdir()
                elif new is not None:
                    (work / rel).write_bytes(new)  # type: ignore[arg-type]
                for bug in bugs(run(kind, str(work), token, a.timeout), pristine, a.silent):
                    print(f"BUG {kind} | {rel} | {how} | {bug}", flush=True)
                    found += 1
        print(f"{kind}: {found} bugs", flush=True)
        total += found
    sys.exit(1 if total else 0)


if __name__ == "__main__":
    main()
