"""The one storage seam: fsspec URIs, atomic writes, exclusive creates, checksums.

Nothing else in ledger imports fsspec. Paths inside a log are relative, ``/``-separated
strings (a remote URI is not a ``Path``).

Object stores (``s3://bucket/prefix`` through s3fs) have no rename, so a file becomes
visible with one PUT under its final name, and "create only if absent" is done one of two
ways (``docs/object-storage.md`` describes the whole protocol):

* ``conditional``: a PUT with ``If-None-Match: *``, which the server refuses with
  HTTP 412 when the key exists (AWS S3 since 2024; Ceph RGW, tested).
* ``claim``: for servers that ignore that header (``rclone serve s3`` does), every
  creator first PUTs a claim object under a unique name in ``_claims/<rel>/``, then lists
  the claims, then looks for ``rel``; it writes ``rel`` only if it saw no other live
  claim and no ``rel``. With linearizable PUT and LIST (S3's strong consistency), two
  creators cannot both win: whichever listed first would have been seen by the other.
  Both may lose a round; they back off and look again. A claim older than
  :data:`CLAIM_LEASE_S` (by the server's clock) is taken to be a crashed creator's.

``auto`` (the default) probes the bucket once per process: two conditional PUTs of the
same probe key; a 412 on the second means the server enforces the condition.
"""

from __future__ import annotations

import contextlib
import errno
import glob as globlib
import hashlib
import os
import random
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ledger.errors import CommitConflict, LedgerError, StorageError

CLAIMS_DIR = "_claims"
"""Folder under a remote root holding claim objects of the ``claim`` exclusivity mode."""

CLAIM_LEASE_S = 30.0
"""A claim older than this (seconds, server clock) belongs to a crashed creator. A live
creator gives up (``StorageError``) if its own claim-check-write takes half of it."""

EXCLUSIVE_MODES = ("auto", "conditional", "claim")

_S3 = ("s3", "s3a")
_probed: dict[tuple[str, str], bool] = {}  # (storage options, bucket) -> conditional PUT works


_SMALL = 1 << 16
"""Bytes of a file read by one ``os.read`` before :func:`_read_local` reads the rest
through a file object (64 KiB: below malloc's mmap threshold)."""


def _read_local(path: str) -> bytes:
    """Whole contents of a local file: ``os.open`` and ``os.read`` for a small one (a
    marker, rank table or segment: ~5 us, against ~12 us for ``open().read()``'s
    buffered file object, which counts at 10^4 commits of two files each).

    Raises:
        FileNotFoundError: if it does not exist (``OSError`` otherwise).
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        head = os.read(fd, _SMALL)
        if len(head) < _SMALL:
            rest = os.read(fd, _SMALL)  # b"" at the end of the file
            if not rest:
                return head
            head += rest
        with open(fd, "rb", closefd=False) as f:
            return head + f.read()
    finally:
        os.close(fd)


_NO_FILE = (errno.EISDIR, errno.ELOOP)
"""Errors of reading a path that holds no file: a folder, a loop of symbolic links."""

_BACKGROUND: dict[str, tuple[int, ThreadPoolExecutor]] = {}


def background(name: str) -> ThreadPoolExecutor:
    """The process's one background thread called ``name``, for reads and checksums that
    overlap with the caller's work (hashlib, file reads and Arrow's decoders release the
    GIL). A forked child does not inherit its parent's threads, so it makes its own. A
    task must not wait for another task of the same thread (there is one).
    """
    made = _BACKGROUND.get(name)
    if made is None or made[0] != os.getpid():
        made = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix=f"ledger-{name}"))
        _BACKGROUND[name] = made
    return made[1]


def sha256(data: bytes) -> str:
    """Hex SHA-256 of ``data`` (FIPS 180-4)."""
    return hashlib.sha256(data).hexdigest()


def remote_options(protocol: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` with ledger's defaults for an object store filled in.

    For S3 (s3fs/botocore): retries in botocore's ``standard`` mode, 5 attempts in all
    (exponential backoff with jitter, on throttling, 5xx and connection errors), unless
    ``config_kwargs["retries"]`` or ``AWS_RETRY_MODE`` / ``AWS_MAX_ATTEMPTS`` say
    otherwise; a 10 s connect and 60 s read timeout unless given; no listings cache (a
    listing must see another process's new files). Credentials, endpoint and region
    come from ``storage_options`` or, when absent there, from the standard AWS
    environment and config files (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...).

    Args:
        protocol: the URI's protocol (``"s3"``).
        storage_options: the caller's options; not modified.

    Returns:
        The options to pass to fsspec.
    """
    opts = dict(storage_options or {})
    if protocol in _S3:
        config = dict(opts.get("config_kwargs") or {})
        if not (os.environ.get("AWS_RETRY_MODE") or os.environ.get("AWS_MAX_ATTEMPTS")):
            config.setdefault("retries", {"max_attempts": 5, "mode": "standard"})
        config.setdefault("connect_timeout", 10)
        config.setdefault("read_timeout", 60)
        opts["config_kwargs"] = config
        opts.setdefault("use_listings_cache", False)
    return opts


def _precondition_failed(e: BaseException) -> int | None:
    """412 or 409 if ``e`` (or an exception it wraps) is an S3 conditional-write refusal."""
    seen: BaseException | None = e
    for _ in range(8):  # the chain of causes; bounded in case it loops
        if seen is None:
            break
        if isinstance(seen, FileExistsError):
            return 412
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = response.get("Error", {}).get("Code")
            if status == 412 or code == "PreconditionFailed":
                return 412
            if status == 409 and code == "ConditionalRequestConflict":
                return 409
        seen = seen.__cause__ or seen.__context__
    return None


Fetched = Mapping[str, bytes | None]
"""Files already read by :meth:`Store.read_many`, by relative path (``None``: absent)."""

READ_AHEAD = 64
"""Files :meth:`Store.read_ahead_chunks` fetches at once from an object store: the
requests in flight together, and the most file bytes it holds in memory at a time."""

_T = TypeVar("_T")


class Store:
    """A log root on local disk or any fsspec filesystem.

    Args:
        root: a local path or a URI such as ``s3://bucket/prefix``.
        storage_options: passed to the fsspec filesystem (credentials, endpoint, retries,
            ...); see :func:`remote_options` for the defaults ledger adds for S3.
        exclusive: how :meth:`create_exclusive` works on a remote root: ``"auto"``
            (probe the server), ``"conditional"`` (``If-None-Match: *`` PUTs) or
            ``"claim"`` (claim objects); default: ``$LEDGER_EXCLUSIVE`` or ``"auto"``.
            Ignored for local roots (``link(2)``) and non-S3 filesystems (``claim``).

    Raises:
        ValueError: if ``exclusive`` is not one of :data:`EXCLUSIVE_MODES`.
        StorageError: if the root's protocol is unknown or its fsspec implementation is
            not installed (``s3fs`` for ``s3://``: ``pip install 'ledger[s3]'``).
    """

    def __init__(
        self,
        root: str,
        storage_options: dict[str, Any] | None = None,
        *,
        exclusive: str | None = None,
    ) -> None:
        protocol = fsspec.core.split_protocol(str(root))[0] or "file"
        try:
            fs, path = fsspec.core.url_to_fs(str(root), **remote_options(protocol, storage_options))
        except ImportError as e:  # fsspec names the package to install
            extra = " (pip install 'ledger[s3]')" if protocol in _S3 else ""
            raise StorageError(f"cannot open the log root {root}: {e}{extra}") from e
        except ValueError as e:  # an unknown protocol
            raise StorageError(f"cannot open the log root {root}: {e}") from e
        self.fs = fs
        self.is_local = isinstance(fs, LocalFileSystem)
        self.path = os.path.abspath(path) if self.is_local else path.rstrip("/")
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.protocol = protocol
        self.uri = self.path if self.is_local else f"{protocol}://{self.path}"
        self.exclusive = exclusive or os.environ.get("LEDGER_EXCLUSIVE") or "auto"
        if self.exclusive not in EXCLUSIVE_MODES:
            raise ValueError(
                f"exclusive must be one of {', '.join(EXCLUSIVE_MODES)}, got {self.exclusive!r}"
            )
        # What identifies the server for the probe's cache (the endpoint may come from env).
        self._server_key = repr(
            (sorted((storage_options or {}).items()), os.environ.get("AWS_ENDPOINT_URL"))
        )

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    def full(self, rel: str) -> str:
        """Filesystem path of ``rel`` (usable with :attr:`fs`)."""
        return f"{self.path}/{rel}" if rel else self.path

    def _os_path(self, rel: str) -> str:
        if not rel:
            return self.path
        return f"{self.path}/{rel}" if os.sep == "/" else os.path.join(self.path, *rel.split("/"))

    def local_path(self, rel: str) -> str | None:
        """OS path of ``rel`` on local disk, or ``None`` for a remote root."""
        return os.path.join(self.path, *rel.split("/")) if self.is_local else None

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists.

        Raises:
            StorageError: if the storage cannot be asked.
        """
        try:
            return bool(self.fs.exists(self.full(rel)))
        except Exception as e:
            raise self._error(f"could not check {self.full(rel)}", e) from e

    def read_bytes(self, rel: str) -> bytes:
        """Whole contents of ``rel``.

        Raises:
            FileNotFoundError: if it does not exist, or is no file (a directory, a loop of
                symbolic links: no file holds the record there).
            StorageError: if reading fails otherwise.
        """
        try:
            if self.is_local:  # fsspec costs ~100 us a call; a log has 10^4 small markers
                return _read_local(self._os_path(rel))
            return bytes(self.fs.cat_file(self.full(rel)))
        except FileNotFoundError:
            raise
        except OSError as e:
            if e.errno in _NO_FILE:
                raise FileNotFoundError(e.errno, f"{self.full(rel)} is not a file: {e}") from e
            raise self._error(f"could not read {self.full(rel)}", e) from e
        except Exception as e:
            raise self._error(f"could not read {self.full(rel)}", e) from e

    def read_many(self, rels: Sequence[str]) -> list[bytes | None]:
        """Whole contents of each of ``rels``, in order (``None``: it does not exist).

        An object store's files are fetched concurrently, by fsspec's ``cat`` of many
        paths (asynchronous filesystems such as s3fs run up to their ``batch_size``
        requests at once), so 10^4 markers wait on ~10^4 / batch_size round trips, not
        10^4; a local root's are read one by one (~5 µs each, where threads would only
        contend for the GIL).

        Raises:
            StorageError: if reading one fails otherwise than by its absence.
        """
        if self.is_local or len(rels) < 2:
            return self.read_each(rels)
        paths = [self.full(rel) for rel in rels]
        try:
            found = self.fs.cat(paths, on_error="return")
        except Exception as e:
            raise self._error(f"could not read {len(paths)} files under {self.uri}", e) from e
        strip = self.fs._strip_protocol
        out: list[bytes | None] = []
        for path in paths:
            data = found.get(strip(path))
            if data is None:  # fsspec answers with the paths it was given
                raise StorageError(f"could not read {path}: the storage did not return it")
            if isinstance(data, FileNotFoundError):
                out.append(None)
            elif isinstance(data, BaseException):
                raise self._error(f"could not read {path}", data) from data
            else:
                out.append(bytes(data))
        return out

    def read_each(self, rels: Sequence[str]) -> list[bytes | None]:
        """:meth:`read_many` one file after another (each read waits for the one before).

        Raises:
            StorageError: if reading one fails otherwise than by its absence.
        """
        out: list[bytes | None] = []
        for rel in rels:
            try:
                out.append(self.read_bytes(rel))
            except FileNotFoundError:
                out.append(None)
        return out

    def read_ahead(self, rels: Sequence[str]) -> Fetched | None:
        """For an object store, ``rels``' contents fetched at once (:meth:`read_many`), by
        path, for :meth:`read_known`; ``None`` for a local root or a single file, which
        the caller then reads as it goes.

        Raises:
            StorageError: if reading one fails otherwise than by its absence.
        """
        if self.is_local or len(rels) < 2:
            return None
        return dict(zip(rels, self.read_many(rels), strict=True))

    def read_ahead_chunks(
        self, items: Sequence[_T], path: Callable[[_T], str | None]
    ) -> Iterator[tuple[Sequence[_T], Fetched | None]]:
        """``items`` in chunks of up to :data:`READ_AHEAD`, each with the files
        ``path(item)`` of its items (``None``: the item has none) fetched at once
        (:meth:`read_ahead`: ``None`` on a local root); for a reader that needs one file of
        each of many ranks (a change of shape of a stream reads the old buffers dealt to it).

        Raises:
            StorageError: if reading one fails otherwise than by its absence.
        """
        for i in range(0, len(items), READ_AHEAD):
            chunk = items[i : i + READ_AHEAD]
            yield chunk, self.read_ahead([p for item in chunk if (p := path(item)) is not None])

    def read_known(self, rel: str, known: Fetched | None) -> bytes:
        """``rel``'s bytes from ``known`` (by relative path, as :meth:`read_many` found
        them) when it holds them, else read now.

        Raises:
            FileNotFoundError: if it does not exist.
            StorageError: if reading fails otherwise.
        """
        if known is not None and rel in known:
            data = known[rel]
            if data is None:
                raise FileNotFoundError(self.full(rel))
            return data
        return self.read_bytes(rel)

    def ls(self, rel_dir: str, *, ordered: bool = True, files: bool = False) -> list[str]:
        """Names (not paths) directly under ``rel_dir``, sorted; empty if it is missing.

        Args:
            rel_dir: the folder, relative to the root.
            ordered: ``False``: in the order the storage lists them (a caller that sorts
                what it keeps saves sorting the 10^4 names of ``commits/``).
            files: only files (and links to files): a stray folder named like a record
                is not one (what the readers of records list).

        Raises:
            StorageError: if listing fails.
        """
        arrange = sorted if ordered else list
        if self.is_local:
            try:
                if files:
                    with os.scandir(self._os_path(rel_dir)) as listing:
                        return arrange([e.name for e in listing if e.is_file()])
                return arrange(os.listdir(self._os_path(rel_dir)))
            except (FileNotFoundError, NotADirectoryError):
                pass  # fsspec's answers for these (empty; a file lists as itself)
            except OSError as e:
                raise self._error(f"could not list {self.full(rel_dir)}", e) from e
        try:
            entries = self.fs.ls(self.full(rel_dir), detail=files, **self._fresh())
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._error(f"could not list {self.full(rel_dir)}", e) from e
        if files:
            entries = [e["name"] for e in entries if e.get("type") == "file"]
        return arrange(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def glob(self, pattern: str) -> list[str]:
        """Relative paths matching ``pattern`` (relative to the root), sorted.

        Raises:
            StorageError: if listing fails.
        """
        prefix = self.path + "/"
        if self.is_local:  # the standard library's glob is ~10x faster than fsspec's here
            root = globlib.escape(self.path) + os.sep
            found = globlib.glob(root + pattern.replace("/", os.sep))
            return sorted(p[len(prefix) :].replace(os.sep, "/") for p in found)
        try:
            found = self.fs.glob(self.full(pattern))
        except Exception as e:
            raise self._error(f"could not list {self.full(pattern)}", e) from e
        return sorted(str(p)[len(prefix) :] for p in found)

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Make ``rel`` appear with exactly ``data``, never partially.

        Local disk: write a temporary file in the same directory, fsync it, rename it over
        ``rel``, fsync the directory. Object stores: one PUT (a multipart upload above
        100 MiB), which is atomic; transient errors are retried by botocore.

        Note:
            A crash may leave a ``.tmp-*`` file beside ``rel`` on local disk; readers
            ignore such names. A failed PUT leaves ``rel`` as it was.

        Raises:
            StorageError: if the write fails; ``rel`` is then untouched.
        """
        try:
            if self.is_local:
                final = self.local_path(rel)
                assert final is not None
                tmp = self._write_tmp(final, data)
                try:
                    os.replace(tmp, final)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
                self._fsync_dir(os.path.dirname(final))
            else:
                self.fs.pipe_file(self.full(rel), data)
        except Exception as e:
            raise self._error(f"could not write {self.full(rel)}", e, "nothing was replaced") from e

    def delete(self, rel: str) -> None:
        """Delete the file at ``rel``; a missing file is not an error (idempotent).

        Raises:
            StorageError: if the file exists and cannot be deleted.
        """
        path = self.full(rel)
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            return
        except Exception as e:
            if not self.fs.exists(path):
                return
            raise self._error(f"deleting {path}", e) from e

    def create_exclusive(self, rel: str, data: bytes, *, durable: bool = True) -> None:
        """Create ``rel`` with ``data`` only if it does not exist yet, atomically.

        ``durable=False`` skips the fsyncs on local disk, for records that are cheap to
        write again if a power loss drops them (row-group digests).

        Local disk: the data is written and fsynced under a temporary name, then
        hard-linked to ``rel``; ``link(2)`` fails if ``rel`` exists, so exactly one of two
        racing writers wins. Object stores: a conditional PUT, or the claim protocol
        (module docstring), as :attr:`exclusive` and the server allow.

        Idempotent: if ``rel`` already holds exactly ``data`` (a retry of a create whose
        reply was lost: the first try landed), this returns normally. Callers make
        ``data`` unique to the writer (a time, a host, a random id), so another writer's
        file never compares equal.

        Raises:
            CommitConflict: if ``rel`` already exists with other contents (another writer
                created it first), or another writer kept claiming it (claim mode).
            StorageError: on any other failure. ``rel`` then holds no contents of ours,
                except that after a lost reply to the final PUT it may: a retry with the
                same ``data`` then returns normally.
        """
        if self.is_local:
            self._create_local(rel, data, durable)
        elif self._exclusive_mode() == "conditional":
            self._create_conditional(rel, data)
        else:
            self._create_by_claim(rel, data)

    # ------------------------------------------------------------------ exclusive creates

    def _create_local(self, rel: str, data: bytes, durable: bool = True) -> None:
        final = self.local_path(rel)
        assert final is not None
        tmp = None
        try:
            tmp = self._write_tmp(final, data, durable)
            os.link(tmp, final)
            if durable:
                self._fsync_dir(os.path.dirname(final))
        except FileExistsError as e:
            self._check_ours(rel, data, e)
        except OSError as e:
            raise StorageError(f"could not create {self.full(rel)}: {e}") from e
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)

    def _existing(self, rel: str) -> bytes | None:
        """Contents of ``rel``, or ``None`` if it does not exist."""
        try:
            return self.read_bytes(rel)
        except FileNotFoundError:
            return None

    def _check_ours(
        self,
        rel: str,
        data: bytes,
        cause: BaseException | None = None,
        found: bytes | None = None,
    ) -> None:
        """Return if ``rel`` holds ``data``; raise CommitConflict if it holds anything else.

        ``found``: the contents of ``rel`` if already read.
        """
        found = self._existing(rel) if found is None else found
        if found is None:
            raise StorageError(
                f"creating {self.full(rel)} was refused as a conflict, but it does not exist: "
                "another writer is creating it right now; nothing was created; retry"
            ) from cause
        if found != data:
            raise CommitConflict(
                f"{self.full(rel)} already exists: another writer created it first "
                f"({len(found)} bytes, sha256 {sha256(found)[:12]}; ours: {len(data)} bytes, "
                f"sha256 {sha256(data)[:12]})"
            ) from cause

    def _exclusive_mode(self) -> str:
        if self.protocol not in _S3:
            return "claim"
        if self.exclusive != "auto":
            return self.exclusive
        key = (self._server_key, self.path.split("/", 1)[0])
        if key not in _probed:
            _probed[key] = self._probe_conditional_put()
        return "conditional" if _probed[key] else "claim"

    def _probe_conditional_put(self) -> bool:
        """Whether the server refuses an ``If-None-Match: *`` PUT of an existing key.

        The first PUT is unconditional, so that botocore retrying it (a lost reply) cannot
        make the probe fail; a 412 can only come from the second.
        """
        probe = self.full(f"{CLAIMS_DIR}/probe-{uuid.uuid4().hex}")
        try:
            self.fs.pipe_file(probe, b"1")
            try:
                self.fs.pipe_file(probe, b"2", mode="create")
            except Exception as e:
                if _precondition_failed(e) is None:
                    raise
                return True
            return False
        except Exception as e:
            raise self._error(f"could not probe conditional PUTs at {self.uri}", e) from e
        finally:
            self._rm(probe)

    def _create_conditional(self, rel: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(self.full(rel), data, mode="create")
            return
        except Exception as e:
            if _precondition_failed(e) is None:
                raise self._error(f"could not create {self.full(rel)}", e) from e
            refusal: BaseException = e
        # 412: the key exists, maybe from our own earlier try whose reply was lost (botocore
        # retried it); 409: a concurrent conditional PUT of the key is in flight.
        self._check_ours(rel, data, refusal)

    def _create_by_claim(self, rel: str, data: bytes) -> None:
        claims = self.full(f"{CLAIMS_DIR}/{rel}")
        # Two leases: a claim already there when we start is stale one lease later at the
        # latest, and the back-off (at most 2 s between tries) then still tries after that.
        # With one lease the last try could fall just before the leftover turned stale.
        patience = time.monotonic() + 2 * CLAIM_LEASE_S
        delay = 0.05
        while True:
            started = time.monotonic()
            mine = f"{claims}/{uuid.uuid4().hex}"
            try:
                self.fs.pipe_file(mine, b"")
            except Exception as e:
                raise self._error(
                    f"could not claim {self.full(rel)}", e, "nothing was created"
                ) from e
            try:
                # The order matters: claim, then list claims, then look for rel. A winner
                # removes its claim only after rel exists, so a later creator that no
                # longer sees the claim sees rel.
                rivals = self._live_rivals(claims, mine)
                found = self._existing(rel)
                if found is not None:
                    self._check_ours(rel, data, found=found)
                    return  # rel holds our data: an earlier try of ours landed
                if not rivals:
                    if time.monotonic() - started > CLAIM_LEASE_S / 2:
                        raise StorageError(
                            f"claiming {self.full(rel)} took over {CLAIM_LEASE_S / 2:.0f} s, "
                            "too long to trust the claim; nothing was created; retry"
                        )
                    try:
                        self.fs.pipe_file(self.full(rel), data)
                    except Exception as e:
                        raise self._error(f"could not create {self.full(rel)}", e) from e
                    return
            finally:
                self._rm(mine)  # a leftover claim only delays others until it is stale
            if time.monotonic() > patience:
                raise CommitConflict(
                    f"{self.full(rel)}: other writers kept claiming it for "
                    f"{2 * CLAIM_LEASE_S:.0f} s "
                    f"({len(rivals)} live claim(s) in {claims}); nothing was created"
                )
            time.sleep(random.uniform(delay / 2, delay))
            delay = min(delay * 2, 2.0)

    def _live_rivals(self, claims: str, mine: str) -> list[str]:
        """Other claims in ``claims`` that are not stale (older than ours by the lease)."""
        try:
            entries = self.fs.ls(claims, detail=True, **self._fresh())
        except Exception as e:
            raise self._error(
                f"could not list the claims {claims}", e, "nothing was created"
            ) from e
        stamps = {str(e["name"]).rstrip("/"): _mtime(e) for e in entries}
        if mine not in stamps:
            raise StorageError(
                f"the claim {mine} just written is missing from its listing: the store is not "
                "strongly consistent; ledger cannot create files exclusively on it"
            )
        own = stamps.pop(mine)
        rivals = []
        for name, stamp in stamps.items():
            if own is not None and stamp is not None and own - stamp > CLAIM_LEASE_S:
                self._rm(name)  # a crashed creator's
            else:
                rivals.append(name)
        return rivals

    # ------------------------------------------------------------------ helpers

    def _rm(self, path: str) -> None:
        with contextlib.suppress(Exception):
            self.fs.rm_file(path)

    def _fresh(self) -> dict[str, Any]:
        return {} if self.is_local else {"refresh": True}

    def _error(self, what: str, e: BaseException, left: str = "") -> LedgerError:
        if isinstance(e, LedgerError):
            return e
        detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return StorageError(f"{what}: {detail}" + (f"; {left}" if left else ""))

    @staticmethod
    def _write_tmp(final: str, data: bytes, durable: bool = True) -> str:
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = os.path.join(os.path.dirname(final), f".tmp-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        except BaseException:
            # A full disk (ENOSPC) or a quota fails mid-write: take back the partial file,
            # which would hold the space a retry needs.
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        return tmp

    @staticmethod
    def _fsync_dir(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _mtime(entry: dict[str, Any]) -> float | None:
    """Server-side modification time of a listing entry (seconds since the epoch)."""
    value = entry.get("LastModified", entry.get("mtime", entry.get("created")))
    if value is None:
        return None
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class Files:
    """A set of data files given as URIs or globs, read through fsspec (for sources).

    Args:
        urls: a URI, a glob, or a list of them (``"data/*.parquet"``, ``"s3://b/x-*.jsonl"``).
        storage_options: passed to the fsspec filesystem.

    Raises:
        FileNotFoundError: if a URI is no file, or a glob matches no file (the folders a
            glob matches are left out).
    """

    def __init__(
        self, urls: str | list[str] | tuple[str, ...], storage_options: dict[str, Any] | None = None
    ) -> None:
        items = [urls] if isinstance(urls, str) else list(urls)
        if not items:
            raise FileNotFoundError("no data files given")
        self.storage_options = dict(storage_options or {})
        fs, _ = fsspec.core.url_to_fs(str(items[0]), **self.storage_options)
        self.fs = fs
        paths: list[str] = []
        for url in items:
            _, path = fsspec.core.url_to_fs(str(url), **self.storage_options)
            if not fsspec.core.has_magic(path):
                if not fs.isfile(path):
                    what = "a folder" if fs.isdir(path) else "missing"
                    raise FileNotFoundError(f"{url} is {what}, not a data file")
                paths.append(path)
                continue
            matched = sorted(fs.glob(path))
            # A glob's data files; a folder it also matches (a Spark job's _temporary/) is
            # not one.
            found = [p for p in matched if fs.isfile(p)]
            if not found:
                folders = f" (only folders: {', '.join(matched[:3])})" if matched else ""
                raise FileNotFoundError(f"{url} matches no data file{folders}")
            paths.extend(found)
        self.paths = sorted(set(paths))

    def size(self, path: str) -> int:
        """Size of ``path`` (bytes)."""
        return int(self.fs.size(path))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``path``."""
        return bytes(self.fs.cat_file(path, start=start, end=end))

    def read(self, path: str) -> bytes:
        """Whole contents of ``path``."""
        return bytes(self.fs.cat_file(path))

    def open(self, path: str) -> IO[bytes]:
        """A binary, seekable file object for reading ``path``."""
        f: IO[bytes] = self.fs.open(path, "rb")
        return f

    def __getstate__(self) -> dict[str, Any]:
        # Workers rebuild the filesystem object: never ship open handles or clients.
        return {"paths": self.paths, "storage_options": self.storage_options, "url": self._url()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.storage_options = state["storage_options"]
        self.fs, _ = fsspec.core.url_to_fs(state["url"], **self.storage_options)
        self.paths = state["paths"]

    def _url(self) -> str:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return self.paths[0] if protocol in ("file", "local") else f"{protocol}://{self.paths[0]}"
