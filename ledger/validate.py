"""Small checks for what readers parse: a field of the right type, or a typed error.

Every reader of the log (``run.json``, attempt records, commit markers, journal
records) and of checkpoint tokens goes through these helpers, so a damaged or hostile
file raises :class:`ledger.errors.LogCorrupted` (or the caller's error type) naming the
file and the field, never a ``KeyError`` or ``TypeError`` from deep inside a parser.
They are deliberately tiny, to be applied field by field wherever a format is parsed.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, TypeVar

from ledger.errors import LedgerError, LogCorrupted

T = TypeVar("T")
_MISSING: Any = dataclasses.MISSING  # a dataclass field's default passes through as 'none'
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
INT64_MAX = (1 << 63) - 1
"""The largest integer a field may hold by default: the log's integers are Arrow int64
(the views, the rank tables), so a larger one is damage, not a value to convert."""

_NAMES = {int: "an integer", str: "a string", bool: "a boolean", dict: "an object", list: "a list"}


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(_NAMES.get(k, k.__name__) for k in kinds)


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool):  # JSON true is not the integer 1
        return bool in kinds
    return isinstance(value, kinds)


def obj(value: Any, where: str, error: type[LedgerError] = LogCorrupted) -> dict[str, Any]:
    """``value`` if it is a dict (a JSON object), else ``error`` naming ``where``."""
    if not isinstance(value, dict):
        raise error(f"{where}: expected a JSON object, found {type(value).__name__}")
    return value


def require(
    d: Any,
    key: str,
    kind: type | tuple[type, ...],
    where: str,
    *,
    default: Any = _MISSING,
    minimum: int | None = None,
    maximum: int = INT64_MAX,
    nullable: bool = False,
    error: type[LedgerError] = LogCorrupted,
) -> Any:
    """The field ``key`` of the object ``d``, checked to be of type ``kind``.

    Args:
        d: the parsed object (anything: a non-dict is itself an error).
        key: the field.
        kind: the accepted type(s); ``int`` never accepts ``bool``.
        where: the file (or token) being read, for the message.
        default: returned when ``key`` is absent (without it, absence is an error).
        minimum: for integers, the smallest accepted value.
        maximum: for integers, the largest accepted value (default: int64's).
        nullable: ``None`` is accepted.
        error: the error type raised (:class:`LogCorrupted` for files of the log).

    Returns:
        The value.

    Raises:
        LogCorrupted (or ``error``): naming ``where`` and ``key``, with what was found.
    """
    if type(d) is dict and (minimum is None or kind is int):
        # The common case, checked at once (a commit marker has a dozen fields and a
        # history 10^4 markers): a present value of exactly the type (``type(True)`` is
        # not ``int``) and in range; anything else takes the detailed path below.
        value: Any = d.get(key, _MISSING)
        exact = type(value) is kind  # a variable: no narrowing of ``value`` to object
        if exact and (
            kind is not int or ((minimum is None or value >= minimum) and value <= maximum)
        ):
            return value
    d = obj(d, where, error)
    if key not in d:
        if default is not _MISSING:
            return default
        raise error(f"{where}: field {key!r} is missing")
    value = d[key]
    if value is None and nullable:
        return None
    if not _is(value, kind):
        raise error(
            f"{where}: field {key!r} is {_short(value)} ({type(value).__name__}), expected "
            f"{_kind_name(kind)}{' or null' if nullable else ''}"
        )
    if isinstance(value, int) and not isinstance(value, bool):
        if minimum is not None and value < minimum:
            raise error(f"{where}: field {key!r} is {value}, expected at least {minimum}")
        if value > maximum:
            raise error(f"{where}: field {key!r} is {_short(value)}, expected at most {maximum}")
    return value


def items(d: Any, key: str, where: str, *, default: Any = _MISSING) -> list[Any]:
    """The list field ``key`` of ``d`` (see :func:`require`)."""
    return list(require(d, key, (list, tuple), where, default=default))


def sha256_hex(d: Any, key: str, where: str) -> str:
    """A field holding a lowercase hex SHA-256."""
    value = require(d, key, str, where)
    if not _HEX64.match(value):
        raise LogCorrupted(f"{where}: field {key!r} is {_short(value)}, not a hex SHA-256")
    return str(value)


def relative_path(d: Any, key: str, where: str) -> str:
    """A field holding a path relative to the log root that stays inside it."""
    value = require(d, key, str, where)
    parts = value.split("/")
    if not value or value.startswith("/") or "\\" in value or ".." in parts or "" in parts:
        raise LogCorrupted(f"{where}: field {key!r} is {_short(value)}, not a path in the root")
    return str(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["items", "obj", "relative_path", "require", "sha256_hex"]
