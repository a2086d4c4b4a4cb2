"""A fault-injecting HTTP/1.1 proxy between an S3 client and a real S3 server (tests only).

It forwards requests one by one over a keep-alive connection per client connection and,
per request, may inject a fault instead:

=============  ==========================================================================
``http500``    answer ``500 InternalError`` without forwarding (botocore retries fast)
``http503``    answer ``503 ServiceUnavailable`` without forwarding
``slowdown``   answer ``503 SlowDown`` without forwarding (throttling: longer backoff)
``drop``       close the client connection without forwarding the request
``drop_after`` forward the request, let the server act on it, then close the client
               connection without the response: the client cannot tell whether it
               happened (the "state unknown" case a commit must survive)
``delay``      wait :attr:`FaultProxy.delay` seconds, then forward (a slow network; with
               a delay above the client's read timeout the client gives up and retries
               while the first request still reaches the server)
=============  ==========================================================================

Faults come from rules (:meth:`FaultProxy.inject`: the next N matching requests) and from
an optional seeded random mode (:meth:`FaultProxy.chaos`). Every request is logged with
the fault it got, so a test can check that faults were injected at all.
"""

from __future__ import annotations

import random
import re
import socket
import threading
import time
from dataclasses import dataclass, field

KINDS = ("http500", "http503", "slowdown", "drop", "drop_after", "delay")

_ERRORS = {
    "http500": (500, "Internal Server Error", "InternalError"),
    "http503": (503, "Service Unavailable", "ServiceUnavailable"),
    "slowdown": (503, "Slow Down", "SlowDown"),
}


@dataclass
class _Rule:
    kind: str
    remaining: int
    method: str | None
    path: re.Pattern[str] | None

    def matches(self, method: str, target: str) -> bool:
        if self.method is not None and method != self.method:
            return False
        return self.path is None or self.path.search(target) is not None


@dataclass
class _Chaos:
    rate: float
    kinds: tuple[str, ...]
    rng: random.Random
    budget: int


@dataclass
class FaultProxy:
    """Listens on 127.0.0.1 (an ephemeral port) and forwards to ``upstream`` (host, port).

    Attributes:
        delay: seconds a ``delay`` fault waits before forwarding.
        log: ``(method, target, fault or None)`` of every request, in arrival order.
    """

    upstream: tuple[str, int]
    delay: float = 0.3
    log: list[tuple[str, str, str | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._chaos: _Chaos | None = None
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True, name="faultproxy")
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` of the proxy."""
        return f"http://127.0.0.1:{self._server.getsockname()[1]}"

    def inject(
        self, kind: str, count: int = 1, *, method: str | None = None, path: str | None = None
    ) -> None:
        """Give the next ``count`` requests matching ``method`` and the ``path`` regex
        (searched in the request target, query included) the fault ``kind``."""
        assert kind in KINDS, kind
        with self._lock:
            self._rules.append(_Rule(kind, count, method, re.compile(path) if path else None))

    def chaos(
        self, rate: float, *, seed: int, kinds: tuple[str, ...] = KINDS, budget: int = 10**9
    ) -> None:
        """Give each request a fault with probability ``rate`` (seeded), at most ``budget``."""
        with self._lock:
            self._chaos = _Chaos(rate, kinds, random.Random(seed), budget)

    def calm(self) -> None:
        """Stop injecting faults (rules and chaos)."""
        with self._lock:
            self._rules.clear()
            self._chaos = None

    def faults(self) -> list[str]:
        """The faults injected so far, in order."""
        with self._lock:
            return [f for _, _, f in self.log if f is not None]

    def close(self) -> None:
        self._stopping.set()
        self._thread.join()
        self._server.close()

    # ------------------------------------------------------------------ internals

    def _pick(self, method: str, target: str) -> str | None:
        with self._lock:
            fault = None
            for rule in self._rules:
                if rule.remaining > 0 and rule.matches(method, target):
                    rule.remaining -= 1
                    fault = rule.kind
                    break
            chaos = self._chaos
            if (
                fault is None
                and chaos is not None
                and chaos.budget > 0
                and chaos.rng.random() < chaos.rate
            ):
                fault = chaos.rng.choice(chaos.kinds)
                chaos.budget -= 1
            self.log.append((method, target, fault))
            return fault

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        cfile = client.makefile("rb")
        try:
            while not self._stopping.is_set():
                request = _read_request(cfile, client)
                if request is None:
                    return
                method, target, raw = request
                fault = self._pick(method, target)
                if fault == "drop":
                    return
                if fault in _ERRORS:
                    client.sendall(_error_response(*_ERRORS[fault]))
                    continue
                if fault == "delay":
                    time.sleep(self.delay)
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    ufile = upstream.makefile("rb")
                upstream.sendall(raw)
                response, close = _read_response(ufile, method)
                if fault == "drop_after":
                    return
                client.sendall(response)
                if close:
                    return
        except OSError:
            return  # the client gave up (a timeout) or the server went away
        finally:
            for s in (client, upstream):
                if s is not None:
                    s.close()


def _headers(f) -> tuple[bytes, dict[str, str]] | None:
    """Raw header block (start line included) and lower-cased headers; None at EOF."""
    lines = []
    while True:
        line = f.readline(65537)
        if not line:
            return None
        if not lines and line in (b"\r\n", b"\n"):
            continue
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            break
    headers = {}
    for line in lines[1:-1]:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return b"".join(lines), headers


def _body(f, headers: dict[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = []
        while True:
            size_line = f.readline()
            out.append(size_line)
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    trailer = f.readline()
                    out.append(trailer)
                    if trailer in (b"\r\n", b"\n", b""):
                        return b"".join(out)
            out.append(f.read(size + 2))
    length = int(headers.get("content-length", "0") or 0)
    return f.read(length) if length else b""


def _read_request(f, client: socket.socket) -> tuple[str, str, bytes] | None:
    head = _headers(f)
    if head is None:
        return None
    raw, headers = head
    method, target = raw.split(b" ", 2)[:2]
    if headers.get("expect", "").lower() == "100-continue":
        # Answer the client ourselves and forward without the header.
        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        raw = re.sub(rb"(?im)^expect:[^\r\n]*\r?\n", b"", raw)
    return method.decode(), target.decode(), raw + _body(f, headers)


def _read_response(f, method: str) -> tuple[bytes, bool]:
    head = _headers(f)
    if head is None:
        raise ConnectionError("the server closed the connection")
    raw, headers = head
    status = int(raw.split(b" ", 2)[1])
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        body = b""
    elif "content-length" in headers or "chunked" in headers.get("transfer-encoding", ""):
        body = _body(f, headers)
    else:
        body = f.read()  # delimited by the server closing the connection
        return raw + body, True
    return raw + body, headers.get("connection", "").lower() == "close"


def _error_response(status: int, reason: str, code: str) -> bytes:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>injected by faultproxy</Message>"
        "<RequestId>faultproxy</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body
