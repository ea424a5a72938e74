"""The exact-result cache of a stage (``engine_args.result_cache``, off by default): a request
whose output is fixed by what it carries gets the output stored for an equal one, without the
model running.

What fixes an output: the stage's model as loaded now, the prompt, every field of the typed params
(:mod:`omni_runtime.params`; an input image's pixels included) and the inputs from upstream, under
an explicit ``seed``. A request without one draws a fresh seed (its output is meant to differ every
time), so it is never looked up and never stored. The key is a digest of those values, each
written with its type and length so that two different requests never write the same bytes; a
value of a type not listed in :func:`request_digest` makes the request uncacheable rather than
keyed on less than it is.

The worker asks at arrival (:meth:`ExactResultCache.lookup`): a hit is answered at once and never
enters a scheduler; a miss is remembered by its request id and, if it finishes without an error,
its final output is stored (:meth:`ExactResultCache.finished`). An abort, an error or a partial
output is never stored. Every control call that may change the model (sleep, wake-up, a LoRA
added or removed, any runner control call but a read) :meth:`~ExactResultCache.invalidate` s: the
entries go, and a request admitted before it is not stored when it finishes (its output may come
from the model as it was).

Outputs are copied in and copied out: the caller owns what it is given and may write into it
(with the ``inproc`` backend its arrays are the very objects sent), and the stored copy must not
change. A hit's output carries only the stored seed and the cache's own metrics, never the timings
of the request that made it.

Lives in the stage worker; runs on its event loop.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import msgspec
import numpy as np

from omni_runtime.stage.byte_cache import ByteLRU
from omni_runtime.stage.runners.base import RunnerOutput


class _Uncacheable(Exception):
    """A value the digest cannot write exactly."""


def request_digest(prompt: Any, params: Any, inputs: dict[str, Any]) -> bytes | None:
    """A 32-byte digest of a request's prompt, params and inputs; None if one of them holds a value
    of a type it does not know (then the request is not cached)."""
    h = hashlib.blake2b(digest_size=32)
    try:
        for value in (prompt, params, inputs):
            _write(h, value)
    except Exception:  # _Uncacheable, or a tensor that cannot be read as bytes (sparse...)
        # Not cached, never failed: the request runs as it would without the cache.
        return None
    return h.digest()


def _write(h: Any, value: Any) -> None:
    """``value`` into the digest: a tag, then a length where the value has one, then the value."""
    if value is None:
        h.update(b"N")
    elif isinstance(value, bool):  # before int: True is an int too
        h.update(b"T" if value else b"F")
    elif isinstance(value, int):
        h.update(b"I%d;" % value)
    elif isinstance(value, float):
        h.update(b"R" + value.hex().encode() + b";")
    elif isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        h.update(b"S%d;" % len(data))
        h.update(data)
    elif isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        h.update(b"Y%d;" % len(data))
        h.update(data)
    elif isinstance(value, np.ndarray):
        _write_array(h, value)
    elif isinstance(value, np.generic):
        _write(h, value.item())
    elif isinstance(value, msgspec.Struct):
        name = f"{type(value).__module__}.{type(value).__qualname__}"
        _write(h, name)
        for field in value.__struct_fields__:
            _write(h, field)
            _write(h, getattr(value, field))
    elif isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise _Uncacheable
        h.update(b"D%d;" % len(value))
        for key in sorted(value):
            _write(h, key)
            _write(h, value[key])
    elif isinstance(value, list | tuple):
        h.update(b"L%d;" % len(value))
        for item in value:
            _write(h, item)
    elif _is_tensor(value):
        # Viewed as bytes on the host: exact for every dtype (bfloat16 has no numpy twin).
        flat = value.detach().cpu().contiguous()
        h.update(f"P{flat.dtype}{tuple(flat.shape)};".encode())
        h.update(flat.reshape(-1).view(sys.modules["torch"].uint8).numpy().data)
    else:
        raise _Uncacheable


def _write_array(h: Any, array: np.ndarray) -> None:
    if array.dtype.hasobject:
        raise _Uncacheable
    h.update(f"A{array.dtype.str}{array.shape};".encode())
    h.update(np.ascontiguousarray(array).data)


def _is_tensor(value: Any) -> bool:
    """A torch tensor, without importing torch into a process that has not (a text-only stage)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def output_bytes(value: Any) -> int:
    """What an output holds: the bytes of its arrays, tensors and text (the bound's measure)."""
    if isinstance(value, RunnerOutput):
        return output_bytes(value.text) + output_bytes(value.media) + output_bytes(value.tensors)
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if _is_tensor(value):
        return int(value.numel() * value.element_size())
    if isinstance(value, str):  # its UTF-8 bytes: a character is up to 4 of them
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, bytes | bytearray):
        return len(value)
    if isinstance(value, msgspec.Struct):
        return sum(output_bytes(getattr(value, f)) for f in value.__struct_fields__)
    if isinstance(value, dict):
        return sum(output_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(output_bytes(v) for v in value)
    return 0


def copy_value(value: Any) -> Any:
    """A copy that shares no array or tensor with ``value``; immutable leaves are shared."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if _is_tensor(value):
        return value.detach().clone()
    if isinstance(value, msgspec.Struct):
        return msgspec.structs.replace(value, **{f: copy_value(getattr(value, f)) for f in value.__struct_fields__})
    if isinstance(value, dict):
        return {k: copy_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_value(v) for v in value]
    if isinstance(value, tuple):
        return tuple(copy_value(v) for v in value)
    return value


def copy_output(out: RunnerOutput) -> RunnerOutput:
    """What a stored output is, or what a hit is given: text, media and tensors copied, and of the
    metrics only the seed (the rest described the run that made it)."""
    metrics = {"seed": out.metrics["seed"]} if "seed" in out.metrics else {}
    return RunnerOutput(text=out.text, media=copy_value(out.media), tensors=copy_value(out.tensors), metrics=metrics)


class ExactResultCache:
    """The final outputs of one replica's seeded requests, bounded by bytes, least recently used out
    first; and the keys of the requests in flight that may be stored when they finish."""

    def __init__(self, max_bytes: int) -> None:
        self.store: ByteLRU[bytes, RunnerOutput] = ByteLRU(max_bytes)
        #: Bumped by every invalidation: a request admitted before one is not stored.
        self.generation = 0
        #: Request id -> (its key, the generation it was admitted in), while it runs.
        self._pending: dict[str, tuple[bytes, int]] = {}

    def lookup(self, request_id: str, prompt: Any, params: Any, inputs: dict[str, Any]) -> RunnerOutput | None:
        """A copy of the output stored for a request equal to this one (a hit), or None. A miss
        that may be stored is remembered until :meth:`finished` or :meth:`forget`."""
        if getattr(params, "seed", None) is None:
            return None
        key = request_digest(prompt, params, inputs)
        if key is None:
            return None
        found = self.store.get(key)
        if found is not None:
            return copy_output(found)
        self._pending[request_id] = (key, self.generation)
        return None

    def finished(self, request_id: str, out: RunnerOutput) -> dict[str, int]:
        """A request's final output: stored if it was a miss admitted in this generation and has
        no error. Returns its output metrics (none for a request the cache did not take)."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return {}
        key, generation = pending
        metrics = {"result_cache_hit": 0}
        if out.error is None and generation == self.generation:
            stored = copy_output(out)
            evicted = self.store.put(key, stored, output_bytes(stored))
            if evicted:
                metrics["result_cache_evictions"] = evicted
        return {**metrics, **self.sizes()}

    def hit_metrics(self) -> dict[str, int]:
        """A hit's output metrics."""
        return {"result_cache_hit": 1, **self.sizes()}

    def sizes(self) -> dict[str, int]:
        return {"result_cache_bytes": self.store.bytes, "result_cache_entries": len(self.store)}

    def forget(self, request_id: str) -> None:
        """A request that will not finish here (aborted, refused): nothing is stored for it."""
        self._pending.pop(request_id, None)

    def invalidate(self) -> None:
        """The model changed: drop every entry, and store nothing of the requests already admitted."""
        self.generation += 1
        self.store.clear()

    def stats(self) -> dict[str, Any]:
        return {**self.store.stats(), "pending": len(self._pending)}
