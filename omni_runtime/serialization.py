"""Wire encoding for stage sockets: msgpack via msgspec, arrays as raw buffers. No pickle.

A message becomes a list of frames: frame 0 is the msgpack header; every numpy array or torch
tensor of at least ``INLINE_MAX`` bytes travels as a frame of its own, sent without a copy
(``zmq`` ``copy=False``) and referenced from the header by an ``Ext`` that carries its dtype,
shape and frame index. Small arrays are inlined in the ``Ext`` itself (one frame less is cheaper
than a copy of a few bytes). The receiver rebuilds arrays with ``np.frombuffer`` over the frame's
memory: no copy on this side either.

Over ``ipc``, an encoder given a :class:`~omni_runtime.shm.ShmPool` puts arrays of at least
``SHM_MIN_BYTES`` in shared memory instead, and the ``Ext`` carries only the handle; see
:mod:`omni_runtime.shm` for who releases it and when. A stage worker's decoder maps such arrays
in place (released once the worker drops them); the orchestrator's (``shm_refs=True``) returns
:class:`~omni_runtime.shm.ShmRef`\\ s that it copies out or forwards to another stage unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from omni_runtime import shm
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.messages import (
    StageAbort,
    StagePing,
    StageRequest,
    StageRpc,
    StageShutdown,
    WorkerInbound,
    WorkerOutbound,
    encodable_text,
)

#: Arrays below this many bytes are inlined in the header.
INLINE_MAX = 1024
#: The integers msgpack can carry.
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
#: Deepest nesting of lists and mappings a value may have (msgspec's own limit is far deeper, but a
#: hostile value should be refused with a message, not a RecursionError).
MAX_DEPTH = 32

_EXT_ARRAY_FRAME = 1  # payload: (dtype, shape, frame index, is_torch)
_EXT_ARRAY_INLINE = 2  # payload: (dtype, shape, bytes, is_torch)
_EXT_ARRAY_SHM = 3  # payload: ShmHandle fields (name, offset, nbytes, gen, dtype, shape, is_torch)
_EXT_ARRAY_REMOTE = 4  # payload: (index into the message's remote handles, dtype, shape, is_torch)

_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(tuple)


def _torch():
    import torch  # imported lazily: the caller's process need not load torch for echo stages

    return torch


def _as_numpy(obj: Any) -> tuple[np.ndarray, str, bool] | None:
    """(array, dtype name, was torch) for numpy arrays and torch tensors; None otherwise."""
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return arr, arr.dtype.str, False
    if type(obj).__module__ == "torch" and type(obj).__name__ in ("Tensor", "Parameter"):
        torch = _torch()
        t = obj.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the bits
            return t.view(torch.int16).numpy(), "bfloat16", True
        return t.numpy(), t.numpy().dtype.str, True
    return None


def _rebuild(dtype: str, shape: tuple[int, ...], buf: Any, is_torch: bool) -> Any:
    if dtype == "bfloat16":
        arr = np.frombuffer(buf, dtype=np.int16).reshape(shape)
        torch = _torch()
        return torch.from_numpy(arr.copy()).view(torch.bfloat16)
    arr = np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
    if is_torch:
        # torch wants a writable buffer; a tensor the receiver may mutate gets its own copy.
        return _torch().from_numpy(arr.copy())
    return arr


class RemoteArray:
    """An array that stays where it was made (e.g. in Ray's object store) and travels as a handle:
    the transport moves ``handle`` beside the message bytes, and a receiver that needs the values
    fetches them. Handed on unchanged, it reaches the next stage without passing through here."""

    __slots__ = ("dtype", "handle", "is_torch", "shape")

    def __init__(self, handle: Any, dtype: str, shape: tuple[int, ...], is_torch: bool) -> None:
        self.handle = handle
        self.dtype = dtype
        self.shape = shape
        self.is_torch = is_torch

    def value(self, arr: Any) -> Any:
        """``arr`` (the fetched array, often read-only) as the kind of object that was sent."""
        return _rebuild(self.dtype, self.shape, arr, self.is_torch) if self.is_torch else arr

    def __repr__(self) -> str:
        return f"RemoteArray({self.dtype}{list(self.shape)})"


def remote_arrays(obj: Any) -> list[RemoteArray]:
    """Every RemoteArray inside ``obj`` (dicts, lists, tuples, msgspec Structs)."""
    found: list[RemoteArray] = []

    def walk(o: Any) -> None:
        if isinstance(o, RemoteArray):
            found.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, list | tuple):
            for v in o:
                walk(v)
        elif isinstance(o, msgspec.Struct):
            for f in o.__struct_fields__:
                walk(getattr(o, f))

    walk(obj)
    return found


def replace_remote(obj: Any, values: dict[int, Any]) -> Any:
    """``obj`` with each RemoteArray replaced by ``values[id(that RemoteArray)]``."""
    if isinstance(obj, RemoteArray):
        return values[id(obj)]
    if isinstance(obj, dict):
        return {k: replace_remote(v, values) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(replace_remote(v, values) for v in obj)
    if isinstance(obj, msgspec.Struct):
        changes = {f: replace_remote(getattr(obj, f), values) for f in obj.__struct_fields__}
        return msgspec.structs.replace(obj, **changes)
    return obj


# --------------------------------------------------------------------------- what can travel


def find_unencodable(value: Any, path: str = "", _depth: int = 0) -> tuple[str, str] | None:
    """The first part of ``value`` that no message can carry, as ``(path, why)``; None if all can.

    Strings must be valid UTF-8 (no lone surrogates), integers fit in 64 bits, mapping keys are
    strings or integers, containers nest at most :data:`MAX_DEPTH` deep, and leaves are None,
    bools, numbers, bytes, numpy arrays or torch tensors (not of Python objects) and msgspec
    Structs of those. The path is itself encodable (a key it cannot carry is shown escaped).
    Checked where a value enters the engine, so that a bad one is the caller's typed error at the
    call instead of an exception in a thread that serves everyone.
    """
    if value is None or isinstance(value, bool | float | bytes | bytearray | memoryview):
        return None
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            char = value[e.start]
            return path, f"contains U+{ord(char):04X} at index {e.start}, which cannot be encoded as UTF-8"
        return None
    if isinstance(value, int):
        if INT_MIN <= value <= INT_MAX:
            return None
        return path, f"integer {_short(value)} is out of range (a 64-bit integer is the largest accepted)"
    if _depth >= MAX_DEPTH:
        return path, f"nested deeper than {MAX_DEPTH} levels"
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str | int) or isinstance(key, bool):
                return path, f"mapping keys must be strings, got {type(key).__name__}"
            shown = encodable_text(key) if isinstance(key, str) else str(key)  # the path is quoted in errors
            sub = f"{path}.{shown}" if path else shown
            found = find_unencodable(key, sub, _depth + 1) or find_unencodable(item, sub, _depth + 1)
            if found is not None:
                return found
        return None
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = find_unencodable(item, f"{path}[{i}]", _depth + 1)
            if found is not None:
                return found
        return None
    if isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            found = find_unencodable(getattr(value, name), f"{path}.{name}" if path else name, _depth + 1)
            if found is not None:
                return found
        return None
    as_array = _as_numpy(value) if isinstance(value, np.ndarray) or type(value).__module__ == "torch" else None
    if as_array is not None:
        if as_array[0].dtype.hasobject:
            return path, "arrays of Python objects cannot be sent"
        return None
    return path, (
        f"values of type {type(value).__name__} cannot be sent "
        "(use strings, numbers, booleans, None, lists, mappings or arrays)"
    )


def check_encodable(value: Any, param: str) -> None:
    """Raise InvalidRequestError naming the part of ``value`` (under ``param``) that cannot travel."""
    found = find_unencodable(value, param)
    if found is not None:
        path, why = found
        raise InvalidRequestError(f"`{path}`: {why}", param=path)


def _short(value: Any) -> str:
    text = str(value) if not isinstance(value, int) or value.bit_length() < 256 else f"~2**{value.bit_length() - 1}"
    return text if len(text) <= 40 else text[:37] + "..."


class Encoder:
    """Encodes one message at a time into frames (not thread-safe: one per socket owner).

    With a ``shm_pool``, large arrays go through shared memory and :class:`~omni_runtime.shm.ShmRef`\\ s
    are handed off as they are; ``handles`` lists what the last message carried, so the sender
    can release them if the receiver dies before it reads them. Without one, refs are copied out
    and sent as frames.
    """

    def __init__(
        self,
        shm_pool: shm.ShmPool | None = None,
        shm_min_bytes: int = shm.SHM_MIN_BYTES,
        *,
        remote_put: Any = None,
        remote_min_bytes: int = 1 << 20,
    ) -> None:
        self._frames: list[Any] = []
        self._pool = shm_pool
        self._shm_min = shm_min_bytes
        self.handles: list[shm.ShmHandle] = []
        #: ``put(array) -> handle``: arrays of at least ``remote_min_bytes`` are stored with it and
        #: travel as RemoteArrays (a Ray object store); None: they travel as frames.
        self._remote_put = remote_put
        self._remote_min = remote_min_bytes
        #: The remote handles the last message carries, in the order its extensions index them.
        self.remote: list[Any] = []
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def _remote_ext(self, ref: RemoteArray) -> msgspec.msgpack.Ext:
        self.remote.append(ref.handle)
        meta = (len(self.remote) - 1, ref.dtype, ref.shape, ref.is_torch)
        return msgspec.msgpack.Ext(_EXT_ARRAY_REMOTE, _meta_encoder.encode(meta))

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, RemoteArray):
            return self._remote_ext(obj)
        if isinstance(obj, shm.ShmRef):
            if self._pool is not None and obj.can_hand_off():
                return self._shm_ext(obj.hand_off())
            obj = obj.take()  # the receiver cannot map it: copy it out once, here
        found = _as_numpy(obj)
        if found is None:
            raise NotImplementedError(f"cannot send objects of type {type(obj).__name__} on a stage socket")
        arr, dtype, is_torch = found
        if arr.dtype.hasobject:
            raise NotImplementedError("cannot send arrays of Python objects on a stage socket")
        if arr.nbytes < INLINE_MAX:
            return msgspec.msgpack.Ext(
                _EXT_ARRAY_INLINE, _meta_encoder.encode((dtype, arr.shape, arr.tobytes(), is_torch))
            )
        if self._pool is not None and arr.nbytes >= self._shm_min:
            handle = self._pool.put(arr, dtype, is_torch)
            if handle is not None:
                return self._shm_ext(handle)
        if self._remote_put is not None and arr.nbytes >= self._remote_min:
            return self._remote_ext(RemoteArray(self._remote_put(arr), dtype, tuple(arr.shape), is_torch))
        # numpy's stubs give ndarray __buffer__ on Python >= 3.12 only.
        self._frames.append(memoryview(arr).cast("B"))  # type: ignore[arg-type]
        return msgspec.msgpack.Ext(
            _EXT_ARRAY_FRAME, _meta_encoder.encode((dtype, arr.shape, len(self._frames), is_torch))
        )

    def _shm_ext(self, handle: shm.ShmHandle) -> msgspec.msgpack.Ext:
        self.handles.append(handle)
        return msgspec.msgpack.Ext(_EXT_ARRAY_SHM, _meta_encoder.encode(tuple(handle)))

    def encode(self, msg: Any) -> list[Any]:
        """Frames of ``msg``. Anything in it that msgpack cannot carry (a lone surrogate, an int
        past 64 bits, an unknown type) raises :class:`msgspec.EncodeError` saying what."""
        self._frames = []
        self.handles = []
        self.remote = []
        try:
            header = self._encoder.encode(msg)
            return [header, *self._frames]
        except BaseException as e:
            # Nothing was sent: slots filled for this message go back to their producers.
            for handle in self.handles:
                shm.release(handle)
            self.handles = []
            if isinstance(e, Exception) and not isinstance(e, msgspec.EncodeError):
                raise msgspec.EncodeError(f"cannot encode {type(msg).__name__}: {type(e).__name__}: {e}") from e
            raise
        finally:
            self._frames = []


class Decoder:
    """Decodes frames into one of ``msg_type``'s tagged Structs (not thread-safe).

    Shared-memory arrays are accepted only from segments named under ``shm_prefix`` (this
    engine's), so a stray message cannot make this process write into foreign memory. A handle
    whose segment is gone becomes a :class:`~omni_runtime.shm.ShmLostError` carrying the rest of
    the message, so the receiver can fail that one request.
    """

    def __init__(self, msg_type: Any, *, shm_prefix: str | None = None, shm_refs: bool = False) -> None:
        self._frames: list[Any] = []
        self._shm_prefix = shm_prefix
        self._shm_refs = shm_refs
        self._lost: list[str] = []
        self._remote: list[Any] = []
        self._remote_values: list[Any] | None = None
        self._decoder = msgspec.msgpack.Decoder(msg_type, ext_hook=self._ext_hook)

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == _EXT_ARRAY_SHM:
            return self._shm_array(data)
        if code == _EXT_ARRAY_REMOTE:
            index, dtype, shape, is_torch = _meta_decoder.decode(data)
            ref = RemoteArray(self._remote[index], dtype, tuple(shape), bool(is_torch))
            return ref if self._remote_values is None else ref.value(self._remote_values[index])
        dtype, shape, ref, is_torch = _meta_decoder.decode(data)
        if code == _EXT_ARRAY_INLINE:
            return _rebuild(dtype, tuple(shape), ref, is_torch)
        if code == _EXT_ARRAY_FRAME:
            return _rebuild(dtype, tuple(shape), self._frames[ref], is_torch)
        raise msgspec.DecodeError(f"unknown extension type {code}")

    def _shm_array(self, data: memoryview) -> Any:
        name, offset, nbytes, gen, dtype, shape, is_torch = _meta_decoder.decode(data)
        if self._shm_prefix is None or not name.startswith(self._shm_prefix + "-"):
            raise msgspec.DecodeError(f"shared-memory segment {name!r} is not this engine's")
        handle = shm.ShmHandle(name, offset, nbytes, gen, dtype, tuple(shape), bool(is_torch))
        try:
            if self._shm_refs:
                return shm.ShmRef(handle, shm.attach(name))
            return shm.map_array(handle)
        except FileNotFoundError:
            self._lost.append(f"shared-memory segment {name} is gone (its stage died)")
        except shm.ShmLostError as e:
            self._lost.append(str(e))
        return None

    def decode(self, frames: list[Any], remote: Sequence[Any] = (), remote_values: list[Any] | None = None) -> Any:
        """Raises msgspec.DecodeError / ValidationError for a malformed or foreign message.

        ``remote``: the remote handles that came with the frames; their arrays decode as
        RemoteArrays, or, given ``remote_values`` (the fetched arrays, same order), as values."""
        self._frames = [f.buffer if hasattr(f, "buffer") else f for f in frames]
        self._lost = []
        self._remote, self._remote_values = list(remote), remote_values
        try:
            msg = self._decoder.decode(self._frames[0])
        except Exception as e:  # whatever a corrupt header makes numpy raise (np.dtype(",") is a SyntaxError)
            raise msgspec.DecodeError(f"malformed message: {type(e).__name__}: {e}") from None
        finally:
            self._frames = []
            self._remote, self._remote_values = [], None
        if self._lost:
            raise shm.ShmLostError("; ".join(self._lost), msg)
        return msg


def output_ids(frame: Any) -> list[str]:
    """The request ids a stage's message names, read leniently from its first frame: for a
    ``StageOutput`` or ``StageOutputs`` that the typed decoder refused (a field of the wrong type,
    a payload it cannot rebuild), so the requests it was for end with an error instead of waiting
    forever. Nothing readable: ``[]``."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except Exception:  # not msgpack at all: nothing to salvage
        return []

    def one(item: Any) -> str | None:
        ok = isinstance(item, list) and len(item) > 1 and item[0] == "output" and isinstance(item[1], str)
        return item[1] if ok else None

    if isinstance(raw, list) and len(raw) > 1 and raw[0] == "outputs" and isinstance(raw[1], list):
        return [rid for item in raw[1] if (rid := one(item)) is not None]
    rid = one(raw)
    return [] if rid is None else [rid]


def inbound_decoder(shm_prefix: str | None = None, params_cls: Any = None) -> Decoder:
    """The stage worker's decoder: shared-memory arrays are mapped in place, released when dropped.
    A request's params decode as ``params_cls`` (the stage runner's params class: a struct, its
    arrays as values); None leaves them as plain values (a tool reading any stage's messages)."""
    if params_cls is None:
        return Decoder(WorkerInbound, shm_prefix=shm_prefix)
    inbound = StageRequest[params_cls] | StageAbort | StageRpc | StageShutdown | StagePing
    return Decoder(inbound, shm_prefix=shm_prefix)


def outbound_decoder(shm_prefix: str | None = None) -> Decoder:
    """The orchestrator's decoder: shared-memory arrays stay mapped as ShmRefs until routed."""
    return Decoder(WorkerOutbound, shm_prefix=shm_prefix, shm_refs=shm_prefix is not None)
