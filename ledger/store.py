"""The one storage seam: fsspec URIs, atomic writes, exclusive creates, checksums.

Nothing else in ledger imports fsspec. Paths inside a log are relative, ``/``-separated
strings (a remote URI is not a ``Path``).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ledger.errors import CommitConflict, StorageError


def sha256(data: bytes) -> str:
    """Hex SHA-256 of ``data`` (FIPS 180-4)."""
    return hashlib.sha256(data).hexdigest()


class Store:
    """A log root on local disk or any fsspec filesystem.

    Args:
        root: a local path or a URI such as ``s3://bucket/prefix``.
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...).
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        fs, path = fsspec.core.url_to_fs(str(root), **(storage_options or {}))
        self.fs = fs
        self.is_local = isinstance(fs, LocalFileSystem)
        self.path = os.path.abspath(path) if self.is_local else path.rstrip("/")
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.uri = self.path if self.is_local else f"{protocol}://{self.path}"

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    def full(self, rel: str) -> str:
        """Filesystem path of ``rel`` (usable with :attr:`fs`)."""
        return f"{self.path}/{rel}" if rel else self.path

    def local_path(self, rel: str) -> str | None:
        """OS path of ``rel`` on local disk, or ``None`` for a remote root."""
        return os.path.join(self.path, *rel.split("/")) if self.is_local else None

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self.full(rel)))

    def read_bytes(self, rel: str) -> bytes:
        """Whole contents of ``rel``.

        Raises:
            FileNotFoundError: if it does not exist.
        """
        return bytes(self.fs.cat_file(self.full(rel)))

    def ls(self, rel_dir: str) -> list[str]:
        """Names (not paths) directly under ``rel_dir``, sorted; empty if it is missing."""
        try:
            entries = self.fs.ls(self.full(rel_dir), detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def glob(self, pattern: str) -> list[str]:
        """Relative paths matching ``pattern`` (relative to the root), sorted."""
        prefix = self.path + "/"
        return sorted(str(p)[len(prefix) :] for p in self.fs.glob(self.full(pattern)))

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Make ``rel`` appear with exactly ``data``, never partially.

        Local disk: write a temporary file in the same directory, fsync it, rename it over
        ``rel``, fsync the directory. Object stores: a single PUT is atomic.

        Note:
            A crash may leave a ``.tmp-*`` file beside ``rel``; readers ignore such names.

        Raises:
            StorageError: if the write fails; ``rel`` is then untouched.
        """
        try:
            if self.is_local:
                final = self.local_path(rel)
                assert final is not None
                tmp = self._write_tmp(final, data)
                os.replace(tmp, final)
                self._fsync_dir(os.path.dirname(final))
            else:
                self.fs.pipe_file(self.full(rel), data)
        except OSError as e:
            raise StorageError(
                f"could not write {self.full(rel)}: {e}; nothing was replaced"
            ) from e

    def create_exclusive(self, rel: str, data: bytes) -> None:
        """Create ``rel`` with ``data`` only if it does not exist yet, atomically.

        Local disk: the data is written and fsynced under a temporary name, then
        hard-linked to ``rel``; ``link(2)`` fails if ``rel`` exists, so exactly one of two
        racing writers wins.

        Raises:
            CommitConflict: if ``rel`` already exists (someone else created it).
            StorageError: on any other failure; ``rel`` then does not exist.
        """
        if not self.is_local:
            raise StorageError(
                f"exclusive create on {self.uri} is not supported yet: use a local log root"
            )
        final = self.local_path(rel)
        assert final is not None
        tmp = None
        try:
            tmp = self._write_tmp(final, data)
            os.link(tmp, final)
            self._fsync_dir(os.path.dirname(final))
        except FileExistsError as e:
            raise CommitConflict(
                f"{self.full(rel)} already exists: another writer created it first"
            ) from e
        except OSError as e:
            raise StorageError(f"could not create {self.full(rel)}: {e}") from e
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)

    @staticmethod
    def _write_tmp(final: str, data: bytes) -> str:
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = os.path.join(os.path.dirname(final), f".tmp-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        return tmp

    @staticmethod
    def _fsync_dir(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Files:
    """A set of data files given as URIs or globs, read through fsspec (for sources).

    Args:
        urls: a URI, a glob, or a list of them (``"data/*.parquet"``, ``"s3://b/x-*.jsonl"``).
        storage_options: passed to the fsspec filesystem.

    Raises:
        FileNotFoundError: if a URI or glob matches no file.
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
            found = sorted(fs.glob(path)) if fsspec.core.has_magic(path) else [path]
            if not found or not all(fs.isfile(p) for p in found):
                raise FileNotFoundError(f"{url} matches no data file")
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
