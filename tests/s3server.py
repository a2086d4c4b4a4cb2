"""A real S3 server for the tests: ``rclone serve s3`` on 127.0.0.1, or an external one.

With ``LEDGER_S3_ENDPOINT`` set (and ``LEDGER_S3_KEY``, ``LEDGER_S3_SECRET``, optionally
``LEDGER_S3_BUCKET``), the tests use that server instead, e.g. the Ceph RGW started by
``tools/ceph-rgw.sh``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

KEY, SECRET = "ledger-test-key", "ledger-test-secret"

# botocore >= 1.36 sends CRC checksums in trailers and validates response checksums;
# rclone's and older servers' S3 front ends reject or lack them.
CHECKSUM_ENV = {
    "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
    "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
}


@dataclass
class S3Server:
    """An S3 endpoint with credentials and a bucket the tests may write to.

    Attributes:
        endpoint: ``http://host:port``.
        key, secret: the access key pair.
        bucket: an existing bucket.
        proc: the server process when the tests started it.
    """

    endpoint: str
    key: str
    secret: str
    bucket: str
    proc: subprocess.Popen[bytes] | None = None
    log: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS environment that points botocore at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            **CHECKSUM_ENV,
            **self.extra_env,
        }

    def storage_options(self, endpoint: str | None = None, **config: Any) -> dict[str, Any]:
        """fsspec options for this server (or a proxy in front of it at ``endpoint``)."""
        return {
            "key": self.key,
            "secret": self.secret,
            "endpoint_url": endpoint or self.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
            "config_kwargs": {
                "request_checksum_calculation": "when_required",
                "response_checksum_validation": "when_required",
                **config,
            },
        }

    def new_root(self, name: str) -> str:
        """A fresh ``s3://bucket/prefix`` URI."""
        return f"s3://{self.bucket}/{name}-{uuid.uuid4().hex[:8]}"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def rclone_binary() -> str | None:
    return shutil.which("rclone")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_until_up(endpoint: str, proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # 403 for an unsigned request: the server answers
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the S3 server exited with {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def start_rclone(data_dir: str, log_path: str) -> S3Server:
    """Start ``rclone serve s3`` over ``data_dir`` and wait until it answers."""
    binary = rclone_binary()
    assert binary is not None
    port = _free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                "serve",
                "s3",
                "--addr",
                f"127.0.0.1:{port}",
                # rclone's VFS directory cache (5 min by default) can answer 404 for an
                # object just PUT when a concurrent DELETE emptied its folder (seen by
                # test_racing_writers_of_one_marker_one_wins: a few in 300 races of 6
                # writers; the claim protocol then fails safe with StorageError).
                "--dir-cache-time",
                "1ms",
                "--auth-key",
                f"{KEY},{SECRET}",
                data_dir,
            ],
            env={**os.environ, "RCLONE_CONFIG": "/dev/null"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = S3Server(f"http://127.0.0.1:{port}", KEY, SECRET, "ledger-tests", proc, log_path)
    try:
        _wait_until_up(server.endpoint, proc, timeout=30)
    except BaseException:
        server.stop()
        raise
    return server


def external() -> S3Server | None:
    """The server named by ``LEDGER_S3_ENDPOINT`` and friends, if set."""
    endpoint = os.environ.get("LEDGER_S3_ENDPOINT")
    if not endpoint:
        return None
    server = S3Server(
        endpoint,
        os.environ["LEDGER_S3_KEY"],
        os.environ["LEDGER_S3_SECRET"],
        os.environ.get("LEDGER_S3_BUCKET", "ledger-tests"),
    )
    _wait_until_up(endpoint, None, timeout=10)
    return server


def make_bucket(server: S3Server) -> None:
    """Create the server's bucket through the S3 API (fine if it exists)."""
    import s3fs

    fs = s3fs.S3FileSystem(**server.storage_options(), skip_instance_cache=True)
    # No LocationConstraint (s3fs.mkdir would send the region; RGW refuses "us-east-1").
    with contextlib.suppress(FileExistsError):
        fs.call_s3("create_bucket", Bucket=server.bucket)
