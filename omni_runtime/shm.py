"""Shared-memory transfer of large arrays between the orchestrator and stage processes (``ipc`` only).

Arrays of at least :data:`SHM_MIN_BYTES` leave a process through a :class:`ShmPool` owned by the
process that sends them (the *producer*: each stage replica for its outputs, the orchestrator for
stage inputs). Only a small :class:`ShmHandle` (segment name, offset, nbytes, generation, dtype,
shape) travels in the msgpack message.

Segments and slots
    A pool creates POSIX shared-memory segments once and recycles them; one segment holds one
    array at a time. Word 0 of each segment's 64-byte header is the slot state,
    ``generation << 1 | busy``. The producer claims a free segment by writing ``(gen + 1) << 1 | 1``
    and copies the array in; the consumer copies it out and writes ``gen << 1`` (busy bit clear).
    The producer learns a slot is free by reading that word when it next allocates: no release
    message, no round trip, and a release can come from any process that knows the handle. The
    generation makes a release idempotent and safe against staleness: a release writes only if
    the word still reads ``gen << 1 | 1``, so a late or repeated release of a recycled slot does
    nothing. (Only bit 0 changes on release, and the consumer's reads of the data come before its
    release store: x86 never reorders a store before earlier loads, and numpy drops and retakes
    the GIL around a large copy, which is a release/acquire pair on weaker CPUs.)

Who releases a handle (exactly one party)
    1. A stage worker maps every handle as it decodes a message: the runner gets a numpy array or
       tensor that *is* the producer's slot (no copy), and the slot is released when the last
       reference to that memory is dropped, normally when the wave that used it is done (a
       per-array buffer exporter carries a ``weakref.finalize``; every view, reshape or
       ``torch.from_numpy`` of the array keeps it alive). A runner that keeps inputs past its wave
       pins their slots: the producer's pool then grows up to its cap and later arrays travel as
       frames, so this degrades throughput, never correctness.
    2. The orchestrator decodes a stage's outputs into :class:`ShmRef`\\ s: mapped, not copied.
       A ref is either *materialized* by the orchestrator (copied out, then released: outputs
       delivered to the caller, fan-out to several stages, custom input functions, in-process or
       tcp stages), or *handed off* unchanged to the one downstream stage that consumes it, whose
       decode releases it (rule 1). A ref that is dropped without either (an aborted or failed
       request) is released when it is garbage-collected.
    3. The sender of a message remembers the handles it put in it (its own and handed-off refs)
       until it sees them released; if the receiving replica dies first, the sender releases
       them itself. The receiver is dead, so nobody races it.

Nothing outlives the engine
    Names are deterministic: ``omni_rt-<pid>-<token>-<producer>-<n>``, where ``<producer>`` is
    ``o`` for the orchestrator or ``s<stage>r<replica>g<restart>`` for a stage replica. Each
    producer unlinks its segments when it closes. The orchestrator also unlinks a replica's
    segments by name prefix once that process has exited (a crash included), everything under its
    own engine prefix when the engine closes, and, at start, segments of engines whose process no
    longer exists (a SIGKILLed parent). Mappings that other processes still hold stay valid after
    an unlink: memory goes back when the last mapping does.

``multiprocessing.shared_memory`` is not used: on Python 3.11 it registers every attach with the
resource tracker, which then unlinks or warns about segments it does not own (see FEASIBILITY
pitfall 7). The segments here are plain ``shm_open`` + ``mmap``, and their lifetime is the
protocol above.
"""

from __future__ import annotations

import _posixshmem
import ctypes
import errno
import logging
import mmap
import os
import re
import secrets
import struct
import threading
import weakref
from collections import OrderedDict
from typing import Any, NamedTuple

import msgspec
import numpy as np

logger = logging.getLogger(__name__)

#: Arrays of at least this many bytes go through shared memory (smaller ones as raw frames).
SHM_MIN_BYTES = 64 * 1024
#: Bytes of segments one producer may hold; past it (all busy) arrays travel as raw frames.
POOL_MAX_BYTES = 1 << 30
#: Segments one producer may hold.
POOL_MAX_SEGMENTS = 64
#: Smallest segment: small arrays share no segment, so this bounds the waste per slot.
MIN_SEGMENT_BYTES = 1 << 20
#: Segments another producer's segments a process keeps mapped (a cache; unlinked ones are dropped).
MAX_ATTACHED = 256

HEADER_BYTES = 64
NAME_ROOT = "omni_rt"
_DEV_SHM = "/dev/shm"
_WORD = struct.Struct("Q")  # native: one aligned 8-byte store, not byte by byte
_ENGINE_RE = re.compile(rf"^{NAME_ROOT}-(\d+)-")


class ShmHandle(NamedTuple):
    """What travels in the message instead of the array."""

    name: str
    offset: int
    nbytes: int
    gen: int
    dtype: str  # numpy dtype string, or "bfloat16" (shipped as int16 bits)
    shape: tuple[int, ...]
    is_torch: bool


class ShmLostError(msgspec.DecodeError):
    """A message referred to shared memory that is gone (its producer died and it was unlinked).

    ``message`` is the rest of the decoded message, so the receiver can fail that one request.
    """

    def __init__(self, detail: str, message: Any = None) -> None:
        super().__init__(detail)
        self.message = message


# --------------------------------------------------------------------------- segments


class Segment:
    """One mapped shared-memory object. Word 0 of the header is the slot state."""

    __slots__ = ("__weakref__", "fd", "mm", "name", "size")

    def __init__(self, name: str, fd: int, size: int) -> None:
        self.name = name
        self.fd = fd
        self.size = size
        try:
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            # Reserve the pages now: writing into a sparse segment on a full /dev/shm is a SIGBUS.
            os.posix_fallocate(fd, 0, size)
        except BaseException:
            os.close(fd)
            _unlink(name)
            raise
        return cls(name, fd, size)

    @classmethod
    def attach(cls, name: str) -> Segment:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, size)

    @property
    def state(self) -> int:
        return _WORD.unpack_from(self.mm, 0)[0]

    @state.setter
    def state(self, value: int) -> None:
        _WORD.pack_into(self.mm, 0, value)

    @property
    def capacity(self) -> int:
        return self.size - HEADER_BYTES

    def unlinked(self) -> bool:
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True

    def close(self) -> None:
        if self.fd >= 0:
            try:
                self.mm.close()
            except BufferError:  # a view is still alive; the mapping goes when it does
                pass
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1


def _unlink(name: str) -> bool:
    try:
        _posixshmem.shm_unlink("/" + name)
        return True
    except FileNotFoundError:
        return False


# --------------------------------------------------------------------------- this process's mappings

_attached: OrderedDict[str, Segment] = OrderedDict()
_attached_lock = threading.Lock()


def attach(name: str) -> Segment:
    """This process's mapping of ``name`` (cached); FileNotFoundError once it is unlinked."""
    with _attached_lock:
        seg = _attached.get(name)
        if seg is not None:
            _attached.move_to_end(name)
            return seg
    seg = Segment.attach(name)
    with _attached_lock:
        # Forget mappings of unlinked segments (a producer evicted or closed them): their memory
        # goes back once no ShmRef holds them either.
        for stale in [n for n, s in _attached.items() if s.unlinked()]:
            del _attached[stale]
        while len(_attached) >= MAX_ATTACHED:
            _attached.popitem(last=False)
        _attached[name] = seg
    return seg


def _busy(gen: int) -> int:
    return gen << 1 | 1


def release(handle: ShmHandle) -> bool:
    """Give a slot back to its producer; a no-op (False) if it is already free or recycled."""
    try:
        seg = attach(handle.name)
    except FileNotFoundError:
        return False
    if seg.state != _busy(handle.gen):
        return False
    seg.state = handle.gen << 1
    return True


def pending(handle: ShmHandle) -> bool:
    """True while the slot still holds this handle's array (nobody released it yet)."""
    try:
        return attach(handle.name).state == _busy(handle.gen)
    except FileNotFoundError:
        return False


def _np_dtype(dtype: str) -> np.dtype:
    return np.dtype(np.int16) if dtype == "bfloat16" else np.dtype(dtype)


def to_value(arr: np.ndarray, dtype: str, is_torch: bool) -> Any:
    """A numpy array as what the sender had: a numpy array or a torch tensor (sharing its memory)."""
    if not is_torch:
        return arr
    import torch

    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def _attach_for(handle: ShmHandle) -> Segment:
    try:
        return attach(handle.name)
    except FileNotFoundError:
        raise ShmLostError(f"shared-memory segment {handle.name} is gone (its stage died)") from None


def _check(seg: Segment, h: ShmHandle) -> np.dtype:
    """The handle's numpy dtype, once it is known to name a live array that fits its segment."""
    if seg.state != _busy(h.gen):
        raise ShmLostError(f"shared-memory array {h.name}@{h.gen} was already released")
    dtype = _np_dtype(h.dtype)
    if h.offset + h.nbytes > seg.size or int(np.prod(h.shape, dtype=np.int64)) * dtype.itemsize != h.nbytes:
        raise ShmLostError(f"shared-memory handle {h.name} does not fit its segment")
    return dtype


def _copy_out(seg: Segment, h: ShmHandle) -> Any:
    dtype = _check(seg, h)
    src = np.ndarray(h.shape, dtype, buffer=seg.mm, offset=h.offset)
    out = np.empty(h.shape, dtype)
    np.copyto(out, src)
    del src
    _release_slot(seg, h.gen)
    return to_value(out, h.dtype, h.is_torch)


def read(handle: ShmHandle) -> Any:
    """Copy the array out and release its slot at once."""
    return _copy_out(_attach_for(handle), handle)


def map_array(handle: ShmHandle) -> Any:
    """The array in its slot, without a copy; the slot is released once nothing refers to it (rule 1)."""
    seg = _attach_for(handle)
    dtype = _check(seg, handle)
    # One exporter per array: numpy keeps it as the array's base (and views keep the array), so
    # it dies exactly when the last alias of this memory does. It also keeps the mapping alive.
    exporter = (ctypes.c_char * handle.nbytes).from_buffer(seg.mm, handle.offset)
    weakref.finalize(exporter, _release_slot, seg, handle.gen).atexit = False
    # A ctypes array is a buffer; numpy's stubs accept only a fixed list of buffer types on 3.11.
    arr = np.frombuffer(exporter, dtype=dtype).reshape(handle.shape)  # type: ignore[call-overload]
    return to_value(arr, handle.dtype, handle.is_torch)


def _release_slot(seg: Segment, gen: int) -> None:
    try:
        if seg.state == _busy(gen):
            seg.state = gen << 1
    except ValueError:  # the mapping was closed (interpreter exit): nothing left to free
        pass


class ShmRef:
    """An array still in a producer's slot, held by the orchestrator (see rule 2).

    Exactly one of :meth:`take` (copy out and release), :meth:`hand_off` (the receiver releases)
    or :meth:`release` happens; a ref garbage-collected before any of them releases its slot.
    """

    __slots__ = ("_owned", "_segment", "handle")

    def __init__(self, handle: ShmHandle, segment: Segment) -> None:
        self.handle = handle
        self._segment = segment  # keeps the mapping valid even after the producer unlinks it
        self._owned = True

    @property
    def shape(self) -> tuple[int, ...]:
        return self.handle.shape

    @property
    def nbytes(self) -> int:
        return self.handle.nbytes

    def can_hand_off(self) -> bool:
        # An unlinked segment (its producer died) cannot be attached by anyone else.
        return self._owned and not self._segment.unlinked()

    def hand_off(self) -> ShmHandle:
        if not self._owned:
            raise RuntimeError(f"shared-memory array {self.handle.name} was already handed off or taken")
        self._owned = False
        return self.handle

    def take(self) -> Any:
        if not self._owned:
            raise RuntimeError(f"shared-memory array {self.handle.name} was already handed off or taken")
        self._owned = False
        return _copy_out(self._segment, self.handle)

    def release(self) -> None:
        if self._owned:
            self._owned = False
            _release_slot(self._segment, self.handle.gen)

    def __del__(self) -> None:
        self.release()

    def __repr__(self) -> str:
        h = self.handle
        return f"ShmRef({h.name}@{h.gen}, {h.dtype}{list(h.shape)})"


def materialize(obj: Any) -> Any:
    """``obj`` with every ShmRef inside (dicts, lists, tuples, msgspec Structs) copied out."""
    if isinstance(obj, ShmRef):
        return obj.take()
    if isinstance(obj, dict):
        if not any(_holds_ref(v) for v in obj.values()):
            return obj
        return {k: materialize(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        if not any(_holds_ref(v) for v in obj):
            return obj
        return type(obj)(materialize(v) for v in obj)
    if isinstance(obj, msgspec.Struct):
        changes = {f: materialize(getattr(obj, f)) for f in obj.__struct_fields__ if _holds_ref(getattr(obj, f))}
        return msgspec.structs.replace(obj, **changes) if changes else obj
    return obj


def _holds_ref(obj: Any) -> bool:
    if isinstance(obj, ShmRef):
        return True
    if isinstance(obj, dict):
        return any(_holds_ref(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_holds_ref(v) for v in obj)
    if isinstance(obj, msgspec.Struct):
        return any(_holds_ref(getattr(obj, f)) for f in obj.__struct_fields__)
    return False


# --------------------------------------------------------------------------- the producer's pool


class ShmPool:
    """A producer's recycled segments. Used from one thread only (the sender's).

    Its mappings are its own: a release from this same process (a sender giving back what a dead
    receiver never read) goes through :func:`attach` like any other, so closing the pool never
    invalidates a :class:`ShmRef` or a cached mapping.
    """

    def __init__(self, prefix: str, *, max_bytes: int = POOL_MAX_BYTES, max_segments: int = POOL_MAX_SEGMENTS) -> None:
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.max_segments = max_segments
        self._segments: list[Segment] = []
        self._bytes = 0
        self._next = 0
        self._closed = False
        self.fallbacks = 0  # arrays that went as raw frames because the pool was full

    def put(self, arr: np.ndarray, dtype: str, is_torch: bool) -> ShmHandle | None:
        """Copy a contiguous array into a free slot; None when none can be had (send a frame)."""
        if self._closed:
            return None
        nbytes = arr.nbytes
        seg = self._free_fit(nbytes) or self._grow(nbytes)
        if seg is None:
            self.fallbacks += 1
            return None
        gen = (seg.state >> 1) + 1
        seg.state = _busy(gen)
        dst = np.ndarray(arr.shape, arr.dtype, buffer=seg.mm, offset=HEADER_BYTES)
        np.copyto(dst, arr, casting="no")
        del dst
        return ShmHandle(seg.name, HEADER_BYTES, nbytes, gen, dtype, tuple(arr.shape), is_torch)

    def _free_fit(self, nbytes: int) -> Segment | None:
        best = None
        for seg in self._segments:
            if seg.capacity >= nbytes and not seg.state & 1 and (best is None or seg.capacity < best.capacity):
                best = seg
        return best

    def _grow(self, nbytes: int) -> Segment | None:
        capacity = max(MIN_SEGMENT_BYTES, 1 << max(0, nbytes - 1).bit_length())
        size = capacity + HEADER_BYTES
        if size > self.max_bytes:
            return None
        # Make room under the caps by dropping free segments that are too small, smallest first.
        while len(self._segments) >= self.max_segments or self._bytes + size > self.max_bytes:
            free = [s for s in self._segments if not s.state & 1]
            if not free:
                return None
            self._drop(min(free, key=lambda s: s.capacity))
        name = f"{self.prefix}-{self._next}"
        self._next += 1
        try:
            seg = Segment.create(name, size)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EEXIST):
                raise
            logger.warning("shared memory: cannot create %d bytes (%s); sending as a frame", size, e)
            return None
        self._segments.append(seg)
        self._bytes += size
        return seg

    def _drop(self, seg: Segment) -> None:
        self._segments.remove(seg)
        self._bytes -= seg.size
        _unlink(seg.name)
        seg.close()

    def stats(self) -> dict[str, int]:
        busy = sum(1 for s in self._segments if s.state & 1)
        return {"segments": len(self._segments), "bytes": self._bytes, "busy": busy, "fallbacks": self.fallbacks}

    def close(self) -> None:
        """Unlink every segment (consumers' existing mappings stay valid until they drop them)."""
        self._closed = True
        for seg in list(self._segments):
            self._drop(seg)
        unlink_prefix(self.prefix + "-")


# --------------------------------------------------------------------------- names and sweeping


def engine_prefix() -> str:
    """A fresh prefix for one engine's segments: the pid lets a later engine sweep a dead one's."""
    return f"{NAME_ROOT}-{os.getpid()}-{secrets.token_hex(4)}"


def replica_prefix(engine: str, stage_id: int, replica_id: int, generation: int) -> str:
    return f"{engine}-s{stage_id}r{replica_id}g{generation}"


def orchestrator_prefix(engine: str) -> str:
    return f"{engine}-o"


def segment_names(prefix: str) -> list[str]:
    try:
        return [n for n in os.listdir(_DEV_SHM) if n.startswith(prefix)]
    except FileNotFoundError:
        return []


def unlink_prefix(prefix: str) -> int:
    """Unlink every segment whose name starts with ``prefix``; how many there were."""
    count = 0
    for name in segment_names(prefix):
        count += _unlink(name)
    return count


def sweep_dead_engines() -> int:
    """Unlink segments left by engines whose process is gone (killed before it could clean up)."""
    count = 0
    for name in segment_names(NAME_ROOT + "-"):
        m = _ENGINE_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            count += _unlink(name)
    if count:
        logger.info("shared memory: removed %d segments of engines that no longer run", count)
    return count


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
