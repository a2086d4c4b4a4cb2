"""Typed errors. Each message says what differs (expected vs found) and what to do."""

from __future__ import annotations


class LedgerError(Exception):
    """Base class of every error ledger raises on purpose."""


_WHOLE: object = object()


class ConfigMismatch(LedgerError):
    """The loader's configuration differs from the one the log was written with.

    Attributes:
        field: the configuration key that differs (``"seed"``, ``"batch_size"``, ...).
        expected: the value recorded in the log.
        found: the value of the loader being resumed.
    """

    def __init__(
        self, field: str, expected: object = _WHOLE, found: object = _WHOLE, hint: str = ""
    ) -> None:
        if expected is _WHOLE:  # one whole message: re-raised from a DataLoader worker
            super().__init__(field)
            self.field, self.expected, self.found = "", None, None
            return
        self.field = field
        self.expected = expected
        self.found = found
        msg = (
            f"{field} differs from the log: the log was written with {field}={expected!r}, "
            f"this loader has {field}={found!r}. "
        )
        msg += hint or (
            f"Resume with {field}={expected!r}, or start a new run under a new log root."
        )
        super().__init__(msg)


class WrongRoot(LedgerError):
    """A checkpoint token belongs to another log root or another run."""


class TokenError(LedgerError):
    """A checkpoint token is malformed or of an unknown version."""


class CommitNotFound(LedgerError):
    """A commit named by a token or a query does not exist in the log."""


class CommitConflict(LedgerError):
    """Another writer created the same commit marker or claimed the same attempt first."""


class LogCorrupted(LedgerError):
    """The log contradicts itself: a checksum, row count or chain link does not match."""


class ResumeMismatch(LedgerError):
    """After replay, what the loader would produce next does not continue the log exactly."""


class StorageError(LedgerError):
    """Reading or writing the log's storage failed; the message says what was left behind."""


class UnsupportedArgument(LedgerError, ValueError):
    """A DataLoader argument ledger cannot honour exactly; the message says what it does
    instead (e.g. a custom sampler: ``shuffle=True, seed=...``)."""


class DataError(LedgerError, ValueError):
    """A data file of a source cannot be read as what its name says (a JSONL line that is
    not a JSON object); the message names the file and the line."""


class Preempted(LedgerError):
    """A preemption signal arrived (:mod:`ledger.preemption`, ``stop_loaders=True``): the
    loader stopped at a batch boundary. Save the model and ``loader.state_dict()``, then
    exit; the resumed run continues the stream exactly.

    Attributes:
        signal: the signal received (``signal.Signals``), or ``None``.
    """

    def __init__(self, message: str, sig: object = None) -> None:
        super().__init__(message)
        self.signal = sig


class SampleError(LedgerError):
    """Every sample of a batch failed to load under ``on_error="skip"`` (no batch to hand
    over), or every sample a stream's worker had left in an epoch. The message names the
    batch (or worker) and the first exception. Fix the dataset, or skip the batch: resume
    and call ``loader.skip(1, reason=...)`` (:meth:`ledger.DataLoader.skip`).
    """


class SourceMissing(ConfigMismatch):
    """A logged batch holds a sample of a :class:`ledger.Mixture` source that the mixture
    given does not have (a later phase removed it): re-creating it needs the mixture of
    the phase that served it. ``verify_data`` skips such a batch."""


class BatchSkipped(LedgerError):
    """The batch asked for was skipped on purpose (:meth:`ledger.DataLoader.skip`): the
    model never saw it, so there is nothing to re-create."""
