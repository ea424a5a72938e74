"""LoRA adapters of one diffusion pipeline: the names on offer, the adapters loaded, the one active.

A request asks for ``lora: {name | path, scale}``. The diffusion runner keys its batches on the
adapter and the scale (:meth:`LoraAdapters.key`), so a wave or a step batch uses one adapter at one
scale, and before each it calls :meth:`LoraAdapters.activate`:

1) the adapter's file is found: a ``name`` through the registry (``engine_args.loras`` and
   ``add_lora``), a ``path`` as given (only the Python API passes paths), and resolved to one
   ``.safetensors`` file whose size and header are checked before anything reads it
   (:mod:`omni_runtime.stage.runners.lora_files`);
2) it is loaded once, its weights checked for NaN / inf, then with the pipeline's own
   ``load_lora_weights`` given that exact file (diffusers + peft, local files only, no fallback to
   a pickle), and kept, at most ``engine_args.max_loras`` of them: past that the least recently
   used is deleted from the pipeline (``delete_adapters``) and loaded again when asked for (for a
   moment, while one loads, there is one more);
3) it is made the only active adapter at the request's scale (``set_adapters``). A batch without
   an adapter runs with the LoRA layers disabled, which computes exactly what the base model does.

``add_lora`` is a transaction: the new file is checked (and with ``load=True`` loaded, under an
adapter name of its own) before the registry changes, so a failure leaves every name and every
loaded adapter as it was. A step-execution request is pinned at admission to the file its name
pointed at (:meth:`LoraAdapters.pin`): re-pointing the name later does not change the adapter of a
request that is half denoised.

Lives in the stage worker process. Every method runs in the worker's forward thread (waves, steps
and the ``rpc_*`` control calls share that one executor thread), so nothing here needs a lock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import warnings
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from omni_runtime.exceptions import ConfigError, InvalidRequestError, LoraFormatError, LoraLoadError
from omni_runtime.params import LORA_NAME_PATTERN, LoraRequest, check_lora_path
from omni_runtime.stage.runners.lora_files import adapter_file, check_finite

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(LORA_NAME_PATTERN)
#: The active state is not known (an adapter was just loaded or deleted): apply it again.
_UNKNOWN = ("?",)


@dataclass(frozen=True)
class PinnedLora:
    """A request's registered adapter (its ``lora.name``) pinned to the file the name pointed at
    when the request was admitted (:meth:`LoraAdapters.pin`), at the request's scale."""

    name: str
    source: str
    scale: float


#: What a request runs with: its params' ``lora``, or that pinned, or none.
LoraSpec = LoraRequest | PinnedLora | None


@dataclass
class _Loaded:
    #: The adapter's name inside the pipeline (peft's), never a client's string.
    adapter: str
    #: The real path of the ``.safetensors`` file it was loaded from: the cache key.
    source: str
    #: Waves (or steps) that ran with it.
    batches: int = 0


def supports_lora(pipe: Any) -> bool:
    """Whether a pipeline loads LoRA adapters (a diffusers LoRA loader mixin and the peft backend)."""
    if not (callable(getattr(pipe, "load_lora_weights", None)) and callable(getattr(pipe, "set_adapters", None))):
        return False
    from diffusers.utils import USE_PEFT_BACKEND

    return bool(USE_PEFT_BACKEND)


class LoraAdapters:
    """The registry, the LRU cache of loaded adapters and the active set of one replica's pipeline."""

    def __init__(self, registry: dict[str, str], max_loaded: int, max_file_bytes: int) -> None:
        #: name -> path as registered (YAML, then add_lora/remove_lora); kept across sleep.
        self._registry = dict(registry)
        self._max_loaded = max_loaded
        self._max_file_bytes = max_file_bytes
        #: name -> the adapter file its path resolved to when registered (None: it did not), so
        #: re-pointing or removing a name unloads the right adapter even if the old path is gone.
        self._files = {name: self._file_of(path) for name, path in registry.items()}
        #: By real path, least recently used first.
        self._loaded: OrderedDict[str, _Loaded] = OrderedDict()
        self._active: tuple[Any, ...] | None = None
        self._pipe: Any = None
        self._ids = itertools.count()
        self.supported = False
        self.loads = 0
        self.evictions = 0

    # ------------------------------------------------------------------ lifecycle

    def bind(self, pipe: Any) -> None:
        """Start over with a freshly loaded pipeline (None: it was released; nothing is loaded).
        The registry stays."""
        self._pipe = pipe
        self._loaded.clear()
        self._active = None
        if pipe is not None:
            self.supported = supports_lora(pipe)

    def check_registry(self) -> None:
        """At load: ConfigError if adapters are registered for a pipeline that cannot take them, or
        a registered path does not exist (an operator's typo fails start-up, not a request later)."""
        if self._registry and not self.supported:
            raise ConfigError(
                f"{type(self._pipe).__name__} does not load LoRA adapters, but some are registered",
                path="engine_args.loras",
            )
        for name, path in self._registry.items():
            if not os.path.exists(path):
                raise ConfigError(f"{path} does not exist", path=f"engine_args.loras.{name}")
            try:
                adapter_file(path, self._max_file_bytes, f"engine_args.loras.{name}")
            except LoraFormatError as e:
                raise ConfigError(str(e), path=f"engine_args.loras.{name}") from None

    # ------------------------------------------------------------------ per batch

    @staticmethod
    def key(spec: LoraSpec) -> Hashable:
        """What the batch key holds of a request's ``lora``: the adapter as asked for, and the scale."""
        if spec is None:
            return None
        if isinstance(spec, PinnedLora):
            return ("path", spec.source, float(spec.scale))
        if spec.name is not None:
            return ("name", spec.name, float(spec.scale))
        return ("path", os.path.normpath(str(spec.path)), float(spec.scale))

    def pin(self, spec: LoraSpec) -> LoraSpec:
        """``spec`` pinned to the file its name points at now, for a request that will run over many
        steps: a later ``add_lora`` re-pointing the name does not switch its adapter half way (its
        image would match neither). A ``remove_lora`` still fails it at its next step. Raises as
        :meth:`activate` does for a name that is not registered."""
        if not isinstance(spec, LoraRequest) or spec.name is None or not self.supported:
            return spec
        source, _ = self._source(spec)
        return PinnedLora(spec.name, source, spec.scale)

    def activate(self, spec: LoraSpec) -> None:
        """Make ``spec``'s adapter the only active one, at its scale (loading it if need be), or
        disable every adapter for None. Raises InvalidRequestError (an unknown name, a path that
        does not exist) or LoraLoadError (it would not load): the batch's requests fail with it.

        Callable inside ``torch.inference_mode`` (the step loop is): the adapters' weights are made
        outside it, since peft later sets their ``requires_grad``, which inference tensors refuse.
        """
        with torch.inference_mode(False):
            self._activate(spec)

    def _activate(self, spec: LoraSpec) -> None:
        pipe = self._pipe
        if spec is None:
            if self._loaded and self._active is not None:
                pipe.disable_lora()
            self._active = None
            return
        if not self.supported:
            raise InvalidRequestError(f"{type(pipe).__name__} does not take LoRA adapters", param="lora")
        source, label = self._source(spec)
        named = isinstance(spec, PinnedLora) or spec.name is not None
        entry = self._ensure_loaded(source, label, "lora.name" if named else "lora.path")
        entry.batches += 1
        scale = float(spec.scale)
        if self._active != (entry.adapter, scale):
            pipe.enable_lora()
            pipe.set_adapters([entry.adapter], adapter_weights=[scale])
            self._active = (entry.adapter, scale)

    def _source(self, spec: LoraRequest | PinnedLora) -> tuple[str, str]:
        """(real path of the checked ``.safetensors`` file, how to name it in an error) of a
        request's adapter; a pinned one (:meth:`pin`) keeps its file while its name is registered."""
        name = spec.name
        if name is not None:
            path = self._registry.get(name)
            if path is None:
                offered = ", ".join(sorted(self._registry)) or "none"
                raise InvalidRequestError(
                    f"unknown LoRA adapter {name!r}; this stage offers: {offered} "
                    "(engine_args.loras, or collective_rpc('add_lora'))",
                    param="lora.name",
                )
            pinned = spec.source if isinstance(spec, PinnedLora) else None
            if pinned is not None and pinned in self._loaded:
                return pinned, repr(name)
            if pinned is not None:
                if not os.path.exists(pinned):
                    raise LoraLoadError(f"LoRA adapter {name!r} was loaded from {pinned}, which no longer exists")
                return adapter_file(pinned, self._max_file_bytes, "lora.name"), repr(name)
            if not os.path.exists(path):
                raise LoraLoadError(f"LoRA adapter {name!r} is registered at {path}, which no longer exists")
            return adapter_file(path, self._max_file_bytes, "lora.name"), repr(name)
        assert isinstance(spec, LoraRequest)  # a pinned adapter has a name
        path = str(spec.path)
        check_lora_path(path)
        if not os.path.exists(path):
            raise InvalidRequestError(
                f"LoRA adapter path {path!r} does not exist on the stage's machine", param="lora.path"
            )
        return adapter_file(path, self._max_file_bytes, "lora.path"), repr(path)

    def _ensure_loaded(self, source: str, label: str, field: str) -> _Loaded:
        entry = self._loaded.get(source)
        if entry is not None:
            self._loaded.move_to_end(source)
            return entry
        # 1) Load: the one checked safetensors file, named to the loader (which could otherwise
        #    choose a file itself, or fall back to a pickle), never a download; finite weights only.
        check_finite(source, field)
        adapter = f"lora{next(self._ids)}"
        self._active = _UNKNOWN  # loading may change what is active
        try:
            with _quiet_loading():
                self._pipe.load_lora_weights(
                    os.path.dirname(source),
                    weight_name=os.path.basename(source),
                    adapter_name=adapter,
                    use_safetensors=True,
                    local_files_only=True,
                )
        except Exception as e:
            self._delete(adapter)  # a part may have been injected before the failure
            raise LoraLoadError(f"cannot load LoRA adapter {label}: {type(e).__name__}: {e}", param="lora") from e
        self.loads += 1
        entry = _Loaded(adapter=adapter, source=source)
        self._loaded[source] = entry
        logger.info("LoRA adapter %s loaded as %s", source, adapter)
        # 2) Then room: the least recently used others leave the pipeline. After the load, so an
        #    adapter that will not load does not push out one that works.
        while len(self._loaded) > self._max_loaded:
            _, old = self._loaded.popitem(last=False)
            self._delete(old.adapter)
            self.evictions += 1
            logger.info("LoRA adapter %s unloaded (max_loras=%d)", old.source, self._max_loaded)
        return entry

    def _delete(self, adapter: str) -> None:
        present = {a for names in self._pipe.get_list_adapters().values() for a in names}
        if adapter in present:
            self._pipe.delete_adapters([adapter])
        self._active = _UNKNOWN if self._loaded else None

    # ------------------------------------------------------------------ control calls

    def add(self, name: Any, path: Any, load: Any = False) -> dict[str, Any]:
        """Register (or re-point) ``name``; with ``load=True`` load it now, so its first request
        does not pay for it. All or nothing: every check and the load come before the registry
        changes, so a failure leaves the old name, path and loaded adapter serving."""
        # 1) Check everything, changing nothing.
        _check_name(name)
        if not isinstance(path, str) or not path:
            raise InvalidRequestError("add_lora: `path` must be a non-empty string", param="path")
        check_lora_path(path, "path")
        if not isinstance(load, bool):
            raise InvalidRequestError("add_lora: `load` must be true or false", param="load")
        if not os.path.exists(path):
            raise InvalidRequestError(f"add_lora: {path!r} does not exist on the stage's machine", param="path")
        if load and (not self.supported or self._pipe is None):
            raise InvalidRequestError("add_lora: this stage's model is not loaded or takes no LoRA", param="load")
        source = adapter_file(path, self._max_file_bytes, "path")
        # 2) Load it (as an adapter of its own: the one the name points at now stays loaded);
        #    the LRU may unload another adapter for room, which only costs a reload later.
        if load:
            self._ensure_loaded(source, repr(name), "path")
        # 3) Commit: the name points at the new file; the old file's adapter goes unless another
        #    name (or the new path) still points at it.
        previous = self._files.get(name)
        self._registry[name] = path
        self._files[name] = source
        if previous is not None:
            self._unload_unreferenced(previous)
        return {"name": name, "path": path, "loaded": source in self._loaded}

    def remove(self, name: Any) -> dict[str, Any]:
        """Unregister ``name`` and unload its adapter (unless another name points at it). Requests
        that name it afterwards fail; in step execution, so do running ones at their next step."""
        _check_name(name)
        if self._registry.pop(name, None) is None:
            raise InvalidRequestError(f"remove_lora: no adapter named {name!r}", param="name")
        source = self._files.pop(name, None)
        return {"name": name, "removed": True, "unloaded": source is not None and self._unload_unreferenced(source)}

    def _unload_unreferenced(self, source: str) -> bool:
        """Unload the adapter of file ``source`` unless a registered name still points at it."""
        still_named = source in self._files.values()
        entry = None if still_named else self._loaded.pop(source, None)
        if entry is None:
            return False
        self._delete(entry.adapter)
        return True

    def _file_of(self, path: str) -> str | None:
        """The adapter file a registered path resolves to (None: it no longer resolves to one)."""
        try:
            return adapter_file(path, self._max_file_bytes, "path")
        except (OSError, LoraFormatError):
            return None

    def describe(self) -> dict[str, Any]:
        """What ``list_loras`` answers."""
        names: dict[str | None, list[str]] = {}  # None: names whose file no longer resolves
        for name, source in self._files.items():
            names.setdefault(source, []).append(name)
        active = None
        if self._active not in (None, _UNKNOWN):
            adapter, scale = self._active
            source = next((s for s, e in self._loaded.items() if e.adapter == adapter), None)
            active = {"source": source, "scale": scale}
        return {
            "registered": dict(self._registry),
            # Least recently used first: the next to be unloaded.
            "loaded": [
                {"source": e.source, "names": sorted(names.get(e.source, [])), "batches": e.batches}
                for e in self._loaded.values()
            ],
            "active": active,
            "max_loras": self._max_loaded,
            "loads": self.loads,
            "evictions": self.evictions,
            "supported": self.supported,
        }


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """Loading an adapter next to others makes transformers report the others' text-encoder
    weights as "missing" (it expects every adapter's keys), and peft warn that the model already
    has adapters: that is how several adapters live in one model, not a fault, and would fill the
    logs at every load."""
    report = logging.getLogger("transformers.integrations.peft")
    level = report.level
    report.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
            yield
    finally:
        report.setLevel(level)


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidRequestError(
            f"`name` must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit; got {name!r:.80}",
            param="name",
        )
