"""Kill a training run with SIGKILL, resume it, and show nothing changed.

Runs ``examples/train_lm.py`` three times:

1. uninterrupted, in ``WORKDIR/clean``;
2. in ``WORKDIR/crash``, sending SIGKILL at a random step after the first checkpoint;
3. ``--resume`` in ``WORKDIR/crash`` until the end.

Then compares the batches the training loop received in both runs, element by element
(the crashed run's effective stream keeps, for every step, the batch seen last, since
the resumed attempt redoes the steps after its checkpoint), compares the final weights
bit for bit, and prints ``ledger audit`` of the crashed run's log. Exits 1 if anything
differs.

Example:
    python tools/demo.py
    python tools/demo.py --seed 7 --steps 200 --workdir runs/demo
"""

from __future__ import annotations

import argparse
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

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_lm.py"
STEP_RE = re.compile(r"^step (\d+) loss ")
RESUMED_RE = re.compile(r"^resumed from \S+ at step (\d+)")


def child_env() -> dict[str, str]:
    """The environment for train_lm.py: this checkout's ``ledger`` first on the path."""
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def train_cmd(root: Path, train_args: list[str], resume: bool = False) -> list[str]:
    """The command line of one train_lm.py run rooted at ``root``."""
    cmd = [sys.executable, str(TRAIN), "--root", str(root), *train_args]
    cmd += ["--stream-out", str(root / "stream.jsonl")]
    return [*cmd, "--resume"] if resume else cmd


def run_train(
    root: Path,
    train_args: list[str],
    *,
    resume: bool = False,
    kill_at: int | None = None,
    on_step: Callable[[int], None] | None = None,
) -> tuple[int, list[str]]:
    """Run train_lm.py, reading its stdout line by line.

    Args:
        root: the run directory (created).
        train_args: extra train_lm.py arguments.
        resume: pass ``--resume``.
        kill_at: send SIGKILL as soon as the line for this step (0-based) is read.
        on_step: called with each step number read.

    Returns:
        The exit status (``-9`` when killed) and the stdout lines read.
        The child's stderr goes to ``root/stderr-<n>.log``.
    """
    root.mkdir(parents=True, exist_ok=True)
    err_path = root / f"stderr-{len(list(root.glob('stderr-*.log')))}.log"
    lines: list[str] = []
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            train_cmd(root, train_args, resume),
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


def audit(log_root: Path) -> tuple[int, str]:
    """``ledger audit LOG_ROOT``: its exit status and output."""
    proc = subprocess.run(
        [sys.executable, "-m", "ledger.cli", "audit", str(log_root)],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO,
    )
    return proc.returncode, (proc.stdout + proc.stderr).rstrip()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="default: a new temp dir")
    ap.add_argument("--seed", type=int, default=0, help="picks the step to kill at")
    ap.add_argument("--train-seed", type=int, default=0, help="train_lm.py --seed")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--max-files", type=int, default=None)
    ap.add_argument(
        "--max-samples",
        type=int,
        default=1600,
        help="windows per epoch, spread over the corpus (default: 100 batches, so the run "
        "crosses epochs)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    from rich.table import Table

    args = parse_args(argv)
    console = Console(highlight=False)
    margin = max(5, args.steps // 10)  # leave the run time to die before it ends
    if args.steps <= args.ckpt_every + margin:
        console.print("[red]error:[/] --steps must exceed --ckpt-every by at least 10%")
        return 2
    kill_at = random.Random(args.seed).randint(args.ckpt_every, args.steps - 1 - margin)

    train_args = [
        "--steps", str(args.steps),
        "--batch-size", str(args.batch_size),
        "--seq-len", str(args.seq_len),
        "--num-workers", str(args.num_workers),
        "--ckpt-every", str(args.ckpt_every),
        "--seed", str(args.train_seed),
    ]  # fmt: skip
    if args.max_files is not None:
        train_args += ["--max-files", str(args.max_files)]
    if args.max_samples:
        train_args += ["--max-samples", str(args.max_samples)]

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ledger-demo-"))
    clean, crash = workdir / "clean", workdir / "crash"
    for d in (clean, crash):
        if d.exists() and any(d.iterdir()):
            console.print(f"[red]error:[/] {d} is not empty; pick another --workdir")
            return 2
    console.print(f"[bold]ledger demo[/] in {workdir}")
    console.print(f"  train_lm.py {' '.join(train_args)}")
    console.print(f"  kill step: {kill_at} (drawn with --seed {args.seed})\n")

    t0 = time.monotonic()
    with Progress(
        "{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console,
    ) as progress:  # fmt: skip

        def phase(label: str, start: int = 0) -> Callable[[int], None]:
            task = progress.add_task(label, total=args.steps, completed=start)
            return lambda step: progress.update(task, completed=step + 1)

        rc_a, _ = run_train(clean, train_args, on_step=phase("1. uninterrupted"))
        rc_b, _ = run_train(crash, train_args, kill_at=kill_at, on_step=phase("2. SIGKILL"))
        killed_after = len(effective_stream(crash / "stream.jsonl"))
        rc_c, lines_c = run_train(crash, train_args, resume=True, on_step=phase("3. --resume"))

    failures: list[str] = []
    if rc_a != 0:
        failures.append(f"uninterrupted run exited with {rc_a}")
    if rc_b != -signal.SIGKILL:
        failures.append(f"run 2 was not killed (exit status {rc_b})")
    if rc_c != 0:
        failures.append(f"resumed run exited with {rc_c}")
    if failures:
        for f in failures:
            console.print(f"[red]FAIL[/] {f}")
        return 1

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

    console.rule(f"ledger audit {crash / 'log'}")
    rc_audit, out = audit(crash / "log")
    console.print(out, markup=False)
    if rc_audit != 0:
        failures.append(f"ledger audit exited with {rc_audit}")
    if n_diff:
        failures.append(f"{n_diff} positions of the batch stream differ")
    if bad_weights:
        failures.append(f"{len(bad_weights)} weight tensors differ")
    console.rule()
    for f in failures:
        console.print(f"[red]FAIL[/] {f}")
    if not failures:
        console.print(
            ok("OK: the resumed run saw exactly the same batches and ended bitwise equal")
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
