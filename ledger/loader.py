"""ledger.DataLoader: torch's DataLoader with the log attached, over any pipeline.

The loader owns the log, the checkpoint token and the iteration protocol; what turns the
dataset into batches is a pipeline (:mod:`ledger.pipeline`: a map-style dataset's,
:mod:`ledger.mapstyle`, or a stream's, :mod:`ledger.stream.pipeline`), to which it
delegates without asking which. A batch's events are recorded when the loader hands
it to the training loop, not when a worker made it: prefetched batches are not
recorded, and after a resume they are simply produced again.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import operator
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.utils.data as tud

from ledger import pipeline as pipelines
from ledger import preemption, torch_args, transport
from ledger.commits import Commit, PipelineState, find_run, phase_of
from ledger.errors import (
    BatchSkipped,
    CommitNotFound,
    ConfigMismatch,
    LedgerError,
    SourceMissing,
    TokenError,
    UnsupportedArgument,
    WrongRoot,
)
from ledger.fetch import RngMode, check_on_error, check_rng
from ledger.log import Ledger
from ledger.schema import EventChunk
from ledger.store import Store
from ledger.validate import require

TOKEN_VERSION = 1
_TOKEN_KEYS = ("version", "root", "run_id", "commit", "attempt", "world_size", "step")

logger = logging.getLogger("ledger")


class MapDataset(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Any: ...


class _WorkerInit:
    """Runs in each worker first: die with the main process, ignore the preemption
    signals the main process handles, send small tensors by value
    (:func:`ledger.transport.install`), then the user's init.

    torch's worker watchdog compares the parent pid with the one it saw at start-up; a
    worker forked just before its parent is SIGKILLed sees pid 1 there and never exits
    (holding memory and the parent's pipes). ``PR_SET_PDEATHSIG`` (prctl(2), Linux) has
    the kernel kill the worker with its parent; the pid check covers a parent that died
    before the call.

    SLURM signals every process of a job step: a worker that died of the SIGTERM its
    main process handles (:mod:`ledger.preemption`) would make torch raise in the main
    process. A forked worker sees the handlers installed at fork time; a spawned one gets
    them in its pickled copy of this object (``__getstate__`` runs when it starts).
    """

    def __init__(
        self, fn: Callable[[int], None] | None, main_pid: int, check: bool, copy_below: int
    ) -> None:
        self.fn = fn
        self.main_pid = main_pid
        self.check = check
        self.copy_below = copy_below
        self.ignore: frozenset[int] = frozenset()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "ignore": preemption.installed_signals()}

    def __call__(self, worker_id: int) -> None:
        preemption.ignore_in_worker(self.ignore | preemption.installed_signals())
        if self.check:
            if sys.platform.startswith("linux"):
                ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
            if os.getppid() != self.main_pid:
                os._exit(0)
        transport.install(self.copy_below)
        if self.fn is not None:
            self.fn(worker_id)


def _worker_init(fn: Callable[[int], None] | None, context: Any, copy_below: int) -> _WorkerInit:
    method = (
        context
        if isinstance(context, str)
        else context.get_start_method()
        if context is not None
        else multiprocessing.get_start_method()
    )
    # With fork and spawn the main process is the parent; a forkserver is not.
    return _WorkerInit(fn, os.getpid(), method in ("fork", "spawn"), copy_below)


def _whole(value: Any) -> int | None:
    """``value`` as an int if it is an integer (numpy's too, through ``__index__``), not a
    bool; else ``None``."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


_TORCH_FRAMES = (
    os.path.dirname(tud.__file__) + os.sep,  # torch.utils.data: the iterator, its fetch
    os.path.splitext(torch._utils.__file__)[0],  # ExceptionWrapper.reraise
)


def _clear_torch_frames(tb: Any) -> None:
    """Clear the locals of torch's finished frames in ``tb``.

    torch re-raises a worker's exception from ``ExceptionWrapper.reraise``, whose frame
    holds the exception in a local: exception, traceback and frame form a reference cycle
    through every frame of the traceback, the loader's iteration included, so a dropped
    loader (its journal's file descriptor, its workers) would wait for a garbage
    collection. Frames still running (the loader's own) cannot be cleared and are kept;
    the dataset's frames are not torch's and keep their locals for a post-mortem.
    """
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.startswith(_TORCH_FRAMES):
            with contextlib.suppress(RuntimeError):  # a frame still executing
                frame.clear()
        tb = tb.tb_next


class DataLoader:
    """A torch DataLoader whose every consumed sample is logged, and that resumes exactly.

    Batches are what ``torch.utils.data.DataLoader`` with the same ``collate_fn`` would
    produce for the same indices. The order of an epoch is a seeded bijection of
    ``[0, len(dataset))`` (:class:`ledger.order.EpochOrder`); each ``iter(loader)`` serves
    the rest of the current epoch, so epochs advance by themselves.

    The arguments are torch's, in torch's order (``dataset, batch_size, shuffle, sampler,
    batch_sampler, num_workers, collate_fn, pin_memory, drop_last, timeout,
    worker_init_fn, multiprocessing_context, generator``), then keyword-only ones; ledger's
    own (``log``, ``seed``, ...) come last. :mod:`ledger.torch_args` says which samplers are
    translated and which arguments are refused, and why.

    Args:
        dataset: map-style dataset (``__len__`` and ``__getitem__(int)``), e.g. a HF
            ``datasets.Dataset``, a :class:`ledger.Mixture` of such datasets, or a
            :class:`ledger.stream.Stream`. An ``IterableDataset`` is refused: use a
            ``Stream``.
        batch_size: samples per batch on this rank (>= 1; ``None`` is refused).
        shuffle: shuffle each epoch with the seeded order; ``False``/``None``: identity
            order.
        sampler: ``SequentialSampler`` (= ``shuffle=False``), ``RandomSampler`` without
            replacement (= ``shuffle=True``, seeded by its generator) or
            ``DistributedSampler`` (its shuffle, seed, rank and replicas); others are
            refused, since ledger must recompute the order at any position.
        batch_sampler: a ``torch.utils.data.BatchSampler`` over one of those samplers
            (its batch size and drop_last are taken); others are refused.
        generator: a ``torch.Generator`` whose ``initial_seed()`` is the run's seed
            (nothing is drawn from it).
        pin_memory_device: as for torch (passed to torch's loader).
        in_order: ``True`` only: batches are always handed over in order.
        log: log root (a local path or an object-store URI such as
            ``s3://bucket/prefix``, see ``docs/object-storage.md``) or a
            :class:`ledger.Ledger` (e.g. to choose its ``journal_dir``).
        seed: seed of the orders and of the per-sample RNG seeds (int). Default: from
            ``generator`` or a seeded sampler if given, else ``torch.initial_seed()``
            (modulo 2**63): the seed ``torch.manual_seed`` set, which torch's own shuffle
            would use too. Without ``torch.manual_seed`` that seed is random per process,
            and resuming raises ``ConfigMismatch`` naming the seed to pass.
        num_workers, collate_fn, pin_memory, drop_last, timeout, worker_init_fn,
        multiprocessing_context, prefetch_factor, persistent_workers: as for
            ``torch.utils.data.DataLoader``. ``drop_last=False`` serves a short final
            batch (never padded with duplicates); ``drop_last=True`` logs the dropped
            positions as ``skip`` events. With ``num_workers=0`` a map-style dataset's
            batches come from torch's single-process iterator driven by ledger, which
            enters torch's per-batch profiler annotation only while a profiler runs
            (:func:`ledger.pipeline.in_process`).
        rng: how torch, numpy and ``random`` are seeded for the dataset and the collate
            function (:mod:`ledger.fetch`): ``"batch"`` (default) once per batch from
            ``(seed, epoch, position of the batch's first sample)``, so augmentation does
            not depend on the number of workers nor on which one loads a batch (~7 µs per
            batch; numpy and ``random`` are seeded lazily, once the process saw a batch
            draw from them, :func:`ledger.fetch.seeded_lazily`); ``"sample"`` before
            each ``dataset[i]`` from ``(seed, epoch, sample id)``, so it does not depend on
            the batch either, and survives a change of world size (~13 µs per sample);
            ``"off"``: not seeded. A :class:`~ledger.stream.Stream`'s transform draws from
            ``ctx.rng`` (seeded per sample from ``(seed, epoch, sample id)`` in every mode,
            as Grain's random transforms get their own generator); ``"sample"`` also
            seeds torch, numpy and ``random`` before each sample of a stream.
        per_sample_rng: older spelling: ``True`` is ``rng="sample"``, ``False`` is
            ``rng="off"``.
        digest: record each batch's content digest (SHA-256 of the collated batch,
            :func:`ledger.digest.digest_bytes`, computed in the worker) in the ``batch``
            event's ``digest`` column, so ``ledger show --materialize`` can prove a
            re-created batch is the one the model saw. Turn off for batches holding types
            it cannot hash.
        rank, world_size: this rank and the number of ranks (default: from
            ``torch.distributed`` if initialised, else 0 and 1).
        verify_data: on resume (:meth:`load_state_dict`), re-create this rank's last
            committed batch through the dataset with the recorded seeds and compare its
            content digest with the one recorded when the model received it: one batch
            of reads that catches a dataset whose content changed under the same length
            (:class:`ledger.errors.ConfigMismatch` naming the batch). Needs a run with
            ``digest=True``; skipped after an elastic resume, before the first commit,
            and for a batch of a mixture source that a new phase removed.
        storage_options: fsspec/s3fs options (credentials, endpoint, retries) when ``log``
            is a URI; default: the standard AWS environment and config files.
        on_error: ``"raise"`` (default): an exception raised by the dataset stops the
            run, as in torch. ``"skip"``: a sample whose loading raises is left out of
            its batch (which is then shorter) and logged as an ``error`` event with the
            exception's type and message (``ledger audit`` lists them). The same samples
            fail on every run, resume and ``ledger show --materialize``, since loading
            is a function of the dataset and the seeds (:func:`ledger.fetch.load_batch`).
            A batch whose every sample fails raises :class:`ledger.errors.SampleError`.
            A :class:`~ledger.stream.Stream` drops a failed sample where its shuffle
            buffer hands it on and fills the batch with the next one
            (:class:`ledger.stream.pipeline.StreamPipeline`).
        copy_below_bytes: with workers, a batch's CPU tensors of fewer bytes (default
            256 KiB) reach the main process by value, copied through the data queue's
            pipe with the batch, instead of through a shared-memory file each as torch
            sends them (:mod:`ledger.transport`: a few hundred µs of CPU per tensor saved
            on the two sides; a batch of 2 KiB from 2 workers here: 284 against 678 µs).
            The batch's values, dtypes and shapes are the same; such a tensor is not in
            shared memory. ``0``: torch's way for every tensor.

    Raises:
        UnsupportedArgument: (a ``ValueError``) for an argument ledger cannot honour
            exactly (the message says what to pass instead), or a bad one: ``rng`` or
            ``on_error`` unknown, ``seed`` not an integer in [-2**63, 2**64), ``rank``
            outside ``world_size``, ``log`` not a path, URI or Ledger, a dataset whose
            ``len()`` fails, an epoch that would hold no batch.

    Note:
        Use it as a context manager, or call :meth:`close`, in long-lived processes
        (notebooks, sweeps): that shuts persistent workers down and closes the journal.
        A loader dropped without either is cleaned up when it is garbage-collected.
    """

    def __init__(
        self,
        dataset: MapDataset,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        log: str | os.PathLike[str] | Ledger,
        seed: int | None = None,
        rng: str = "batch",
        per_sample_rng: bool | None = None,
        digest: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
        verify_data: bool = False,
        on_error: str = "raise",
        copy_below_bytes: int = transport.COPY_BELOW_BYTES,
    ) -> None:
        self._verify_data = verify_data
        self._collate_fn = collate_fn
        args = torch_args.resolve(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            drop_last=drop_last,
            generator=generator,
            seed=seed,
            in_order=in_order,
            rank=rank,
            world_size=world_size,
        )
        batch_size, drop_last, rank, world_size = (
            args.batch_size, args.drop_last, args.rank, args.world_size
        )  # fmt: skip
        if rank is None or world_size is None:
            dist = torch.distributed
            active = dist.is_available() and dist.is_initialized()
            rank = rank if rank is not None else (dist.get_rank() if active else 0)
            world_size = (
                world_size if world_size is not None else (dist.get_world_size() if active else 1)
            )
        rank, world_size = (
            torch_args.count("rank", rank, 0),
            torch_args.count("world_size", world_size, 1),
        )
        if rank >= world_size:
            raise UnsupportedArgument(
                f"rank={rank} is outside world_size={world_size}: pass 0 <= rank < world_size"
            )
        num_workers = torch_args.count("num_workers", num_workers, 0)
        copy_below_bytes = torch_args.count("copy_below_bytes", copy_below_bytes, 0)
        prefetch_factor, timeout = torch_args.worker_options(num_workers, prefetch_factor, timeout)
        if not isinstance(log, Ledger) and (
            not isinstance(log, (str, os.PathLike)) or not str(os.fspath(log)).strip()
        ):
            raise UnsupportedArgument(
                f"log must be the log root (a path or URI such as s3://bucket/run) or a "
                f"ledger.Ledger, got {log!r:.60} ({type(log).__name__}); an empty path would write "
                "the log into the current directory"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = args.shuffle
        self.seed = args.seed
        self._seed_from_torch = args.seed_from_torch
        self.drop_last = bool(drop_last)
        if per_sample_rng is not None:
            rng = "sample" if per_sample_rng else "off"
        self.rng: RngMode = check_rng(rng)
        if isinstance(log, Ledger):
            self._ledger = log
        else:
            self._ledger = Ledger(
                log, rank=rank, world_size=world_size, storage_options=storage_options
            )
        self._rank = rank
        self._world_size = world_size
        self._closed = False
        self._resume_from: Commit | None = None
        # Ranges of batches [start, stop) to skip when reached, with reasons, by start.
        self._planned: list[tuple[int, int, str]] = []
        self._resume_events: list[EventChunk] = []
        # A resume's check still running in the background (Pipeline.confirm_replay): it
        # must pass before a batch is handed out, recorded or committed.
        self._unconfirmed = False
        self._token_commits: dict[str, Commit] = {}
        self._generation = 0
        # The batch index being recorded, until its events are in and the state moved:
        # left set by an exception in between (see _check_torn).
        self._torn: int | None = None
        self._iter_epoch: int | None = None
        self._live: Any = None  # the torch iterator of the epoch being served, if any
        # A private generator: torch draws each iterator's base seed from it, so the
        # loader never consumes the training loop's global torch RNG.
        generator = torch.Generator()
        generator.manual_seed(self.seed)
        torch_kwargs: dict[str, Any] = {
            "pin_memory": pin_memory,
            "timeout": timeout,
            "worker_init_fn": _worker_init(
                worker_init_fn, multiprocessing_context, copy_below_bytes
            ),
            "multiprocessing_context": multiprocessing_context,
            "generator": generator,
            "prefetch_factor": prefetch_factor,
        }
        if pin_memory_device:
            torch_kwargs["pin_memory_device"] = pin_memory_device
        self._pipeline = pipelines.build(
            dataset,
            pipelines.LoaderSettings(
                seed=self.seed,
                shuffle=self.shuffle,
                batch_size=batch_size,
                drop_last=self.drop_last,
                rank=rank,
                world_size=world_size,
                num_workers=num_workers,
                collate_fn=collate_fn or tud.default_collate,
                rng=self.rng,
                digest=digest,
                persistent_workers=persistent_workers,
                torch_kwargs=torch_kwargs,
                store=self._ledger.store,
                on_error=check_on_error(on_error),
            ),
        )
        self._state = self._pipeline.initial_state()

    # ------------------------------------------------------------------ properties

    @property
    def log(self) -> Ledger:
        """The :class:`ledger.Ledger` this loader writes."""
        return self._ledger

    @property
    def epoch(self) -> int:
        """Epoch being iterated, or when no iteration is running, the next one."""
        return self._iter_epoch if self._iter_epoch is not None else self._state.epoch

    @property
    def state(self) -> PipelineState:
        """Consumed position of this rank: the state after the last batch handed out."""
        return self._state

    @property
    def config(self) -> dict[str, Any]:
        """What must not change across a resume; stored in ``run.json``."""
        return self._pipeline.config()

    @property
    def _torch_loader(self) -> tud.DataLoader[Any]:
        """The ``torch.utils.data.DataLoader`` the pipeline runs."""
        return self._pipeline.torch_loader

    def __len__(self) -> int:
        """Batches per epoch on this rank (map-style only).

        Raises:
            TypeError: for a stream, whose batches per epoch depend on packing.
        """
        return self._pipeline.batches_per_epoch()

    # ------------------------------------------------------------------ iteration

    def _confirm_replay(self) -> None:
        """Raise the error of a resume's check left running, if it failed (every call)."""
        if self._unconfirmed:
            self._pipeline.confirm_replay()
            self._unconfirmed = False

    def _check_open(self) -> None:
        if self._closed:
            raise LedgerError("this ledger.DataLoader is closed: create a new one")

    def _ensure_started(self) -> None:
        self._check_open()
        if self._ledger.attempt is None:
            self._ledger.open(self.config)
            self._start_attempt()

    def _start_attempt(self) -> None:
        self._ledger.start(self._resume_from, self._pipeline.journal_order())
        if self._resume_events:  # e.g. a tail an elastic resume left unservable
            self._ledger.append(*self._resume_events)
        self._resume_events = []

    def __iter__(self) -> Iterator[Any]:
        """Serve the rest of the current epoch (a whole epoch after the previous ended).

        Raises:
            LedgerError: if an exception interrupted the recording of a batch (see
                :meth:`state_dict`).
        """
        self._check_torn()
        self._ensure_started()
        self._skip_due()
        batches = self._pipeline.begin(self._state)  # may refuse (a changed dataset)
        self._generation += 1
        generation = self._generation
        self._iter_epoch = self._state.epoch
        return preemption.at_batch_boundaries(self._serve(batches, generation))

    def _check_torn(self) -> None:
        """Refuse to serve or commit after an exception (``KeyboardInterrupt``, an error of
        the pipeline's check) interrupted the recording of a batch: the pipeline may have
        folded the batch (a stream's buffers) without its events or state, and a commit
        would pair one with the other."""
        if self._torn is not None:
            raise LedgerError(
                f"recording batch {self._torn} was interrupted by an exception, so this "
                "loader's pipeline and log may disagree about that batch: it neither serves "
                "nor commits; resume from your last checkpoint with load_state_dict(token)"
            )

    def _check_generation(self, generation: int) -> None:
        if generation != self._generation:
            self._check_open()  # close() moves the generation too
            raise LedgerError(
                "this iterator was invalidated by load_state_dict() or a newer "
                "iter(loader); iterate the loader again"
            )

    def _serve(self, batches: Iterable[tuple[Any, Any]], generation: int) -> Iterator[Any]:
        start_epoch = self._state.epoch
        pipeline = self._pipeline
        append = self._ledger.append
        iterator = self._live = iter(batches)
        try:
            while True:
                if self._planned and generation == self._generation and self._due():
                    # A planned range begins at the next batch: the batches torch
                    # prefetched are the skipped ones; go on from after the range.
                    self._stop(iterator)
                    self._skip_due()
                    if self._state.epoch != start_epoch:
                        return  # the skip finished the epoch
                    iterator = self._live = iter(pipeline.begin(self._state))
                try:
                    item = next(iterator, None)
                except RuntimeError as e:  # PEP 479: a StopIteration inside a generator
                    if isinstance(e.__cause__, StopIteration):
                        raise _stopped_early(self._state) from e.__cause__
                    raise
                if item is None:
                    self._check_open()  # close() shut the workers down: torch's iterator ended
                    break
                tag, data = item
                self._check_generation(generation)
                if self._unconfirmed:
                    self._confirm_replay()
                self._torn = self._state.batch
                state, events = pipeline.record(self._state, tag)
                append(*events)  # all or nothing: the state moves only once they are in
                self._state = state
                self._torn = None
                yield data
            if generation == self._generation:
                pipeline.finish(self._state, start_epoch)
        except BaseException as e:
            # Left by an error or dropped mid-epoch (GeneratorExit): end torch's workers
            # now. An exception's traceback holds torch's iterator, so a reference cycle
            # would keep them alive until a garbage collection, which then waits on them.
            failed = not isinstance(e, GeneratorExit)
            self._stop(iterator, failed=failed)
            if failed:
                _clear_torch_frames(e.__traceback__)
            raise
        finally:
            if self._live is iterator:
                self._live = None
            if generation == self._generation:
                self._iter_epoch = None

    def _stop(self, iterator: Any, failed: bool = False) -> None:
        """Shut down the workers of a torch iterator whose prefetched batches no one will
        take. Persistent workers are kept (torch resets them on the next ``iter``) unless
        the iteration ``failed``: then they end too, and the next ``iter`` starts new ones."""
        torch_loader = self._torch_loader
        if getattr(torch_loader, "persistent_workers", False):
            if not failed:
                return
            iterator = getattr(torch_loader, "_iterator", None)
            torch_loader._iterator = None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def _due(self) -> bool:
        """Whether the next batch lies in a planned range."""
        return bool(self._planned) and self._planned[0][0] <= self._state.batch

    def _skip_due(self) -> None:
        """Skip the planned ranges the next batch lies in (logged as ``rollback``)."""
        while self._due():
            _, stop, reason = self._planned.pop(0)
            if stop > self._state.batch:
                self._skip_now(stop - self._state.batch, reason)
        self._ledger.planned_skips = tuple(self._planned)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Shut persistent workers down and close the journal file; the loader's end.

        Idempotent. Events appended since the last commit stay in the journal (crash
        forensics) and are not committed: call :meth:`state_dict` first to commit them.
        Iterating (an iterator already live included: its next batch), :meth:`state_dict`
        and :meth:`load_state_dict` raise ``LedgerError`` afterwards; the live iterator's
        workers end here.
        """
        self._closed = True
        self._generation += 1  # a live iterator raises at its next batch
        self._iter_epoch = None
        torch_loader = self._pipeline.torch_loader
        for iterator in (getattr(torch_loader, "_iterator", None), self._live):
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        torch_loader._iterator = None
        self._live = None
        self._ledger.close()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Commit the log and return the checkpoint token.

        Writes the events consumed since the last commit as a Parquet segment, then the
        commit marker (both atomically). Call it when you checkpoint the model; store
        the token in the checkpoint.

        Returns:
            A dict of primitive types (``str``/``int``), loadable with
            ``torch.load(..., weights_only=True)``: ``version, root, run_id, commit,
            attempt, world_size, step``. ``commit`` is ``""`` before the first batch
            of a run. The token is the same on every rank: it names the commit, whose
            marker holds each rank's state. So ``torch.distributed.checkpoint``, which
            keeps one copy of a non-tensor value that all ranks share, restores every
            rank, and any rank's token resumes a run with another world size.

        Raises:
            StorageError: if writing fails; the events stay pending and the next call
                commits them.
            LedgerError: if an exception interrupted the recording of a batch (a
                ``KeyboardInterrupt`` in those microseconds, an error of the pipeline's
                check of the batch): resume from the last checkpoint.
        """
        self._check_open()
        self._check_torn()
        self._confirm_replay()
        if self._ledger.attempt is None:
            run_id = self._ledger.open(self.config)
            head = self._resume_from
        else:
            snapshot = self._pipeline.snapshot(self._state)
            previous = self._ledger.head
            head = self._ledger.commit(self._state, snapshot)
            run_id = self._ledger.run_id or ""
            if head is not previous:
                logger.info(
                    "rank %d committed %s (step %d, epoch %d) to %s",
                    self._rank,
                    head.id,
                    head.step,
                    self._state.epoch,
                    self._ledger.root,
                )
        return {
            "version": TOKEN_VERSION,
            "root": self._ledger.root,
            "run_id": run_id,
            "commit": head.id if head else "",
            "attempt": head.attempt if head else -1,
            "world_size": self._world_size,
            "step": head.step if head else 0,
        }

    def skip(
        self,
        batches: int | None = None,
        *,
        reason: str,
        steps: range | Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Skip this rank's next ``batches`` batches, or the batches of ``steps`` when
        they are reached, on purpose and on the record.

        For loss-spike recovery as in PaLM (Chowdhery et al. 2022, section 5.1: restart
        from a checkpoint about 100 steps before the spike and skip about 200-500
        batches): resume from an older checkpoint, then skip the batches that preceded
        the spike. They are logged as ``rollback`` events (the skipped positions, with
        JSON ``{"reason": reason}`` in ``value``) and become part of the committed
        history with the next commit, so every later resume continues after them;
        ``ledger audit`` and ``ledger report`` list them and ``ledger show`` names the
        reason.

        A skipped batch keeps its batch index (``ledger show --batch`` and the token's
        ``step`` count it): batch ``k`` of the log is the ``k``-th batch of the data order,
        served or skipped, so a loop that counts optimizer steps counts ``batches``
        fewer. Map-style datasets skip without reading data (a batch whose loading fails
        can be skipped); a :class:`~ledger.stream.Stream` produces the skipped batches
        (its next batches depend on its buffers and packing) and logs them as skipped.
        Under ``torch.distributed`` call it on every rank with the same arguments: each
        rank skips its own next ``batches`` batches.

        Args:
            batches: how many batches to skip now (>= 1); or ``None`` with ``steps``.
            reason: why, for the record (e.g. ``"loss spike at step 41230"``).
            steps: batch indexes to skip when the loader reaches them (the token's
                ``step`` counts batch indexes): a ``range(a, b)`` (step 1) or a list of
                ``(a, b)`` pairs, each the range ``[a, b)``. A range is *planned*: it is
                written in every commit's marker until reached (so a resume from any
                later checkpoint still skips it), and when the loader reaches ``a`` it
                skips to ``b`` as ``skip(b - a)`` would, the reason on every ``rollback``
                event. A range the loader is already inside skips the rest of it at
                once. Planned ranges may not overlap each other.

        Raises:
            ValueError: if ``batches < 1``, both or neither of ``batches`` and ``steps``
                are given, a range of ``steps`` is empty, malformed, already passed
                (``b <=`` the current batch index) or overlaps another planned one, or
                ``reason`` is empty.

        Note:
            A live iterator of the loader is invalidated (its next ``next()`` raises
            ``LedgerError``): iterate the loader again. Nothing is committed until the
            next :meth:`state_dict`; a crash before it loses the skip with the batches
            of the journal.
        """
        self._check_open()
        self._check_torn()
        if (batches is None) == (steps is None):
            raise ValueError("skip() takes a number of batches or steps=, not both or neither")
        if batches is not None:
            number = _whole(batches)
            if number is None or number < 1:
                raise ValueError(f"skip() takes an int number of batches >= 1, got {batches!r}")
            batches = number
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError("skip() needs a reason for the record, e.g. reason='loss spike'")
        self._ensure_started()
        if steps is not None:
            self._plan(steps, reason)
            if self._due():
                self._skip_due()
                self._generation += 1  # prefetched batches of a live iterator are skipped
                self._iter_epoch = None
            return
        assert batches is not None
        self._skip_now(batches, reason)
        self._generation += 1  # prefetched batches of a live iterator are the skipped ones
        self._iter_epoch = None

    def _plan(self, steps: range | Sequence[tuple[int, int]], reason: str) -> None:
        """Add ``steps`` to the planned ranges (see :meth:`skip`).

        Raises:
            ValueError: for an empty, malformed, passed or overlapping range.
        """
        if isinstance(steps, range):
            if steps.step != 1:
                raise ValueError(f"steps= takes a range with step 1, got {steps!r}")
            pairs: list[Any] = [(steps.start, steps.stop)]
        else:
            pairs = list(steps)
        planned = list(self._planned)
        for pair in pairs:
            ok = isinstance(pair, tuple | list) and len(pair) == 2
            ends = [_whole(v) for v in pair] if ok else []
            start, stop = ends if len(ends) == 2 else (None, None)
            if start is None or stop is None:
                raise ValueError(f"steps= takes (start, stop) pairs of ints, got {pair!r}")
            if not 0 <= start < stop:
                raise ValueError(f"steps [{start}, {stop}) is empty or negative")
            if stop <= self._state.batch:
                raise ValueError(
                    f"steps [{start}, {stop}) are passed already: the next batch is "
                    f"{self._state.batch}; resume from an older checkpoint to skip them"
                )
            clash = next((p for p in planned if p[0] < stop and start < p[1]), None)
            if clash is not None:
                raise ValueError(
                    f"steps [{start}, {stop}) overlap the planned skip [{clash[0]}, "
                    f"{clash[1]}) ({clash[2]!r})"
                )
            planned.append((start, stop, reason))
        self._planned = sorted(planned)
        self._ledger.planned_skips = tuple(self._planned)
        logger.info(
            "rank %d will skip batches %s: %s",
            self._rank, ", ".join(f"[{a}, {b})" for a, b, _ in self._planned), reason,
        )  # fmt: skip

    def _skip_now(self, batches: int, reason: str) -> None:
        """Skip the next ``batches`` batches (see :meth:`skip`)."""
        self._confirm_replay()
        before = self._state
        state, events = self._pipeline.skip(before, batches, reason)
        if events:
            self._ledger.append(*events)  # all or nothing, as a served batch's
        self._state = state
        logger.info(
            "rank %d skipped batches %d..%d (epoch %d batch %d -> epoch %d batch %d): %s",
            self._rank, before.batch, state.batch - 1, before.epoch, before.epoch_batch,
            state.epoch, state.epoch_batch, reason,
        )  # fmt: skip

    def load_state_dict(
        self,
        state_dict: dict[str, Any],
        *,
        new_phase: bool = False,
        skip_batches: int = 0,
        skip_steps: range | Sequence[tuple[int, int]] | None = None,
        reason: str = "",
    ) -> None:
        """Resume from a token returned by :meth:`state_dict`, by replaying the log.

        The next batch is exactly the one the uninterrupted run would have produced
        after the token's commit. A new attempt starts whose first commit's parent is that
        commit; commits the old attempt made after it become an abandoned branch.

        Args:
            state_dict: the token.
            new_phase: record a deliberate change of configuration as a new *phase* of
                the run (in the new attempt's record, ``attempts/<A>.json``) instead of
                refusing it. A phase can change the batch size (and ``drop_last`` of a
                map-style dataset or mixture), and a :class:`ledger.Mixture`'s weights,
                schedule and sources. It starts where the ranks' consumed positions
                reached (a prefix of the current epoch's order): the new batches cut the
                order from there; a stream's workers continue their streams where they
                stood; every mixture source kept continues its own stream, a new one
                starts at its beginning, and positions from there are mixed with the new
                weights (whose schedule counts from the phase's start). Later resumes of
                the phase need the same configuration; audits read each phase's targets.
                See the README's "Phases".
            skip_batches: then skip this many batches on the record (:meth:`skip`, for
                loss-spike recovery); 0: none.
            skip_steps: then plan these batch indexes to be skipped when reached
                (``skip(steps=...)``): a ``range(a, b)`` or ``(a, b)`` pairs. Ranges
                planned before the token's commit (in its lineage) stay planned.
            reason: why they are skipped (required with ``skip_batches`` or
                ``skip_steps``).

        Raises:
            TokenError: if the token is malformed or of another version.
            WrongRoot: if the token's run or commit is not in this loader's log. A token
                written to another root resumes when this root holds the same run and
                commit (a log copied, mounted elsewhere or moved to another bucket).
            ConfigMismatch: if dataset length, seed, shuffle, batch size, drop_last or
                a mixture's weights or sources differ from the phase's (names both
                values), or with ``new_phase`` if the change is not one a phase can make.
            CommitNotFound: if the token's commit is not in the log.
            LogCorrupted, ResumeMismatch: if replay finds the log inconsistent, or the
                loader would not continue it exactly.

        Note:
            On a map-style resume the rank's newest segment is hashed on a background
            thread while the first batch is fetched: a damaged or missing segment is then
            a ``LogCorrupted`` raised by the first ``next()`` (and every later one, and
            ``state_dict()`` and ``skip()``), before any batch is handed out, recorded or
            committed. The new attempt's record exists by then, as after a crash.
        """
        self._check_open()
        if (skip_batches or skip_steps is not None) and (
            not isinstance(reason, str) or not reason.strip()
        ):
            raise ValueError(
                "load_state_dict(skip_batches=... or skip_steps=...) needs a reason for the record"
            )
        number = _whole(skip_batches)
        if number is None or number < 0:
            raise ValueError(f"skip_batches must be an int >= 0, got {skip_batches!r}")
        skip_batches = number
        token = _check_token(state_dict)
        self._token_commits = {}  # the token's commit, read once (markers are immutable)
        moved = _normal_root(token["root"]) != self._ledger.root
        run = self._check_run(token, moved)
        phase = None
        if run is not None:
            # Before the generic config check: e.g. name the first shard that changed.
            logged = run["config"]
            self._pipeline.check_logged(logged)
            phase = self._phase(token, moved, logged, new_phase)
        self._ledger.enter_phase(phase)
        self._pipeline.enter_phase(phase)
        try:
            run_id = self._ledger.open(self.config, run)
        except ConfigMismatch as e:
            if e.field == "seed" and self._seed_from_torch:
                raise ConfigMismatch(
                    "seed", e.expected, e.found,
                    "This loader took its seed from torch.initial_seed() (no seed= was "
                    f"given): pass seed={e.expected!r}, or call torch.manual_seed("
                    f"{e.expected!r}) before building the loader, as the logged run did.",
                ) from e  # fmt: skip
            raise
        if token["run_id"] != run_id:  # a run created since _check_run (a racing writer)
            raise WrongRoot(f"{self._ledger.root} holds run {run_id}, not the token's")
        self._unconfirmed = False
        if token["commit"] == "":
            head = None
            state = self._pipeline.initial_state()
        else:
            head = self._read_token_commit(token, moved)
            state, self._resume_events = self._pipeline.replay(self._ledger.store, head)
            # The newest segment's SHA-256 may still be being checked (confirm_replay):
            # it overlaps with the first batch's fetch and is joined before the batch.
            self._unconfirmed = True
        if self._verify_data and head is not None:
            self._check_last_batch(head, state)
        self._state = state
        self._torn = None
        self._resume_from = head
        # Ranges planned in the lineage and not reached at the commit stay planned.
        self._planned = sorted(head.planned_skips) if head is not None else []
        self._ledger.planned_skips = tuple(self._planned)
        if head is not None:
            old_workers = len(head.states[0].workers) if head.states else 0
            new_workers = self._pipeline.workers
            if head.world_size != self._world_size or old_workers != new_workers:
                logger.info(
                    "elastic resume of %s at commit %s: world size %d -> %d, "
                    "logical workers per rank %d -> %d",
                    self._ledger.root,
                    head.id,
                    head.world_size,
                    self._world_size,
                    old_workers,
                    new_workers,
                )
        logger.info(
            "rank %d resumed %s from commit %s: epoch %d, batch %d",
            self._rank,
            self._ledger.root,
            head.id if head is not None else "(start)",
            state.epoch,
            state.batch,
        )
        self._generation += 1  # a live iterator must not keep producing the old stream
        self._iter_epoch = None
        if self._ledger.attempt is not None:
            self._start_attempt()
        if skip_batches:
            self.skip(skip_batches, reason=reason)
        if skip_steps is not None:
            self.skip(steps=skip_steps, reason=reason)

    def _phase(
        self, token: dict[str, Any], moved: bool, logged: dict[str, Any], new_phase: bool
    ) -> dict[str, Any] | None:
        """The phase the resumed attempt serves: the token commit's, or with ``new_phase``
        a new one after it (:meth:`ledger.pipeline.Pipeline.new_phase`)."""
        if token["commit"] == "":
            if new_phase:
                raise ValueError("new_phase=True needs a token of a commit (the run has none)")
            return None
        try:
            head = self._read_token_commit(token, moved)
        except LedgerError:
            if new_phase:
                raise
            return None  # the resume below raises the error in its turn
        current = phase_of(self._ledger.store, head)
        if not new_phase:
            return current
        phase = self._pipeline.new_phase(self._ledger.store, head, current, logged)
        logger.info(
            "rank %d starts phase %d of %s after commit %s",
            self._rank, phase["number"], self._ledger.root, head.id,
        )  # fmt: skip
        return phase

    def _check_run(self, token: dict[str, Any], moved: bool) -> dict[str, Any] | None:
        """Refuse a token of another run, before anything is written to this root; return
        the root's ``run.json`` (``None``: the root holds no run yet).

        A token written to another root resumes here when this root holds its run: a log
        copied, mounted at another path or moved to another bucket keeps its run id and
        commit chain (the commit is checked by :meth:`_read_token_commit`).

        Raises:
            WrongRoot: if this root holds another run, or (moved) no run.
        """
        run = find_run(self._ledger.store)
        here = run["run_id"] if run is not None else None
        if here == token["run_id"] or (here is None and not moved):
            return run
        if not moved:
            raise WrongRoot(
                f"the token belongs to run {token['run_id']}, but {self._ledger.root} holds "
                f"run {here}: the root was recreated; resume from a checkpoint of run {here}"
            )
        holds = f"holds run {here}" if here else "holds no run"
        raise WrongRoot(
            f"the token was written to log root {token['root']!r} (run {token['run_id']}), "
            f"this loader logs to {self._ledger.root!r}, which {holds}: pass "
            f"log={token['root']!r}, or a copy of that log, to resume that run"
        )

    def _read_token_commit(self, token: dict[str, Any], moved: bool) -> Commit:
        """The token's commit, checked against the token's step and attempt.

        Raises:
            CommitNotFound: if the token's own root lacks the commit.
            WrongRoot: if a moved log lacks it or holds another commit under its id.
        """
        cached = self._token_commits.get(token["commit"])
        if cached is not None:
            return cached
        try:
            head = self._ledger.read_commit(token["commit"])
        except CommitNotFound as e:
            if not moved:
                raise
            raise WrongRoot(
                f"{self._ledger.root} holds run {token['run_id']} but not its commit "
                f"{token['commit']} (the token was written to {token['root']!r}): the "
                "copy predates the checkpoint; copy the log again, or resume from an "
                "older checkpoint"
            ) from e
        if (head.step, head.attempt) != (token["step"], token["attempt"]):
            raise WrongRoot(
                f"commit {head.id} of {self._ledger.root} is at step {head.step} of attempt "
                f"{head.attempt}, the token says step {token['step']} of attempt "
                f"{token['attempt']}: the token is not of this log"
            )
        self._token_commits[token["commit"]] = head
        return head

    def _check_last_batch(self, head: Commit, state: PipelineState) -> None:
        """Re-create this rank's last committed batch and compare its digest (``verify_data``).

        Raises:
            ConfigMismatch: if the re-created batch's digest differs from the recorded one.
        """
        from ledger.audit.queries import materialize

        if state.batch == 0 or head.world_size != self._world_size:
            return  # nothing of this rank committed, or batches were numbered in another shape
        try:
            made = materialize(
                self._ledger.root, state.batch - 1, self._pipeline.dataset, rank=self._rank,
                collate_fn=self._collate_fn, head=head.id,
            )  # fmt: skip
        except BatchSkipped:
            return  # skipped on purpose: no batch the model saw to compare
        except SourceMissing:
            return  # a new phase dropped a source of that batch: nothing to re-create it

        if made.record.digest is not None and not made.matches:
            raise ConfigMismatch(
                "dataset content",
                made.record.digest,
                made.digest,
                f"Batch {state.batch - 1} of rank {self._rank} (samples "
                f"{made.record.sample_ids[:8].tolist()}...) re-created from the dataset differs "
                "from the batch the model received: the data changed since it was read. Resume "
                "with the original data, or start a new run under a new log root.",
            )


def _normal_root(root: str) -> str:
    """``root`` as :attr:`ledger.store.Store.uri` writes it (local paths made absolute)."""
    if "://" in root:
        return root
    if os.sep == "/" and root.startswith("/"):
        return os.path.abspath(root)  # what Store makes of an absolute path, without fsspec
    return Store(root).uri


def _check_token(token: Any) -> dict[str, Any]:
    """``token`` if it is a ledger token of this version, with fields of the right types.

    Raises:
        TokenError: naming the field that is missing or mangled.
    """
    if not isinstance(token, dict):
        raise TokenError(f"a ledger token is a dict, got {type(token).__name__}")
    missing = [k for k in _TOKEN_KEYS if k not in token]
    if missing:
        raise TokenError(f"the token lacks {', '.join(missing)}: it is not a ledger token")
    version = token["version"]
    if not isinstance(version, int) or isinstance(version, bool) or version != TOKEN_VERSION:
        raise TokenError(
            f"token version {version!r} ({type(version).__name__}) is not supported (this "
            f"ledger reads version {TOKEN_VERSION}, an integer)"
        )
    where = "the checkpoint token"
    for key in ("root", "run_id", "commit"):
        require(token, key, str, where, error=TokenError)
    if not token["root"]:
        raise TokenError(f"{where}: field 'root' is empty")
    require(token, "attempt", int, where, minimum=-1, error=TokenError)
    require(token, "world_size", int, where, minimum=1, error=TokenError)
    require(token, "step", int, where, minimum=0, error=TokenError)
    return token


def _stopped_early(state: PipelineState) -> LedgerError:
    """The error for a ``StopIteration`` raised by the dataset or a transform on the
    training loop's thread (``num_workers=0``), where Python turns it into a
    ``RuntimeError`` (PEP 479); with workers, torch ends the iteration and
    ``Pipeline.finish`` says the same."""
    return LedgerError(
        f"loading batch {state.epoch_batch} of epoch {state.epoch} raised StopIteration "
        "(the dataset's __getitem__ or a transform; a StopIteration would end the epoch "
        "short without a word): raise another exception (IndexError, ValueError) for a "
        "sample it cannot load"
    )


__all__: Sequence[str] = ["DataLoader"]
