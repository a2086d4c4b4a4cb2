"""Change the world size of a training run twice, and prove each epoch was seen once.

Runs ``examples/train_lm.py`` (map-style) under ``torchrun`` (gloo, CPU) in one run
directory, three times:

1. on 2 ranks, SIGKILLed (the whole torchrun job: agent, ranks and their DataLoader
   workers) at a random step after its first checkpoint;
2. ``--resume`` on 1 rank: every rank loads rank 0's token and the loader continues the
   interrupted epoch with the new shape; SIGKILLed again at a random step after this
   attempt's first checkpoint;
3. ``--resume`` on 2 ranks, to the end.

Then prints ``ledger audit`` of the log, and checks with SQL over
``ledger.audit.connect(root)`` that the lineage of the final checkpoint consumed every
completed epoch exactly once (``count(*) == count(DISTINCT sample_id) == dataset
length``) and the partial last epoch without a duplicate, with a table of the attempts
and world sizes that served each epoch. Exits 1 on any violation.

Example:
    python tools/demo_elastic.py
    python tools/demo_elastic.py --seed 3 --steps 200 --workdir runs/elastic
"""

from __future__ import annotations

import argparse
import contextlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

_TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(_TOOLS))  # tools/ is not a package
from demo import REPO, RESUMED_RE, STEP_RE, TRAIN, child_env, ledger_cli  # noqa: E402


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it), for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill_job(pid: int, timeout: float = 30.0) -> None:
    """SIGKILL a torchrun job: the agent ``pid`` and every process under it.

    torchrun starts each rank in a session of its own, so killing the agent's process
    group would leave the ranks training on (and committing) after the "kill". The
    agent's descendants are listed first, then all are killed, agent first, so it cannot
    react. A DataLoader worker forked after the listing dies with its rank
    (``PR_SET_PDEATHSIG``). Returns once every rank and worker is dead (gone or a zombie),
    or after ``timeout`` seconds; the agent is left for the caller to reap.
    """
    try:
        agent = psutil.Process(pid)
        procs = [agent, *agent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()

    def alive(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    # Not children of ours, so nothing to wait(2) for: poll until the kernel has them.
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in procs[1:]) and time.monotonic() < deadline:
        time.sleep(0.01)


def torchrun_cmd(
    nproc: int, root: Path, train_args: list[str], resume: bool = False, script: Path = TRAIN
) -> list[str]:
    """``torchrun --nproc_per_node NPROC script --root ROOT ...`` on a free local port."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(script), "--root", str(root), *train_args,
        "--stream-out", str(root / "stream.jsonl"),
    ]  # fmt: skip
    return [*cmd, "--resume"] if resume else cmd


def run_torchrun(
    root: Path,
    nproc: int,
    train_args: list[str],
    *,
    resume: bool = False,
    kill_at: int | None = None,
    on_step: Callable[[int], None] | None = None,
    script: Path = TRAIN,
    timeout: float = 600,
) -> tuple[int, list[str]]:
    """Run ``script`` on ``nproc`` ranks with torchrun, reading rank 0's stdout.

    A kill reaches every process of the job (``kill_job``): the torchrun agent, the
    ranks and their DataLoader workers.

    Args:
        root: the run directory (created).
        nproc: ranks.
        train_args: the script's arguments, ``--root`` and ``--stream-out`` excepted.
        resume: pass ``--resume``.
        kill_at: SIGKILL the whole job as soon as rank 0 reports this step.
        on_step: called with each step number rank 0 reports.
        script: the training script.
        timeout: seconds before the job is killed and ``TimeoutError`` raised.

    Returns:
        The exit status (``-9`` when killed) and the stdout lines read. The job's
        stderr goes to ``root/stderr-<n>.log`` and is echoed on failure.
    """
    root.mkdir(parents=True, exist_ok=True)
    err_path = root / f"stderr-{len(list(root.glob('stderr-*.log')))}.log"
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            torchrun_cmd(nproc, root, train_args, resume, script),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"torchrun in {root} ran past {timeout} s")
                m = STEP_RE.match(line)
                if m is None:
                    continue
                step = int(m.group(1))
                if on_step is not None:
                    on_step(step)
                if kill_at is not None and step >= kill_at:
                    kill_job(proc.pid)
                    break
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:  # an exception above: leave no rank behind
                kill_job(proc.pid)
                proc.wait()
            proc.stdout.close()
    if rc not in (0, -signal.SIGKILL):
        sys.stderr.write(err_path.read_text()[-4000:])
    return rc, lines


def resumed_from(lines: list[str]) -> int | None:
    """The checkpoint step a ``--resume`` run reported, or None."""
    return next((int(m.group(1)) for ln in lines if (m := RESUMED_RE.match(ln))), None)


@dataclass(frozen=True, slots=True)
class EpochCheck:
    """One epoch of a lineage: what it consumed, who served it, and the verdict."""

    epoch: int
    samples: int
    distinct: int
    skipped: int
    dataset_len: int
    served_by: tuple[tuple[int, int, int], ...]
    """``(attempt, world size, samples)`` in attempt order."""
    complete: bool
    violation: str | None


def check_exactly_once(log_root: Path) -> list[EpochCheck]:
    """Check, with SQL over the audit views, that the lineage saw each epoch once.

    Every epoch but the last must hold each sample of the dataset exactly once:
    ``count(*) == count(DISTINCT sample_id) == dataset length`` over ``kind = 'sample'``
    events (less the positions ``drop_last`` skipped, none with train_lm.py), ids in
    range. The last epoch may be partial but holds no duplicate. Epochs are numbered
    from 0 without a gap.

    Returns:
        One check per epoch of the default head's lineage; ``violation`` says what is
        wrong, ``None`` when the epoch is right.
    """
    from ledger.audit import connect

    con = connect(str(log_root))
    (n,) = con.execute("SELECT dataset_len FROM run").fetchone()
    per_epoch = con.execute(
        """
        SELECT epoch,
               count(*) FILTER (kind = 'sample'),
               count(DISTINCT sample_id) FILTER (kind = 'sample'),
               count(*) FILTER (kind = 'skip'),
               min(sample_id), max(sample_id)
        FROM lineage WHERE kind IN ('sample', 'skip') GROUP BY epoch ORDER BY epoch
        """
    ).fetchall()
    served: dict[int, list[tuple[int, int, int]]] = {}
    for epoch, attempt, world_size, count in con.execute(
        """
        SELECT l.epoch, l.attempt, a.world_size, count(*)
        FROM lineage AS l JOIN attempts AS a ON l.attempt = a.attempt
        WHERE l.kind = 'sample' GROUP BY ALL ORDER BY 1, 2
        """
    ).fetchall():
        served.setdefault(epoch, []).append((attempt, world_size, count))
    checks = []
    last = per_epoch[-1][0] if per_epoch else -1
    for i, (epoch, count, distinct, skipped, lo, hi) in enumerate(per_epoch):
        violation = None
        if epoch != i:
            violation = f"epoch {i} is missing from the lineage"
        elif count != distinct:
            violation = f"{count - distinct} duplicate sample(s)"
        elif lo < 0 or hi >= n:
            violation = f"sample ids outside [0, {n})"
        elif epoch != last and count + skipped != n:
            violation = f"a completed epoch holds {count} of {n - skipped} samples"
        elif count + skipped > n:
            violation = f"{count} samples, more than the dataset's {n - skipped}"
        checks.append(
            EpochCheck(
                epoch,
                count,
                distinct,
                skipped,
                n,
                tuple(served.get(epoch, ())),
                count + skipped == n,
                violation,
            )
        )
    return checks


def epoch_table(checks: list[EpochCheck]):  # type: ignore[no-untyped-def]
    """A rich table of :func:`check_exactly_once`'s verdicts."""
    from rich.table import Table

    n = checks[0].dataset_len if checks else 0
    table = Table(title=f"Lineage by epoch, dataset of {n} samples (SQL, ledger.audit.connect)")
    for col in ("epoch", "samples", "distinct", "ranks"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("attempt: samples", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    for c in checks:
        sizes = "->".join(str(w) for _, w, _ in c.served_by)
        served = ", ".join(f"{a}: {k}" for a, _, k in c.served_by)
        if c.violation:
            verdict = f"[red]VIOLATION: {c.violation}[/]"
        elif c.complete:
            verdict = "[green]exactly once[/]"
        else:
            verdict = "[green]partial, once[/]"
        table.add_row(*map(str, (c.epoch, c.samples, c.distinct, sizes, served)), verdict)
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="default: a new temp dir")
    ap.add_argument("--seed", type=int, default=0, help="picks the steps to kill at")
    ap.add_argument("--train-seed", type=int, default=0, help="train_lm.py's --seed")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=16, help="per rank")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--num-workers", type=int, default=1, help="per rank")
    ap.add_argument("--max-files", type=int, default=None)
    ap.add_argument(
        "--max-samples",
        type=int,
        default=400,
        help="windows per epoch (default 400: 13 steps an epoch on 2 ranks, 25 on 1)",
    )
    return ap.parse_args(argv)


def latest_step(root: Path) -> int:
    """Step of the newest checkpoint under ``root/ckpt`` (0 without one)."""
    steps = [int(p.name[5:13]) for p in (root / "ckpt").glob("step-*.pt")]
    return max(steps, default=0)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    from rich.table import Table

    args = parse_args(argv)
    console = Console(highlight=False)
    steps, every = args.steps, args.ckpt_every
    if steps < 4 * every:
        console.print("[red]error:[/] --steps must be at least 4 x --ckpt-every")
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ledger-elastic-"))
    root = workdir / "run"
    if root.exists() and any(root.iterdir()):
        console.print(f"[red]error:[/] {root} is not empty; pick another --workdir")
        return 2
    train_args = [
        "--steps", str(steps),
        "--batch-size", str(args.batch_size),
        "--seq-len", str(args.seq_len),
        "--ckpt-every", str(every),
        "--num-workers", str(args.num_workers),
        "--seed", str(args.train_seed),
        "--max-samples", str(args.max_samples),
    ]  # fmt: skip
    if args.max_files is not None:
        train_args += ["--max-files", str(args.max_files)]
    rng = random.Random(args.seed)
    console.print(f"[bold]ledger elastic demo[/] in {workdir}")
    console.print(f"  train_lm.py {' '.join(train_args)}")
    console.print(f"  kill steps drawn with --seed {args.seed}\n")

    t0 = time.monotonic()
    phases = Table("phase", "ranks", "resumed from", "last step", "exit status", box=None)
    failures: list[str] = []
    with Progress(
        "{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console,
    ) as progress:  # fmt: skip
        # Each kill falls after the attempt's first checkpoint, so that every attempt
        # leaves one to resume from, and early enough to leave work for the next.
        plan = [
            ("1. 2 ranks, SIGKILL", 2, lambda start: rng.randint(every, steps // 3)),
            (
                "2. 1 rank, SIGKILL",
                1,
                lambda start: rng.randint(start + every, max(start + every, 2 * steps // 3)),
            ),
            ("3. 2 ranks, to the end", 2, lambda start: None),
        ]
        for i, (label, nproc, kill_step) in enumerate(plan):
            start = latest_step(root)
            kill_at = kill_step(start)
            task = progress.add_task(label, total=steps, completed=start)
            rc, lines = run_torchrun(
                root,
                nproc,
                train_args,
                resume=i > 0,
                kill_at=kill_at,
                on_step=lambda s, task=task: progress.update(task, completed=s + 1),
            )
            progress.stop_task(task)
            last = max((int(m.group(1)) for ln in lines if (m := STEP_RE.match(ln))), default=-1)
            frm = resumed_from(lines)
            phases.add_row(label, str(nproc), "-" if frm is None else f"step {frm}", str(last),
                           str(rc))  # fmt: skip
            expected = 0 if kill_at is None else -signal.SIGKILL
            if rc != expected:
                failures.append(f"phase {label!r} exited with {rc}, expected {expected}")
                break
    console.print(phases)
    if failures:
        for f in failures:
            console.print(f"[red]FAIL[/] {f}")
        return 1

    log = root / "log"
    console.rule(f"ledger audit {log}", style="dim")
    rc_audit, out = ledger_cli("audit", str(log))
    console.print(out, markup=False)
    if rc_audit != 0:
        failures.append(f"ledger audit exited with {rc_audit}")
    checks = check_exactly_once(log)
    console.print(epoch_table(checks))
    failures += [f"epoch {c.epoch}: {c.violation}" for c in checks if c.violation]
    if not checks:
        failures.append("the lineage holds no sample")
    world_sizes = {w for c in checks for _, w, _ in c.served_by}
    if world_sizes != {1, 2}:
        failures.append(f"the lineage was served by world sizes {sorted(world_sizes)}, not 1 and 2")

    console.rule()
    for f in failures:
        console.print(f"[red]FAIL[/] {f}")
    if not failures:
        done = sum(c.complete for c in checks)
        console.print(
            f"[green]OK: 2 -> 1 -> 2 ranks, {done} complete epochs each consumed exactly "
            f"once, the partial one without a duplicate[/] ({time.monotonic() - t0:.0f} s)"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
