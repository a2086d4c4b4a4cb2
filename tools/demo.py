"""Kill a training run with SIGKILL, resume it, and show nothing changed.

For each pipeline -- map-style (``examples/train_lm.py``), streamed and packed
(``examples/train_lm_packed.py`` over Parquet shards of ``tools/make_shards.py``), then
a weighted mixture of two corpora with an annealing phase
(``examples/train_lm_mixture.py``) -- runs the training script three times:

1. uninterrupted, in ``WORKDIR/<pipeline>/clean``;
2. in ``WORKDIR/<pipeline>/crash``, sending SIGKILL at a random step after the first
   checkpoint;
3. ``--resume`` in ``WORKDIR/<pipeline>/crash`` until the end.

Then compares the batches the training loop received in both runs, element by element
(the crashed run's effective stream keeps, for every step, the batch seen last, since
the resumed attempt redoes the steps after its checkpoint), compares the final weights
bit for bit, and prints ``ledger audit`` of the crashed run's log (for the mixture with
``--check mixture``: realised against target shares). Exits 1 if anything differs.

Example:
    python tools/demo.py
    python tools/demo.py --only packed --seed 7 --packed-steps 120 --workdir runs/demo
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_lm.py"
TRAIN_PACKED = REPO / "examples" / "train_lm_packed.py"
TRAIN_MIXTURE = REPO / "examples" / "train_lm_mixture.py"

if TYPE_CHECKING:
    from rich.console import Console

STEP_RE = re.compile(r"^step (\d+) loss ")
RESUMED_RE = re.compile(r"^resumed from \S+ at step (\d+)")


def child_env() -> dict[str, str]:
    """The environment for train_lm.py: this checkout's ``ledger`` first on the path."""
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def train_cmd(
    root: Path, train_args: list[str], resume: bool = False, script: Path = TRAIN
) -> list[str]:
    """The command line of one run of ``script`` (a train_lm*.py) rooted at ``root``."""
    cmd = [sys.executable, str(script), "--root", str(root), *train_args]
    cmd += ["--stream-out", str(root / "stream.jsonl")]
    return [*cmd, "--resume"] if resume else cmd


def run_train(
    root: Path,
    train_args: list[str],
    *,
    resume: bool = False,
    kill_at: int | None = None,
    on_step: Callable[[int], None] | None = None,
    script: Path = TRAIN,
) -> tuple[int, list[str]]:
    """Run train_lm.py (or ``script``), reading its stdout line by line.

    Args:
        root: the run directory (created).
        train_args: extra arguments of the script.
        resume: pass ``--resume``.
        kill_at: send SIGKILL as soon as the line for this step (0-based) is read.
        on_step: called with each step number read.
        script: the training script, ``TRAIN`` or ``TRAIN_PACKED``.

    Returns:
        The exit status (``-9`` when killed) and the stdout lines read.
        The child's stderr goes to ``root/stderr-<n>.log``.
    """
    root.mkdir(parents=True, exist_ok=True)
    err_path = root / f"stderr-{len(list(root.glob('stderr-*.log')))}.log"
    lines: list[str] = []
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            train_cmd(root, train_args, resume, script),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=child_env(),
            cwd=REPO,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            m = STEP_RE.match(line)
            if m is None:
                continue
            step = int(m.group(1))
            if on_step is not None:
                on_step(step)
            if kill_at is not None and step >= kill_at:
                os.kill(proc.pid, signal.SIGKILL)
                break
        # DataLoader workers may still hold the pipe open for a moment after a SIGKILL
        # of their parent: wait for the process, not for end of file.
        rc = proc.wait()
        proc.stdout.close()
    if rc not in (0, -signal.SIGKILL):
        sys.stderr.write(err_path.read_text()[-4000:])
    return rc, lines


def effective_stream(path: Path) -> list[dict[str, object]]:
    """The per-step records of a stream file, keeping for each step the one written last.

    A resumed attempt rewrites the steps after its checkpoint, so the last record of a
    step is what the model that reached the end actually trained on. A line cut short by
    SIGKILL is skipped.

    Raises:
        ValueError: the steps are not exactly ``0, 1, ..., n-1``.
    """
    by_step: dict[int, dict[str, object]] = {}
    for raw in path.read_text().splitlines():
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            continue
        by_step[int(rec["step"])] = rec
    steps = sorted(by_step)
    if steps != list(range(len(steps))):
        raise ValueError(f"{path}: steps are not contiguous from 0 (have {len(steps)} steps)")
    return [by_step[s] for s in steps]


def count_differences(a: list[dict[str, object]], b: list[dict[str, object]]) -> int:
    """Positions where two streams differ; a missing position counts as different."""
    return sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))


def weights_diff(path_a: Path, path_b: Path) -> list[str]:
    """Names of the tensors of two state_dict files that are not bitwise equal."""
    import torch

    a = torch.load(path_a, weights_only=True)
    b = torch.load(path_b, weights_only=True)
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or not torch.equal(a[n], b[n])]


def ledger_cli(*args: str) -> tuple[int, str]:
    """``ledger ARGS...``: its exit status and output."""
    proc = subprocess.run(
        [sys.executable, "-m", "ledger.cli", *args],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO,
    )
    return proc.returncode, (proc.stdout + proc.stderr).rstrip()


# Checks a resumed run must pass ('abandoned' fails by design after a crash: it reports
# the batches the killed process consumed and never committed).
CHECKS = ("coverage", "duplicates", "skips", "progress", "skew")
PIPELINES = ("map", "packed", "mixture")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="default: a new temp dir")
    ap.add_argument(
        "--only",
        choices=PIPELINES,
        default=None,
        help="run one pipeline (default: all three)",
    )
    ap.add_argument("--seed", type=int, default=0, help="picks the steps to kill at")
    ap.add_argument("--train-seed", type=int, default=0, help="training scripts' --seed")
    ap.add_argument("--num-workers", type=int, default=2)
    m = ap.add_argument_group("map-style pipeline (train_lm.py)")
    m.add_argument("--steps", type=int, default=300)
    m.add_argument("--batch-size", type=int, default=16)
    m.add_argument("--seq-len", type=int, default=128)
    m.add_argument("--ckpt-every", type=int, default=50)
    m.add_argument("--max-files", type=int, default=None)
    m.add_argument(
        "--max-samples",
        type=int,
        default=1600,
        help="windows per epoch, spread over the corpus (default: 100 batches, so the run "
        "crosses epochs)",
    )
    p = ap.add_argument_group("packed pipeline (train_lm_packed.py)")
    p.add_argument("--packed-steps", type=int, default=200)
    p.add_argument("--packed-batch-size", type=int, default=16)
    p.add_argument("--packed-seq-len", type=int, default=128)
    p.add_argument("--packed-ckpt-every", type=int, default=40)
    p.add_argument("--shuffle-buffer", type=int, default=8, help="documents")
    p.add_argument(
        "--packed-max-files",
        type=int,
        default=12,
        help="stdlib files in the shards (default 12, ~99 kB: ~48 batches an epoch, so the "
        "run crosses epochs)",
    )
    p.add_argument("--shards", type=int, default=4, help="Parquet shards")
    x = ap.add_argument_group("mixture pipeline (train_lm_mixture.py)")
    x.add_argument("--mixture-steps", type=int, default=150)
    x.add_argument("--mixture-ckpt-every", type=int, default=30)
    x.add_argument("--mixture-max-samples", type=int, default=2000, help="windows per corpus")
    p.add_argument(
        "--row-group-rows",
        type=int,
        default=2,
        help="rows per row group (default 2, so that reads cross row groups)",
    )
    return ap.parse_args(argv)


def run_pipeline(
    console: Console,
    name: str,
    script: Path,
    workdir: Path,
    train_args: list[str],
    steps: int,
    kill_at: int,
    materialize: list[str] | None = None,
    checks: tuple[str, ...] = CHECKS,
) -> list[str]:
    """Uninterrupted run, SIGKILL at ``kill_at``, ``--resume``; compare, print, audit.

    Args:
        console: where the progress, the table and the audit go.
        name: the pipeline's name in headings.
        script: the training script.
        workdir: gets ``clean/`` and ``crash/`` (must be empty or absent).
        train_args: the script's arguments, ``--root`` and ``--stream-out`` excepted.
        steps: the ``--steps`` in ``train_args``.
        kill_at: the step (0-based) at which the second run is killed.
        materialize: ``ledger show --materialize`` options naming the dataset, to
            re-create the last committed batch and compare its digest; ``None``: skip.
        checks: the ``ledger audit --check`` names to run.

    Returns:
        What failed, one sentence each; empty if the resumed run matched.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    from rich.table import Table

    clean, crash = workdir / "clean", workdir / "crash"
    console.rule(f"[bold]{name}[/]")
    console.print(f"  {script.name} {' '.join(train_args)}")
    console.print(f"  kill step: {kill_at}\n")

    t0 = time.monotonic()
    with Progress(
        "{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console,
    ) as progress:  # fmt: skip

        def phase(label: str, start: int = 0) -> Callable[[int], None]:
            task = progress.add_task(label, total=steps, completed=start)
            return lambda step: progress.update(task, completed=step + 1)

        run = functools.partial(run_train, script=script)
        rc_a, _ = run(clean, train_args, on_step=phase("1. uninterrupted"))
        rc_b, _ = run(crash, train_args, kill_at=kill_at, on_step=phase("2. SIGKILL"))
        killed_after = len(effective_stream(crash / "stream.jsonl"))
        rc_c, lines_c = run(crash, train_args, resume=True, on_step=phase("3. --resume"))

    failures: list[str] = []
    if rc_a != 0:
        failures.append(f"{name}: uninterrupted run exited with {rc_a}")
    if rc_b != -signal.SIGKILL:
        failures.append(f"{name}: run 2 was not killed (exit status {rc_b})")
    if rc_c != 0:
        failures.append(f"{name}: resumed run exited with {rc_c}")
    if failures:
        return failures

    resumed_from = next(int(m.group(1)) for ln in lines_c if (m := RESUMED_RE.match(ln)))
    ref = effective_stream(clean / "stream.jsonl")
    eff = effective_stream(crash / "stream.jsonl")
    n_diff = count_differences(ref, eff)
    bad_weights = weights_diff(clean / "final.pt", crash / "final.pt")
    elapsed = time.monotonic() - t0

    table = Table(show_header=False, box=None)
    table.add_row("killed after step", f"{killed_after - 1} (SIGKILL, exit status {rc_b})")
    table.add_row("resumed from checkpoint", f"step {resumed_from}")
    table.add_row("steps redone", str(killed_after - resumed_from))
    table.add_row("epochs", str(len({r["epoch"] for r in ref})))
    table.add_row("batches compared", f"{len(ref)} vs {len(eff)}")
    ok = "[green]{}[/]".format
    bad = "[red]{}[/]".format
    table.add_row("positions that differ", (ok if n_diff == 0 else bad)(n_diff))
    table.add_row(
        "final weights bitwise equal",
        ok("yes") if not bad_weights else bad(f"no: {', '.join(bad_weights)}"),
    )
    table.add_row("wall time", f"{elapsed:.1f} s")
    console.print(table)

    log = str(crash / "log")
    commands = [
        ["audit", log],
        ["audit", log, *(arg for c in checks for arg in ("--check", c))],
    ]
    if materialize is not None:  # the last committed batch, re-created from the dataset
        rc, last = ledger_cli(
            "audit", log, "--format", "csv", "--sql", "SELECT max(batch) FROM lineage"
        )
        batch = last.splitlines()[-1] if rc == 0 else "0"
        commands.append(["show", log, "--batch", batch, "--materialize", *materialize])
    for command in commands:
        console.rule(f"ledger {' '.join(command)}", style="dim")
        rc, out = ledger_cli(*command)
        console.print(out, markup=False, soft_wrap=True)
        if rc != 0:
            failures.append(f"{name}: ledger {command[0]} exited with {rc}")
    if n_diff:
        failures.append(f"{name}: {n_diff} positions of the batch stream differ")
    if bad_weights:
        failures.append(f"{name}: {len(bad_weights)} weight tensors differ")
    return failures


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    console = Console(highlight=False)
    pipelines = PIPELINES if args.only is None else (args.only,)

    def kill_step(steps: int, ckpt_every: int) -> int | None:
        margin = max(5, steps // 10)  # leave the run time to die before it ends
        if steps <= ckpt_every + margin:
            return None
        return random.Random(args.seed).randint(ckpt_every, steps - 1 - margin)

    common = ["--num-workers", str(args.num_workers), "--seed", str(args.train_seed)]
    map_args = [
        "--steps", str(args.steps),
        "--batch-size", str(args.batch_size),
        "--seq-len", str(args.seq_len),
        "--ckpt-every", str(args.ckpt_every),
        *common,
    ]  # fmt: skip
    if args.max_files is not None:
        map_args += ["--max-files", str(args.max_files)]
    if args.max_samples:
        map_args += ["--max-samples", str(args.max_samples)]
    dataset_kwargs = {
        "seq_len": args.seq_len, "max_files": args.max_files,
        "max_samples": args.max_samples or None,
    }  # fmt: skip
    materialize_args = [
        "--dataset", f"{TRAIN}:StdlibWindows", "--dataset-kwargs", json.dumps(dataset_kwargs)
    ]  # fmt: skip
    packed_args = [
        "--steps", str(args.packed_steps),
        "--batch-size", str(args.packed_batch_size),
        "--seq-len", str(args.packed_seq_len),
        "--ckpt-every", str(args.packed_ckpt_every),
        "--shuffle-buffer", str(args.shuffle_buffer),
        *common,
    ]  # fmt: skip
    mixture_args = [
        "--steps", str(args.mixture_steps),
        "--batch-size", str(args.batch_size),
        "--seq-len", str(args.seq_len),
        "--ckpt-every", str(args.mixture_ckpt_every),
        "--max-samples", str(args.mixture_max_samples),
        *common,
    ]  # fmt: skip
    plans = {
        "map": (TRAIN, map_args, args.steps, kill_step(args.steps, args.ckpt_every)),
        "mixture": (
            TRAIN_MIXTURE,
            mixture_args,
            args.mixture_steps,
            kill_step(args.mixture_steps, args.mixture_ckpt_every),
        ),
        "packed": (
            TRAIN_PACKED,
            packed_args,
            args.packed_steps,
            kill_step(args.packed_steps, args.packed_ckpt_every),
        ),
    }
    for name in pipelines:
        if plans[name][3] is None:
            console.print(f"[red]error:[/] {name}: steps must exceed ckpt-every by at least 10%")
            return 2

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ledger-demo-"))
    for name in pipelines:
        for d in (workdir / name / "clean", workdir / name / "crash"):
            if d.exists() and any(d.iterdir()):
                console.print(f"[red]error:[/] {d} is not empty; pick another --workdir")
                return 2
    console.print(f"[bold]ledger demo[/] in {workdir}")
    console.print(f"  kill steps drawn with --seed {args.seed}")

    t0 = time.monotonic()
    failures: list[str] = []
    for name in pipelines:
        script, train_args, steps, kill_at = plans[name]
        assert kill_at is not None
        if name == "packed":
            # Imported here: it imports torch, which the map-style demo never needs here.
            sys.path.insert(0, str(REPO / "tools"))
            from make_shards import make_shards  # tools/ is not a package

            shards_dir = workdir / "packed" / "shards"
            t = time.monotonic()
            paths = make_shards(shards_dir, args.shards, args.packed_max_files, args.row_group_rows)
            console.print(
                f"\n{len(paths)} shards of the first {args.packed_max_files} stdlib files in "
                f"{shards_dir} ({time.monotonic() - t:.1f} s)"
            )
            train_args = [*train_args, "--shards-dir", str(shards_dir)]
        title = f"{name} pipeline: {script.name}"
        failures += run_pipeline(
            console, title, script, workdir / name, train_args, steps, kill_at,
            materialize_args if name == "map" else None,
            (*CHECKS, "mixture") if name == "mixture" else CHECKS,
        )  # fmt: skip

    console.rule()
    for f in failures:
        console.print(f"[red]FAIL[/] {f}")
    if not failures:
        console.print(
            "[green]OK: every resumed run saw exactly the same batches and ended bitwise "
            f"equal[/] ({', '.join(pipelines)}; {time.monotonic() - t0:.0f} s)"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
