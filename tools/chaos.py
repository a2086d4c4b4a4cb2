"""Chaos: SIGKILL training processes at uniformly random wall-clock times, resume, compare.

Each trial runs a small training loop (a child process of this script) that consumes a
``ledger.DataLoader`` and checkpoints every 3 batches (the token written atomically after
``state_dict()``). The parent SIGKILLs the child, and every process under it (DataLoader
workers, torchrun agents and ranks), at a time drawn uniformly from ``[0, T)`` where ``T``
is how long an uninterrupted run took, not at a printed line, so kills land anywhere:
during imports, mid-batch, mid-commit, between the segment and the marker. 1-3 kills per
trial; after the last one the child resumes from the newest checkpoint and runs to the
end. The stream the training loop received (each run's batches up to the checkpoint the
next run resumed from, then the last run's) is compared with an uninterrupted run:

* ``exact``: identical, batch for batch (for the elastic scenario, whose order after a
  world-size change is by design another, and the reshape scenarios, whose
  ``num_workers`` changes at every run: every finished epoch holds each sample once and
  nothing is consumed twice, and ``ledger audit --check coverage --check duplicates``
  passes; for the packed stream, the audit only);
* ``not exact``: it differs;
* ``error``: a resume or the final run exited non-zero (the first lines of its stderr
  are kept);
* ``hung``: the final run did not finish within ``--timeout`` seconds.

Scenarios: map-style, stream and packed stream, a map-style dataset beside a stream in one
``ledger.Mixture`` (``mix``) and the same packed (``mixpacked``), each with 0 and 2
DataLoader workers; a 2-rank torchrun job (``torch.distributed`` with gloo); an elastic
change (2 ranks under torchrun, killed, resumed with 1 rank); a stream and a packed stream
whose ``num_workers`` changes at every run (2, 0, 3, 2, ...: what the old workers left is
carried to the new ones, :func:`ledger.stream.plan.carry_over`). Trials cycle through them.

Example:
    nice -n 10 python tools/chaos.py --trials 200        # the full table (about an hour)
    python tools/chaos.py --trials 8 --timeout 120        # a quick round, one per scenario
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCENARIOS = (
    "map-0",
    "map-2",
    "stream-0",
    "stream-2",
    "packed-0",
    "packed-2",
    "mix-0",
    "mix-2",
    "mixpacked-0",
    "mixpacked-2",
    "torchrun",
    "elastic",
    "reshape-stream",
    "reshape-packed",
)
RESHAPES = (2, 0, 3)  # num_workers of run k of a reshape scenario: RESHAPES[k % 3]
TOTAL = 14  # batches per rank of a trial
RESHAPE_TOTAL = 40  # of a reshape trial: two epochs and more, so that epochs finish
RESHAPE_PACE = 0.1  # seconds a reshape trial's training step takes (kills land mid-run)
EVERY = 3  # batches between checkpoints
OUTCOMES = ("exact", "not exact", "error", "hung")


# ---------------------------------------------------------------- the child (training loop)


def _shards(workdir: str) -> str:
    """Four small Parquet shards (ids 0..49, 4-row row groups), written once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = os.path.join(workdir, "shards")
    if os.path.exists(os.path.join(folder, "done")):
        return folder
    os.makedirs(folder, exist_ok=True)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "ledger",
        "logs",
    ]
    for s in range(4):
        ids = list(range(s * 13, min(50, (s + 1) * 13)))
        text = [" ".join(words[(i * 7 + k) % len(words)] for k in range(1 + i % 9)) for i in ids]
        pq.write_table(
            pa.table({"id": ids, "text": text}), os.path.join(folder, f"s{s}.parquet"),
            row_group_size=4,
        )  # fmt: skip
    Path(folder, "done").touch()
    return folder


class _Data:
    """Map-style: item ``i`` holds ``i`` and a draw of the per-sample RNG."""

    def __len__(self) -> int:
        return 37

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        return {"id": torch.tensor(i), "x": torch.rand(2)}


class _Docs:
    """Map-style, packed: item ``i`` is the token ids of a text holding ``i`` and a draw of
    the per-sample RNG."""

    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int) -> Any:
        import numpy as np
        import torch

        text = f"doc {i} {int(torch.randint(0, 1000, ()).item())}"
        return np.frombuffer(text.encode(), np.uint8).astype(np.int64) + 1


def _ids(rows: list[dict[str, Any]]) -> list[int]:
    return [int(r["id"]) for r in rows]


def _tokens(record: dict[str, Any], ctx: Any) -> Any:
    import numpy as np

    return np.frombuffer(record["text"].encode(), np.uint8).astype(np.int64) + 1


def _mixed_rows(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """A mixture batch as JSON: ``["m", id, x0]`` for a map-style sample (``x0``: its RNG
    draw), ``["s", id]`` for a stream row."""
    return [
        ["m", int(r["id"]), float(r["x"][0])] if "x" in r else ["s", int(r["id"])] for r in rows
    ]


def _loader(kind: str, workers: int, root: str, workdir: str) -> tuple[Any, str]:
    import ledger
    from ledger.stream import Packer, ShardedSource, Stream

    if kind in ("mix", "mixpacked"):
        # A map-style dataset beside a stream in one Mixture: lanes, source epochs and
        # (mixpacked) one packer over both.
        source = ShardedSource(os.path.join(_shards(workdir), "*.parquet"))
        if kind == "mix":
            mix = ledger.Mixture(
                {"map": _Data(), "text": Stream(source, shuffle_buffer=5)},
                weights={"map": 0.4, "text": 0.6},
            )
            loader = ledger.DataLoader(
                mix, batch_size=3, shuffle=True, seed=7, log=root, num_workers=workers,
                collate_fn=_mixed_rows,
            )  # fmt: skip
            return loader, ""
        packer = Packer(seq_len=16)
        mix = ledger.Mixture(
            {
                "map": _Docs(),
                "text": Stream(source, transform=_tokens, shuffle_buffer=4, packer=packer),
            },
            weights={"map": 0.5, "text": 0.5},
        )
        loader = ledger.DataLoader(
            mix, batch_size=2, shuffle=True, seed=7, log=root, num_workers=workers
        )
        return loader, "packed"
    if kind == "map":
        loader = ledger.DataLoader(
            _Data(), batch_size=4, shuffle=True, seed=7, log=root, num_workers=workers
        )
        return loader, "id"
    source = ShardedSource(os.path.join(_shards(workdir), "*.parquet"))
    if kind == "stream":
        stream = Stream(source, shuffle_buffer=5)
        loader = ledger.DataLoader(
            stream, batch_size=3, shuffle=True, seed=7, log=root, num_workers=workers,
            collate_fn=_ids,
        )  # fmt: skip
        return loader, ""
    stream = Stream(source, transform=_tokens, shuffle_buffer=4, packer=Packer(seq_len=16))
    loader = ledger.DataLoader(
        stream, batch_size=2, shuffle=True, seed=7, log=root, num_workers=workers
    )
    return loader, "packed"


def child(argv: list[str]) -> None:
    """``--child KIND WORKERS ROOT OUT CKPT WORKDIR [--resume]``: train, checkpoint, log."""
    kind, workers, root, out, ckpt, workdir = argv[:6]
    reshape, _, plain = kind.rpartition(":")  # "reshape:stream": more batches
    kind, total = plain, RESHAPE_TOTAL if reshape else TOTAL
    rank = 0
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and os.environ["WORLD_SIZE"] != "1":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    loader, key = _loader(kind, int(workers), root, workdir)
    step = 0
    if "--resume" in argv and os.path.exists(ckpt):
        with open(ckpt) as f:
            token = json.load(f)
        loader.load_state_dict(token)
        step = loader.state.batch
    with open(f"{out}.{rank}", "a") as f:
        f.write(json.dumps({"start": step}) + "\n")
        f.flush()
        while step < total:
            for batch in loader:
                if key == "packed":  # the owners and the tokens (a map-style sample's draw)
                    ids = batch["sample_ids"].reshape(-1).tolist()
                    ids += batch["tokens"].reshape(-1).tolist()
                else:
                    ids = batch if not key else batch[key]
                    ids = ids if isinstance(ids, list) else ids.reshape(-1).tolist()
                state = loader.state
                epoch = state.epoch - 1 if state.epoch_batch == 0 else state.epoch
                f.write(json.dumps({"step": step, "epoch": epoch, "ids": ids}) + "\n")
                if reshape:
                    time.sleep(RESHAPE_PACE)
                f.flush()
                step += 1
                if step % EVERY == 0:
                    token = loader.state_dict()
                    if rank == 0:
                        with open(ckpt + ".tmp", "w") as t:
                            json.dump(token, t)
                        os.replace(ckpt + ".tmp", ckpt)
                if step >= total:
                    break
    if rank == 0:
        with open(ckpt + ".done", "w") as t:
            t.write("done")


# ---------------------------------------------------------------- the parent


@dataclass
class Trial:
    scenario: str
    kills: int
    outcome: str = ""
    detail: str = ""
    killed_at: list[float] = field(default_factory=list)


def _command(
    scenario: str, run: int, root: str, out: str, ckpt: str, workdir: str, final: bool = False
) -> list[str]:
    """The child's command line; the elastic scenario's final run has 1 rank, not 2."""
    kind, _, workers = scenario.partition("-")
    me = os.path.abspath(__file__)
    tail = [root, out, ckpt, workdir] + (["--resume"] if run else [])
    if scenario in ("torchrun", "elastic"):
        ranks = 1 if scenario == "elastic" and final else 2
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", me, "--child", "map", "1", *tail,
        ]  # fmt: skip
    if kind == "reshape":  # another num_workers at each run: the stream's carry dealing
        kind, workers = f"reshape:{workers}", str(RESHAPES[run % 3])
    return [sys.executable, me, "--child", kind, workers, *tail]


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc`` and every process under it (ranks may run in their own sessions)."""
    import psutil

    try:
        parent = psutil.Process(proc.pid)
        victims = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        victims = []
    for p in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(victims, timeout=5)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _runs(out: str, rank: int, n: int) -> list[list[dict[str, Any]]]:
    runs = []
    for k in range(n):
        path = f"{out}-{k}.{rank}"
        lines = Path(path).read_text().splitlines() if os.path.exists(path) else []
        recs = []
        for line in lines:
            try:
                recs.append(json.loads(line))
            except ValueError:
                break  # a line torn by the kill
        runs.append(recs)
    return runs


def _effective(runs: list[list[dict[str, Any]]], starts: list[int | None]) -> list[dict[str, Any]]:
    """What the training loop of the surviving lineage received: each run's batches from
    its start up to where the next run resumed (``starts``: each run's start step, from
    rank 0, which every run has; a rank absent from the next run, after an elastic change,
    is cut there too)."""
    got: list[dict[str, Any]] = []
    for k, recs in enumerate(runs):
        batches = [r for r in recs if "step" in r]
        nxt = next((s for s in starts[k + 1 :] if s is not None), None)
        got += [b for b in batches if nxt is None or b["step"] < nxt]
    return got


def _starts(out: str, n: int) -> list[int | None]:
    """Each run's start step, from rank 0's file (``None``: killed before it began)."""
    return [next((r["start"] for r in recs if "start" in r), None) for recs in _runs(out, 0, n)]


def reference(scenario: str, workdir: str, timeout: float) -> tuple[dict[int, list], float]:
    """An uninterrupted run's batches per rank, and how long it took (seconds)."""
    base = os.path.join(workdir, f"ref-{scenario}")
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    root, out, ckpt = os.path.join(base, "log"), os.path.join(base, "out"), base + "/ckpt.json"
    cmd = _command(scenario, 0, root, out + "-0", ckpt, workdir)
    t = time.monotonic()
    done = subprocess.run(cmd, env=_env(), capture_output=True, timeout=timeout)
    took = time.monotonic() - t
    if done.returncode != 0:
        raise SystemExit(f"the reference run of {scenario} failed:\n{done.stderr.decode()[-2000:]}")
    ranks = 2 if scenario in ("torchrun", "elastic") else 1
    return {r: _effective(_runs(out, r, 1), [0]) for r in range(ranks)}, took


def run_trial(trial: Trial, ref: dict[int, list], took: float, workdir: str, rng: Any,
              timeout: float) -> None:  # fmt: skip
    base = tempfile.mkdtemp(prefix=f"trial-{trial.scenario}-", dir=workdir)
    root, out, ckpt = os.path.join(base, "log"), os.path.join(base, "out"), base + "/ckpt.json"
    runs = 0
    try:
        for k in range(trial.kills):
            proc = subprocess.Popen(
                _command(trial.scenario, k, root, f"{out}-{k}", ckpt, workdir), env=_env(),
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            )  # fmt: skip
            runs += 1
            at = float(rng.uniform(0, took))
            try:
                proc.wait(timeout=at)
            except subprocess.TimeoutExpired:
                _kill_tree(proc)
                trial.killed_at.append(round(at, 2))
                continue
            if proc.returncode != 0:  # died on its own before the kill: a failed resume
                err = proc.stderr.read().decode() if proc.stderr else ""
                trial.outcome, trial.detail = "error", _last_line(err)
                return
            break  # finished before the kill time
        k = runs
        proc = subprocess.Popen(
            _command(trial.scenario, k, root, f"{out}-{k}", ckpt, workdir, final=True), env=_env(),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        runs += 1
        try:
            _, err_b = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            trial.outcome = "hung"
            return
        if proc.returncode != 0:
            trial.outcome, trial.detail = "error", _last_line(err_b.decode())
            return
        trial.outcome, trial.detail = _compare(trial.scenario, ref, out, runs, root)
    finally:
        if trial.outcome in ("exact",):
            shutil.rmtree(base, ignore_errors=True)
        else:
            trial.detail += f" (kept {base})"


def _last_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "no stderr"


def _compare(
    scenario: str, ref: dict[int, list], out: str, runs: int, root: str
) -> tuple[str, str]:
    if scenario not in ("elastic", "reshape-stream", "reshape-packed"):
        for rank, want in ref.items():
            got = _effective(_runs(out, rank, runs), _starts(out, runs))
            if [b["ids"] for b in got] != [b["ids"] for b in want]:
                first = next(
                    (
                        i
                        for i, (a, b) in enumerate(zip(got, want, strict=False))
                        if a["ids"] != b["ids"]
                    ),
                    min(len(got), len(want)),
                )
                return (
                    "not exact",
                    f"rank {rank} differs from batch {first} ({len(got)} vs {len(want)} batches)",
                )
        return "exact", ""
    # Elastic: the order changes with the shape; the set per epoch must not (a packed
    # stream's batches hold tokens, not one id per sample: the audit below checks it).
    if scenario != "reshape-packed":
        per_epoch: dict[int, Counter[int]] = defaultdict(Counter)
        for rank in (0, 1) if scenario == "elastic" else (0,):
            for b in _effective(_runs(out, rank, runs), _starts(out, runs)):
                per_epoch[b["epoch"]].update(b["ids"])
        dup = {e: [i for i, n in c.items() if n > 1] for e, c in per_epoch.items()}
        if any(dup.values()):
            return (
                "not exact",
                f"consumed twice in an epoch: {dict((e, d[:5]) for e, d in dup.items() if d)}",
            )
        finished = [e for e in per_epoch if e < max(per_epoch)]
        size = len(_Data()) if scenario == "elastic" else 50  # the shards' rows
        short = [e for e in finished if len(per_epoch[e]) < size]
        if short:
            return "not exact", f"finished epochs {short} miss samples"
    gate = subprocess.run(
        [sys.executable, "-m", "ledger.cli", "audit", root, "--check", "coverage", "--check",
         "duplicates"], env=_env(), capture_output=True, text=True,
    )  # fmt: skip
    if gate.returncode != 0:
        return "not exact", f"audit --check failed: {gate.stdout.strip()[-300:]}"
    return "exact", ""


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--child"]:
        child(args[1:])
        return
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=len(SCENARIOS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds for a final run")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--workdir", default=None, help="where logs go (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write every trial to this JSON file")
    a = p.parse_args(args)
    scenarios = [s for s in a.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    workdir = a.workdir or tempfile.mkdtemp(prefix="ledger-chaos-")
    os.makedirs(workdir, exist_ok=True)
    _shards(workdir)
    console = Console(stderr=True)
    rng = np.random.default_rng(a.seed)
    refs = {}
    for s in scenarios:
        refs[s] = reference(s, workdir, a.timeout)
        console.print(f"reference {s}: {refs[s][1]:.1f} s")
    trials: list[Trial] = []
    t0 = time.monotonic()
    for i in range(a.trials):
        s = scenarios[i % len(scenarios)]
        trial = Trial(s, int(rng.integers(1, 4)))
        run_trial(trial, *refs[s], workdir, rng, a.timeout)
        trials.append(trial)
        console.print(
            f"[{i + 1}/{a.trials}] {s}: {trial.kills} kills at {trial.killed_at} s -> "
            f"{trial.outcome} {trial.detail}".rstrip(),
            markup=False, highlight=False,
        )  # fmt: skip
    table = Table(title=f"chaos: {a.trials} trials, seed {a.seed}, {time.monotonic() - t0:.0f} s")
    table.add_column("scenario")
    for o in OUTCOMES:
        table.add_column(o)
    for s in scenarios:
        got = Counter(t.outcome for t in trials if t.scenario == s)
        table.add_row(s, *(str(got[o]) for o in OUTCOMES))
    total = Counter(t.outcome for t in trials)
    table.add_row("all", *(str(total[o]) for o in OUTCOMES))
    Console().print(table)
    kills = Counter(t.kills for t in trials)
    print(f"kills per trial: {dict(sorted(kills.items()))}; actual kills: "
          f"{sum(len(t.killed_at) for t in trials)}")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps([t.__dict__ for t in trials], indent=1))
    if not a.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    if total["exact"] != len(trials):
        sys.exit(1)


if __name__ == "__main__":
    main()
