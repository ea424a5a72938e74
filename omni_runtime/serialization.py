"""Wire encoding for stage sockets: msgpack via msgspec, arrays as raw buffers. No pickle.

A message becomes a list of frames: frame 0 is the msgpack header; every numpy array or torch
tensor of at least ``INLINE_MAX`` bytes travels as a frame of its own, sent without a copy
(``zmq`` ``copy=False``) and referenced from the header by an ``Ext`` that carries its dtype,
shape and frame index. Small arrays are inlined in the ``Ext`` itself (one frame less is cheaper
than a copy of a few bytes). The receiver rebuilds arrays with ``np.frombuffer`` over the frame's
memory: no copy on this side either.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from omni_runtime.messages import WorkerInbound, WorkerOutbound

#: Arrays below this many bytes are inlined in the header.
INLINE_MAX = 1024

_EXT_ARRAY_FRAME = 1  # payload: (dtype, shape, frame index, is_torch)
_EXT_ARRAY_INLINE = 2  # payload: (dtype, shape, bytes, is_torch)

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


class Encoder:
    """Encodes one message at a time into frames (not thread-safe: one per socket owner)."""

    def __init__(self) -> None:
        self._frames: list[Any] = []
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def _enc_hook(self, obj: Any) -> Any:
        found = _as_numpy(obj)
        if found is None:
            raise NotImplementedError(f"cannot send objects of type {type(obj).__name__} on a stage socket")
        arr, dtype, is_torch = found
        if arr.nbytes < INLINE_MAX:
            return msgspec.msgpack.Ext(
                _EXT_ARRAY_INLINE, _meta_encoder.encode((dtype, arr.shape, arr.tobytes(), is_torch))
            )
        self._frames.append(memoryview(arr).cast("B"))
        return msgspec.msgpack.Ext(
            _EXT_ARRAY_FRAME, _meta_encoder.encode((dtype, arr.shape, len(self._frames), is_torch))
        )

    def encode(self, msg: Any) -> list[Any]:
        self._frames = []
        try:
            header = self._encoder.encode(msg)
            return [header, *self._frames]
        finally:
            self._frames = []


class Decoder:
    """Decodes frames into one of ``msg_type``'s tagged Structs (not thread-safe)."""

    def __init__(self, msg_type: Any) -> None:
        self._frames: list[Any] = []
        self._decoder = msgspec.msgpack.Decoder(msg_type, ext_hook=self._ext_hook)

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        dtype, shape, ref, is_torch = _meta_decoder.decode(data)
        if code == _EXT_ARRAY_INLINE:
            return _rebuild(dtype, tuple(shape), ref, is_torch)
        if code == _EXT_ARRAY_FRAME:
            return _rebuild(dtype, tuple(shape), self._frames[ref], is_torch)
        raise msgspec.DecodeError(f"unknown extension type {code}")

    def decode(self, frames: list[Any]) -> Any:
        """Raises msgspec.DecodeError / ValidationError for a malformed or foreign message."""
        self._frames = [f.buffer if hasattr(f, "buffer") else f for f in frames]
        try:
            return self._decoder.decode(self._frames[0])
        except Exception as e:  # whatever a corrupt header makes numpy raise (np.dtype(",") is a SyntaxError)
            raise msgspec.DecodeError(f"malformed message: {type(e).__name__}: {e}") from None
        finally:
            self._frames = []


def inbound_decoder() -> Decoder:
    return Decoder(WorkerInbound)


def outbound_decoder() -> Decoder:
    return Decoder(WorkerOutbound)
