"""Seeded epoch orders, batch plans and per-sample seeds.

Everything here is a pure function of ``(seed, epoch, ...)``, so any part of any epoch's
order can be recomputed without replaying history.

The epoch order is a keyed pseudo-random permutation of ``[0, N)`` evaluated per
position, never materialised:

* a Feistel network on ``k = ceil(log2 N)`` bits with alternating half widths
  ``u = floor(k/2)`` and ``v = k - u``, adding the round function modulo ``2**width``
  (the round structure of FF1, NIST SP 800-38G, section 5.1), so the network is a
  bijection of ``[0, 2**k)`` for any round function;
* *cycle walking* (Black & Rogaway, "Ciphers with Arbitrary Finite Domains",
  CT-RSA 2002): a value that lands in ``[N, 2**k)`` is encrypted again until it lands
  in ``[0, N)``, which restricts the bijection to ``[0, N)``. Because ``2**k < 2N``
  the expected number of walks is below 2;
* the round function is the SplitMix64 finaliser (Steele, Lea & Flood, "Fast
  splittable pseudorandom number generators", OOPSLA 2014) of the right half xor a
  round key derived from ``(seed, epoch, round)``.

Memory is O(batch) and every step is a numpy vector operation over ``uint64``, so the
order works for N up to 2**62 (N = 10**10 included).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import random
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
ROUNDS = 6
_TABLE_BITS = 16  # round functions of halves up to this width are tabulated (512 KiB)


def _mix_scalar(z: int) -> int:
    """SplitMix64 finaliser on a Python int (64-bit wrap-around)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a ``uint64`` array (wraps modulo 2**64, in place on a copy)."""
    z = z ^ (z >> np.uint64(30))
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def derive_key(*parts: int) -> int:
    """Hash integers into one 64-bit key: ``mix(... mix(mix(p0) + p1) ...)``.

    Args:
        parts: any Python ints (taken modulo 2**64).

    Returns:
        An int in ``[0, 2**64)``.
    """
    h = 0x6A09E667F3BCC908  # fractional part of sqrt(2): a fixed, documented start
    for p in parts:
        h = _mix_scalar((h + _GOLDEN + (p & _M64)) & _M64)
    return h


def _tabulated_rounds(
    a: np.ndarray, b: np.ndarray, tables: list[np.ndarray], u: int, v: int, inverse: bool
) -> np.ndarray:
    """:meth:`EpochOrder._rounds` with round functions from tables: ``a`` (``u`` bits) and
    ``b`` (``v`` bits) as ``int64``, below ``2**16``, so numpy gathers with them as an index
    without a cast. Returns the ``uint64`` result."""
    masks = [(1 << u) - 1, (1 << v) - 1]
    if not inverse:
        for i in range(ROUNDS):
            c = a + tables[i][b]
            c &= masks[i % 2]
            a, b = b, c
    else:
        for i in reversed(range(ROUNDS)):
            prev_a = b - tables[i][a]
            prev_a &= masks[i % 2]
            a, b = prev_a, a
    a <<= v
    a |= b
    return a.view(np.uint64)


@dataclass(frozen=True, slots=True)
class EpochOrder:
    """The order of one epoch: a bijection ``position -> sample id`` on ``[0, n)``.

    Args:
        n: dataset length N (samples), ``0 <= n < 2**62``.
        seed: the run's seed (any int).
        epoch: the epoch number (int >= 0).
        shuffle: ``False`` gives the identity order.

    Raises:
        ValueError: if ``n`` is negative or too large.
    """

    n: int
    seed: int
    epoch: int
    shuffle: bool = True
    _keys: tuple[np.uint64, ...] = field(init=False, repr=False, compare=False)
    _tables: list[np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.n < (1 << 62):
            raise ValueError(f"dataset length must be in [0, 2**62), got {self.n}")
        keys = tuple(np.uint64(derive_key(self.seed, self.epoch, r, 0x0DE7)) for r in range(ROUNDS))
        object.__setattr__(self, "_keys", keys)
        object.__setattr__(self, "_tables", [])

    @property
    def _bits(self) -> int:
        return max(2, (self.n - 1).bit_length())

    def _check(self, values: np.ndarray | int, what: str) -> np.ndarray:
        arr = np.atleast_1d(np.asarray(values))
        if arr.size and (arr.min() < 0 or arr.max() >= self.n):
            bad = arr[(arr < 0) | (arr >= self.n)][0]
            raise IndexError(f"{what} {int(bad)} is outside [0, {self.n})")
        return arr.astype(np.uint64, copy=True)

    def _round_tables(self, calls: int) -> list[np.ndarray]:
        """Round ``i``'s function as a table over its input, ``mix(b ^ key_i) mod 2**m``
        for every ``b`` of the half's width (``[]`` until a call evaluates as many
        values as a table holds, which bounds building them by that call's cost).

        A round then costs one gather instead of the finaliser's ten array passes: the
        same values (the addition is modulo ``2**m`` either way), ~3x less per position.
        """
        tables = self._tables
        if tables:
            return tables
        k = self._bits
        u = k // 2
        v = k - u
        if calls < (1 << v) or v > _TABLE_BITS:
            return tables
        domains = [np.arange(1 << v, dtype=np.uint64), np.arange(1 << u, dtype=np.uint64)]
        widths = [u, v]
        built = []
        for i, key in enumerate(self._keys):
            # Round i reads the half of width widths[1 - i % 2] and adds modulo widths[i % 2].
            table = _mix(domains[i % 2] ^ key) & np.uint64((1 << widths[i % 2]) - 1)
            built.append(table.view(np.int64))
        tables.extend(built)  # all at once: a reader sees no table or all of them
        return tables

    def _rounds(self, x: np.ndarray, keys: tuple[np.uint64, ...], inverse: bool) -> np.ndarray:
        k = self._bits
        u = k // 2
        v = k - u
        a = x >> np.uint64(v)  # u bits
        b = x & np.uint64((1 << v) - 1)  # v bits
        tables = self._round_tables(x.size)
        if tables:
            return _tabulated_rounds(a.view(np.int64), b.view(np.int64), tables, u, v, inverse)
        if not inverse:
            # Round i: A (width m) and B swap roles; C = (A + F(B)) mod 2**m.
            widths = [u, v]
            for i in range(ROUNDS):
                m = widths[i % 2]
                c = (a + _mix(b ^ keys[i])) & np.uint64((1 << m) - 1)
                a, b = b, c
        else:
            widths = [u, v]
            for i in reversed(range(ROUNDS)):
                m = widths[i % 2]
                prev_a = (b - _mix(a ^ keys[i])) & np.uint64((1 << m) - 1)
                a, b = prev_a, a
        # With an even number of rounds A has u bits again and B has v bits.
        return (a << np.uint64(v)) | b

    def _walk(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        keys = self._keys
        y = self._rounds(x, keys, inverse)
        out = y >= np.uint64(self.n)
        while out.any():
            idx = np.flatnonzero(out)
            y[idx] = self._rounds(y[idx], keys, inverse)
            out[idx] = y[idx] >= np.uint64(self.n)
        return y

    def sample_ids(self, positions: np.ndarray | int) -> np.ndarray:
        """Map positions of this epoch to sample ids.

        Args:
            positions: int array (any shape) of positions in ``[0, n)``.

        Returns:
            ``int64`` array of the same shape: the sample id at each position.

        Raises:
            IndexError: if a position is outside ``[0, n)``.
        """
        x = self._check(positions, "position")
        if self.shuffle and self.n > 1:
            x = self._walk(x, inverse=False)
        return x.astype(np.int64).reshape(np.shape(positions))

    def positions(self, sample_ids: np.ndarray | int) -> np.ndarray:
        """Inverse of :meth:`sample_ids`: where each sample id sits in this epoch.

        Args:
            sample_ids: int array (any shape) of ids in ``[0, n)``.

        Returns:
            ``int64`` array of the same shape.

        Raises:
            IndexError: if an id is outside ``[0, n)``.
        """
        y = self._check(sample_ids, "sample id")
        if self.shuffle and self.n > 1:
            y = self._walk(y, inverse=True)
        return y.astype(np.int64).reshape(np.shape(sample_ids))

    def range(self, start: int, stop: int) -> np.ndarray:
        """Sample ids at positions ``[start, stop)`` as an ``int64`` array."""
        return self.sample_ids(np.arange(start, stop, dtype=np.int64))


SEED_MASK = (1 << 63) - 1
"""Seeds handed to RNGs are below ``2**63``: ``torch.initial_seed()`` then fits an
``int64``, so a dataset that returns it collates (``default_collate`` would overflow)."""


def sample_seeds(seed: int, epoch: int, sample_ids: np.ndarray) -> np.ndarray:
    """Per-sample RNG seeds ``f(seed, epoch, sample id)``, in ``[0, 2**63)``.

    They do not depend on which worker or rank loads the sample, nor on the batch.

    Args:
        seed: the run's seed.
        epoch: the epoch.
        sample_ids: ``int64`` array of sample ids.

    Returns:
        ``uint64`` array of seeds, same shape as ``sample_ids``.
    """
    key = np.uint64(derive_key(seed, epoch, 0x5EED))
    return _mix(np.asarray(sample_ids).astype(np.uint64) ^ key) & np.uint64(SEED_MASK)


@functools.lru_cache(maxsize=64)
def _sample_key(seed: int, epoch: int) -> int:
    return derive_key(seed, epoch, 0x5EED)


def sample_seed(seed: int, epoch: int, sample_id: int) -> int:
    """One sample's seed: :func:`sample_seeds` for a single id, without numpy (~1 µs)."""
    return _mix_scalar((sample_id & _M64) ^ _sample_key(seed, epoch)) & SEED_MASK


def batch_seed(seed: int, epoch: int, position: int) -> int:
    """The RNG seed of the batch whose first sample sits at ``position`` of ``epoch``.

    Batches are fixed by the plan (positions, not workers), so the seed does not depend
    on the number of workers nor on which one loads the batch.

    Returns:
        An int in ``[0, 2**63)``.
    """
    h = _epoch_prefix(seed, epoch)
    for p in (position, 0xBA7C):
        h = _mix_scalar((h + _GOLDEN + (p & _M64)) & _M64)
    return h & SEED_MASK  # = derive_key(seed, epoch, position, 0xBA7C) & SEED_MASK


def batch_seeds(seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
    """:func:`batch_seed` of many batches at once (the batch plan's starts, a chunk of
    batches at a time): ``uint64`` seeds in ``[0, 2**63)``, one per position.

    Args:
        seed: the run's seed.
        epoch: the epoch.
        positions: ``int64`` array of the batches' first positions (``>= 0``).
    """
    h = np.uint64((_epoch_prefix(seed, epoch) + _GOLDEN) & _M64)
    z = _mix(positions.astype(np.uint64) + h)
    z = _mix(z + np.uint64((_GOLDEN + 0xBA7C) & _M64))
    z &= np.uint64(SEED_MASK)
    return z


@functools.lru_cache(maxsize=64)
def _epoch_prefix(seed: int, epoch: int) -> int:
    """``derive_key(seed, epoch)``: the hash state every batch seed of an epoch starts from."""
    return derive_key(seed, epoch)


def seed_globals(seed: int) -> None:
    """Seed torch's default generator, numpy's global ``RandomState`` (low 32 bits) and
    ``random`` with one seed, before a sample or a batch is loaded.

    ``torch.default_generator.manual_seed`` rather than ``torch.manual_seed``: the latter
    also visits every accelerator backend and costs ~100x more per call.

    Args:
        seed: a seed from :func:`sample_seeds` or :func:`batch_seed` (int in
            ``[0, 2**63)``).
    """
    torch.default_generator.manual_seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    random.seed(seed)


def _memory(address: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes at ``address`` (the owner must outlive it).

    Copying through a view (``bytes(view)``, ``view[:] = saved``) costs a third to a fifth of
    a ``ctypes.string_at``/``memmove`` call, which matters once per batch.
    """
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class _NumpyState:
    """Save and restore numpy's global MT19937 state through numpy's public ctypes
    interface (``BitGenerator.ctypes.state_address``): one ``memmove`` of 2.5 KB instead
    of ``np.random.get_state``/``set_state``, which copy the key one element at a time
    (~170 µs the pair, measured on numpy 2.4).

    Legacy ``np.random.normal`` caches the second variate of each pair in the
    ``RandomState`` object (``has_gauss``, ``gauss``), outside the bit generator. Where
    :func:`_gauss_address` finds those two fields (numpy's ``aug_bitgen_t``; checked
    against ``get_state()``), they are saved and restored too, so the state round-trips
    exactly; elsewhere a restore drops the cached variate (the next normal draw starts a
    fresh pair) and the training loop's numpy stream stays a deterministic function of
    its own seed.
    """

    def __init__(self) -> None:
        generator = np.random.mtrand._rand
        bitgen = generator._bit_generator
        self._owner = bitgen  # the address lives as long as this object
        self._generator = generator
        # mt19937_state: uint32 key[624] then int pos (numpy/random/src/mt19937).
        self._key = _memory(bitgen.ctypes.state_address, 624 * 4 + ctypes.sizeof(ctypes.c_int))
        address = _gauss_address(generator)
        self._gauss = _memory(address, _GAUSS_SIZE) if address is not None else None

    def save(self) -> tuple[bytes, bytes | None]:
        return bytes(self._key), bytes(self._gauss) if self._gauss is not None else None

    def restore(self, saved: tuple[bytes, bytes | None]) -> None:
        key, gauss = saved
        if gauss is None or self._gauss is None:
            self._generator.seed(0)  # drops a cached normal variate
        else:
            self._gauss[:] = gauss
        self._key[:] = key

    def clear_gauss(self) -> None:
        """Drop the cached normal variate, leaving the generator's key where it is."""
        if self._gauss is not None:
            self._gauss[:] = _NO_GAUSS
        else:
            key = bytes(self._key)
            self._generator.seed(0)
            self._key[:] = key

    def key(self) -> bytes:
        """The generator's key and position (what a draw other than a cached normal moves)."""
        return bytes(self._key)


_GAUSS_SIZE = 16  # int has_gauss, padding, double gauss (numpy's aug_bitgen_t, 64-bit)
_NO_GAUSS = bytes(_GAUSS_SIZE)


def _gauss_address(generator: Any) -> int | None:
    """Address of ``has_gauss`` in numpy's legacy ``RandomState`` object, or ``None``.

    Found by caching a known normal variate (``get_state()`` reports it) and looking for
    its bytes in the object, 8 bytes after an ``int`` 1; then checked by clearing it
    through the address and reading ``get_state()`` again. The generator's state is put
    back whatever happens.
    """
    if platform.python_implementation() != "CPython":
        return None
    saved = generator.get_state()
    try:
        generator.seed(0x5EED)
        generator.standard_normal()
        state = generator.get_state()
        if state[3] != 1:
            return None
        size = type(generator).__basicsize__
        raw = ctypes.string_at(id(generator), size)
        target = struct.pack("=d", state[4])
        found = [
            o - 8
            for o in range(8, size - 7, 8)
            if raw[o : o + 8] == target and struct.unpack_from("=i", raw, o - 8)[0] == 1
        ]
        if len(found) != 1:
            return None
        address = id(generator) + found[0]
        ctypes.memset(address, 0, _GAUSS_SIZE)
        if generator.get_state()[3] != 0:
            return None
        return address
    except Exception:  # an unknown layout: fall back to dropping the cached variate
        return None
    finally:
        generator.set_state(saved)


_numpy_state: _NumpyState | None = None


class _RandomState:
    """Save and restore the state of the ``random`` module's generator as raw bytes.

    ``random.getstate``/``setstate`` build and parse a tuple of 625 Python ints (~25 µs
    the pair); this copies CPython's ``RandomObject`` fields after the object header
    (``int index; uint32_t state[624]``, ``Modules/_randommodule.c``) with one
    ``memmove`` each way, plus the Python-level ``gauss_next``. The layout is checked
    against ``getstate()`` when the object is created: :func:`random_state` returns
    ``None`` where it does not hold (another interpreter, another CPython layout), and
    the caller falls back to ``getstate``/``setstate``.
    """

    _SIZE = 4 + 624 * 4

    def __init__(self, generator: random.Random) -> None:
        self._owner = generator
        self._raw = _memory(id(generator) + object.__basicsize__, self._SIZE)

    def save(self) -> tuple[bytes, Any]:
        return bytes(self._raw), getattr(self._owner, "gauss_next", None)

    def key(self) -> bytes:
        """The raw ``index`` and ``state`` (what every draw moves)."""
        return bytes(self._raw)

    def restore(self, saved: tuple[bytes, Any]) -> None:
        self._raw[:] = saved[0]
        self._owner.gauss_next = saved[1]  # type: ignore[attr-defined]

    def matches(self) -> bool:
        """Whether the raw bytes decode to what ``getstate()`` says (the layout holds)."""
        raw = np.frombuffer(bytes(self._raw), np.uint32)
        version, words, _ = self._owner.getstate()
        return version == 3 and len(words) == 625 and (*raw[1:].tolist(), int(raw[0])) == words


_random_state: _RandomState | None = None
_random_checked: tuple[int, bool] | None = None  # (id of the generator, layout holds)


def random_state() -> _RandomState | None:
    """The raw-bytes saver of ``random``'s module generator, or ``None`` if its memory
    layout is not the one :class:`_RandomState` knows (checked once per generator)."""
    global _random_state, _random_checked
    generator = random._inst  # the module functions' instance
    if _random_checked is None or _random_checked[0] != id(generator):
        saver = _RandomState(generator)
        ok = platform.python_implementation() == "CPython" and saver.matches()
        _random_state, _random_checked = (saver if ok else None), (id(generator), ok)
    return _random_state


def numpy_state() -> _NumpyState:
    """The raw-bytes saver of numpy's global ``RandomState`` (made again if numpy's
    global generator was replaced)."""
    global _numpy_state
    bitgen = np.random.mtrand._rand._bit_generator
    if _numpy_state is None or _numpy_state._owner is not bitgen:
        _numpy_state = _NumpyState()
    return _numpy_state


class _TorchState:
    """Save and restore torch's default CPU generator as raw bytes: one copy of its
    Mersenne Twister and cached normal variates each way (~0.3 µs the pair) instead of
    ``get_state``/``set_state``, which build and parse a 5 KB tensor (~2.5 µs the pair,
    and more inside a training loop; once per batch at ``num_workers=0``).

    The bytes are ATen's ``CPUGeneratorImpl`` fields from ``engine_`` on
    (``ATen/CPUGeneratorImpl.h``, ``ATen/core/MT19937RNGEngine.h``): ``seed_`` (uint64),
    ``left_`` (int), ``seeded_`` (bool), ``next_`` (uint32), ``state_`` (uint32[624]),
    then ``next_float_normal_sample_`` (optional float) and
    ``next_double_normal_sample_`` (optional double). The object is found through the
    Python generator (``THPGenerator``: the object header, then the ``at::Generator``
    pointer), and the layout is checked against ``get_state``/``set_state`` when the
    saver is made (:func:`torch_state`): where it does not hold (another torch,
    interpreter or platform), ``None`` is returned and the caller uses
    ``get_state``/``set_state``. torch's generator lock is not taken: the copies run on
    the thread that seeds the generator for the dataset, which ``manual_seed`` does not
    make safe against another thread's draws either.
    """

    _ENGINE = 8 + 4 + 4 + 4 + 624 * 4 + 4  # seed_ ... state_, padded to 8 bytes
    _SIZE = _ENGINE + 8 + 16  # then the float's optional and the double's
    _SEARCH = 512  # bytes of the object searched for ``state_``

    def __init__(self, generator: torch.Generator, address: int) -> None:
        self._owner = generator
        self._address = address
        self._raw = _memory(address, self._SIZE)

    def save(self) -> bytes:
        return bytes(self._raw)

    def restore(self, saved: bytes) -> None:
        self._raw[:] = saved


_STATE_WORDS = 624
# torch's serialised CPU generator state (get_state): seed, left, seeded, next, the 624
# words as uint64, then the legacy normal fields and the float normal sample.
_SERIAL = struct.Struct("<QiiQ")
_SERIAL_NORMAL = _SERIAL.size + _STATE_WORDS * 8  # double normal_x, normal_y, normal_rho; int valid
_SERIAL_FLOAT = _SERIAL_NORMAL + 8 * 3 + 4 + 4  # float next_float_normal_sample; bool valid


def _find_torch_state(generator: torch.Generator) -> _TorchState | None:
    """The raw saver of ``generator`` if its layout is the one :class:`_TorchState`
    knows, else ``None``; the generator's state is put back whatever happens."""
    if (
        platform.python_implementation() != "CPython"
        or generator.device.type != "cpu"
        or type(generator).__basicsize__ < object.__basicsize__ + ctypes.sizeof(ctypes.c_void_p)
    ):
        return None
    impl = ctypes.c_void_p.from_address(id(generator) + object.__basicsize__).value
    if not impl:
        return None
    saved = generator.get_state()
    try:
        generator.manual_seed(0x5EED)
        torch.rand(3, generator=generator)  # moves next_ and left_ off their seeded values
        serial = generator.get_state().numpy().tobytes()
        seed, left, seeded, nxt = _SERIAL.unpack_from(serial)
        words = np.frombuffer(serial, "<u8", _STATE_WORDS, _SERIAL.size).astype("<u4").tobytes()
        head = _read_memory(impl, _TorchState._SEARCH)
        at = head.find(words[:32]) if head is not None else -1
        if at < 20 or head is None or head.find(words[:32], at + 1) >= 0:
            return None
        start = impl + at - 20
        fields = _read_memory(start, _TorchState._SIZE)
        if (
            fields is None
            or struct.unpack_from("<QiB", fields) != (seed, left, seeded)
            or struct.unpack_from("<I", fields, 16)[0] != nxt
            or fields[20 : 20 + len(words)] != words
        ):
            return None
        saver = _TorchState(generator, start)
        # The cached normal variates: set through set_state, read through the raw bytes.
        crafted = bytearray(serial)
        struct.pack_into("<d", crafted, _SERIAL_NORMAL + 8, 1.5)  # normal_y
        struct.pack_into("<i", crafted, _SERIAL_NORMAL + 24, 1)  # normal_is_valid
        struct.pack_into("<f?", crafted, _SERIAL_FLOAT, 2.5, True)
        generator.set_state(torch.frombuffer(crafted, dtype=torch.uint8).clone())
        raw = saver.save()
        engine = _TorchState._ENGINE
        if struct.unpack_from("<f?", raw, engine) != (2.5, True) or struct.unpack_from(
            "<d?", raw, engine + 8
        ) != (1.5, True):
            return None
        # A round trip through the raw bytes gives back the very next draws, cached
        # variates included, and the state get_state reports.
        before = generator.get_state()
        expected = [
            torch.randn(1, dtype=torch.float64, generator=generator),
            torch.rand(5, generator=generator),
        ]
        generator.set_state(before)
        snapshot = saver.save()
        generator.manual_seed(99)
        torch.randn(1, dtype=torch.float64, generator=generator)  # caches the double
        saver.restore(snapshot)
        if not torch.equal(generator.get_state(), before):
            return None
        drawn = [
            torch.randn(1, dtype=torch.float64, generator=generator),
            torch.rand(5, generator=generator),
        ]
        if not all(torch.equal(a, b) for a, b in zip(drawn, expected, strict=True)):
            return None
        return saver
    except Exception:  # an unknown layout: fall back to get_state/set_state
        return None
    finally:
        generator.set_state(saved)


def _read_memory(address: int, size: int) -> bytes | None:
    """``size`` bytes (at most 4096) at ``address``, or ``None`` if this process cannot
    read them: the kernel copies them into a pipe, and ``write(2)`` fails (EFAULT) on an
    unmapped address where reading it directly would crash the process (a torch whose
    objects are laid out otherwise than :class:`_TorchState` expects)."""
    r, w = os.pipe()
    try:
        try:
            written = os.write(w, (ctypes.c_char * size).from_address(address))
        except OSError:
            return None
        return os.read(r, size) if written == size else None
    finally:
        os.close(r)
        os.close(w)


_torch_state: tuple[torch.Generator, _TorchState | None] | None = None


def torch_state() -> _TorchState | None:
    """The raw-bytes saver of torch's default CPU generator, or ``None`` if its memory
    layout is not the one :class:`_TorchState` knows (checked once)."""
    global _torch_state
    generator = torch.default_generator
    if _torch_state is None or _torch_state[0] is not generator:
        _torch_state = (generator, _find_torch_state(generator))
    return _torch_state[1]


def save_torch() -> Any:
    """The state of torch's default generator, for :func:`restore_torch`."""
    saver = torch_state()
    return saver.save() if saver is not None else torch.default_generator.get_state()


def restore_torch(saved: Any) -> None:
    """Put torch's default generator back as :func:`save_torch` found it."""
    if type(saved) is bytes:
        saver = torch_state()
        assert saver is not None
        saver.restore(saved)
    else:
        torch.default_generator.set_state(saved)


class LoopStates:
    """The memory of the three global generators' states, for lazy seeding on the
    training loop's thread (``num_workers=0``, :func:`ledger.fetch.seeded_lazily`): torch's
    (:class:`_TorchState`), numpy's key and cached normal (:class:`_NumpyState`) and
    ``random``'s index and key (:class:`_RandomState`; its cached ``gauss_next`` is an
    attribute of ``rnd_owner``), as writable byte views and their bound ``tobytes``
    (a copy costs less than half of a ``bytes()`` call through the view);
    :func:`loop_states` makes it where all three layouts are known.
    """

    __slots__ = (
        "_np_owner", "_torch_owner", "gauss_words", "np_gauss", "np_key", "np_key_bytes", "rnd",
        "rnd_bytes", "rnd_owner", "torch", "torch_bytes",
    )  # fmt: skip

    def __init__(self, torch_state: _TorchState, np_state: _NumpyState, rnd: _RandomState) -> None:
        assert np_state._gauss is not None
        self.torch = torch_state._raw
        self.torch_bytes = self.torch.tobytes
        self.np_key = np_state._key
        self.np_key_bytes = self.np_key.tobytes
        self.np_gauss = np_state._gauss
        # [0]: has_gauss and its padding, [1]: the cached variate's bits; both 0 when no
        # variate is cached and none was set (np.random.set_state may set one unused)
        self.gauss_words = self.np_gauss.cast("q")
        self.rnd = rnd._raw
        self.rnd_bytes = self.rnd.tobytes
        self.rnd_owner: Any = rnd._owner  # its gauss_next is set and read
        self._np_owner = np_state._owner
        self._torch_owner = torch_state._owner


_loop_states: LoopStates | None = None


def loop_states() -> LoopStates | None:
    """The :class:`LoopStates` of the current global generators, or ``None`` where one
    of their layouts is not known (the caller then uses :func:`mark_globals` and
    :func:`save_torch`)."""
    global _loop_states
    states = _loop_states
    if (
        states is not None
        and states._np_owner is np.random.mtrand._rand._bit_generator
        and states.rnd_owner is random._inst
        and states._torch_owner is torch.default_generator
    ):
        return states
    t, n, r = torch_state(), numpy_state(), random_state()
    _loop_states = None if t is None or n._gauss is None or r is None else LoopStates(t, n, r)
    return _loop_states


class rngs_preserved:  # lower case: called like the function it replaced
    """Restore the global torch, numpy and ``random`` RNG states on exit (if ``active``).

    Seeding in the main process (``num_workers=0``) would otherwise clobber the training
    loop's RNGs (dropout, ...). The three states are copied as raw bytes
    (:class:`_TorchState`, :class:`_NumpyState`, :class:`_RandomState`). A class
    rather than ``contextlib.contextmanager``: it runs once per batch.
    """

    __slots__ = ("_active", "_saved")

    def __init__(self, active: bool = True) -> None:
        self._active = active
        self._saved: tuple[Any, GlobalMarks] | None = None

    def __enter__(self) -> None:
        if self._active:
            self._saved = (save_torch(), _marks())

    def __exit__(self, *exc: object) -> None:
        saved = self._saved
        if saved is not None:
            restore_torch(saved[0])
            restore_globals(saved[1])


GlobalMarks = tuple[_NumpyState, tuple[bytes, bytes | None], "_RandomState | None", Any]
"""numpy's and ``random``'s global states at one moment (:func:`mark_globals`)."""


def _marks() -> GlobalMarks:
    np_state = _numpy_state
    if np_state is None or np_state._owner is not np.random.mtrand._rand._bit_generator:
        np_state = numpy_state()
    saver = random_state()
    return (
        np_state,
        np_state.save(),
        saver,
        saver.save() if saver is not None else random.getstate(),
    )


def mark_globals() -> GlobalMarks:
    """Mark numpy's global ``RandomState`` and ``random``'s generator before code that may
    draw from them, and drop their cached normal variates (so that a normal draw moves
    the generator's key; nothing else does without moving it).

    :func:`drew_from_globals` then says whether the code drew, :func:`restore_globals`
    puts both generators back as they were at the mark (cached variates included where
    :class:`_NumpyState` knows numpy's layout), which is needed only if the code drew or
    the mark dropped a variate (:func:`mark_dropped`). About 2 µs.
    """
    marks = _marks()
    if marks[1][1] != _NO_GAUSS:  # a cached variate (or a layout not known: None)
        marks[0].clear_gauss()
    generator = random._inst
    if generator.gauss_next is not None:  # type: ignore[attr-defined]
        generator.gauss_next = None  # type: ignore[attr-defined]
    return marks


def mark_dropped(marks: GlobalMarks) -> bool:
    """Whether :func:`mark_globals` dropped a cached normal variate of numpy or
    ``random`` (so that only :func:`restore_globals` puts the generators back as they
    were, even when nothing drew)."""
    _, (_, gauss), saver, saved = marks
    return gauss != _NO_GAUSS or (saved[1] if saver is not None else saved[2]) is not None


def drew_from_globals(marks: GlobalMarks) -> bool:
    """Whether numpy's global ``RandomState`` or ``random``'s generator moved since
    :func:`mark_globals` (compared as raw state bytes)."""
    np_state, (key, _), saver, saved = marks
    if np_state.key() != key:
        return True
    if saver is not None:
        return bool(saver.key() != saved[0])
    return bool(random.getstate()[1] != saved[1])


def restore_globals(marks: GlobalMarks) -> None:
    """Put numpy's and ``random``'s global generators back as they were at ``marks``."""
    np_state, np_saved, saver, saved = marks
    np_state.restore(np_saved)
    if saver is not None:
        saver.restore(saved)
    else:
        random.setstate(saved)


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """How one rank cuts each epoch's global order into batches.

    Ranks take positions in a fixed pattern: global step ``s`` of an epoch covers
    positions ``[start + s*W*B, start + (s+1)*W*B)`` and rank ``r`` takes the ``r``-th
    slice of ``B``. With ``drop_last=False`` the final step is cut short and split across
    ranks as evenly as possible in rank order, never padded with duplicates. With
    synchronous data parallelism the positions consumed so far are therefore a prefix of
    the order, and a resume with another world size continues from that prefix
    (``start``).

    Args:
        n: dataset length (samples).
        batch_size: samples per batch per rank (B).
        drop_last: drop the final incomplete global step instead of serving it short.
        rank: this rank.
        world_size: number of ranks (W).
        start: position where this plan's first step begins (0 but in an epoch resumed
            with another world size).
    """

    n: int
    batch_size: int
    drop_last: bool
    rank: int = 0
    world_size: int = 1
    start: int = 0
    step_size: int = field(init=False, repr=False)
    """Positions per global step (W*B)."""
    full_steps: int = field(init=False, repr=False)
    """Global steps of an epoch in which every rank gets ``batch_size`` samples."""
    consumed_per_epoch: int = field(init=False, repr=False)
    """Positions all ranks consume in one epoch (the rest are skipped by drop_last)."""
    batches_per_epoch: int = field(init=False, repr=False)
    """Batches this rank receives in one epoch."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        # Derived once: these sit on the per-batch path.
        if not 0 <= self.start <= self.n:
            raise ValueError(f"start {self.start} is outside [0, {self.n}]")
        step = self.batch_size * self.world_size
        full = (self.n - self.start) // step
        consumed = self.start + full * step if self.drop_last else self.n
        batches = full
        if consumed > self.start + full * step:
            lo, hi = self.batch_bounds(full, _step=step, _full=full)
            batches += 1 if hi > lo else 0
        for name, value in (
            ("step_size", step),
            ("full_steps", full),
            ("consumed_per_epoch", consumed),
            ("batches_per_epoch", batches),
        ):
            object.__setattr__(self, name, value)

    def batch_bounds(self, k: int, *, _step: int = 0, _full: int = -1) -> tuple[int, int]:
        """Positions ``[start, stop)`` of this rank's ``k``-th batch of an epoch."""
        step = _step or self.step_size
        full = _full if _full >= 0 else self.full_steps
        base = self.start + k * step
        if k < full:
            start = base + self.rank * self.batch_size
            return start, start + self.batch_size
        rest = self.n - base
        chunk, extra = divmod(max(rest, 0), self.world_size)
        start = base + self.rank * chunk + min(self.rank, extra)
        return start, start + chunk + (1 if self.rank < extra else 0)

    def bounds(self, k0: int, k1: int) -> tuple[np.ndarray, np.ndarray]:
        """Starts and stops (``int64`` arrays, shape ``(k1 - k0,)``) of batches ``[k0, k1)``."""
        ks = np.arange(k0, k1, dtype=np.int64)
        starts = self.start + ks * self.step_size + self.rank * self.batch_size
        stops = starts + self.batch_size
        if k1 > self.full_steps:  # the short final step
            lo, hi = self.batch_bounds(self.full_steps)
            starts[-1], stops[-1] = lo, hi
        return starts, stops
