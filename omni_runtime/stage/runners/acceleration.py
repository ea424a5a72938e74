"""The acceleration options of ``engine_args`` (:mod:`omni_runtime.acceleration`) applied to a
loaded diffusers pipeline, in the stage worker: quantization arguments for ``from_pretrained``,
layerwise casting and offload after it, and :class:`StepCacheControl`, which switches the
denoiser's cache hooks between waves (or, in step execution, gives each request its own first-block
cache state, :mod:`omni_runtime.stage.runners.row_cache`) and counts the blocks it really ran.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from omni_runtime.acceleration import (
    REFUSED_CACHE_TYPES,
    FirstBlockCache,
    MagCache,
    PyramidAttentionBroadcast,
    Quantization,
    StepCache,
    TaylorSeerCache,
    cache_type,
    parse_cache,
)
from omni_runtime.config import EngineArgs
from omni_runtime.exceptions import ConfigError, InvalidRequestError
from omni_runtime.stage.runners.row_cache import RowCacheState, RowMagState, RowState, RowStepCache
from omni_runtime.stage.runners.sizes import denoiser

logger = logging.getLogger(__name__)

#: Attributes of a denoiser that hold its transformer blocks (diffusers' own list, in its hooks).
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks", "layers")


def quantization_kwargs(args: EngineArgs) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments of ``engine_args.quantization`` (none when unset)."""
    quant = args.quantization
    if quant is None:
        return {}
    config = _torchao_config(quant)  # first: its ConfigError where torchao is missing
    from diffusers import PipelineQuantizationConfig, TorchAoConfig

    # quant_mapping, not quant_backend + quant_kwargs: diffusers' and transformers' TorchAoConfig
    # differ in signature, which PipelineQuantizationConfig refuses for a shared quant_kwargs.
    mapping = {name: TorchAoConfig(config) for name in quant.components}
    return {"quantization_config": PipelineQuantizationConfig(quant_mapping=mapping)}


def quantize_components(pipe: Any, args: EngineArgs) -> None:
    """``engine_args.quantization`` applied in place to modules already built (``load_format:
    dummy``): torchao's ``quantize_`` over their linear layers, as diffusers does while it loads."""
    quant = args.quantization
    if quant is None:
        return
    from torchao.quantization import quantize_

    config = _torchao_config(quant)
    for name in quant.components:
        quantize_(pipe.components[name], config)


def _torchao_config(quant: Quantization) -> Any:
    """The torchao config of a ``quant_type``; ConfigError where torchao does not import."""
    try:
        from torchao.quantization import (
            Float8WeightOnlyConfig,
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
        )
    except ImportError as e:
        raise ConfigError(
            f"quantization needs torchao ({e}); pip install 'omni_runtime[accel]'", path="engine_args.quantization"
        ) from None
    configs = {
        "int8wo": Int8WeightOnlyConfig,
        "int8dq": Int8DynamicActivationInt8WeightConfig,
        "float8wo": Float8WeightOnlyConfig,
    }
    return configs[quant.quant_type]()


def check_components(pipe: Any, args: EngineArgs) -> None:
    """Every component ``quantization`` names exists in the loaded pipeline."""
    if args.quantization is None:
        return
    known = [name for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)]
    for i, name in enumerate(args.quantization.components):
        if name not in known:
            raise ConfigError(
                f"{type(pipe).__name__} has no model component {name!r}; it has {', '.join(known)}",
                path=f"engine_args.quantization.components[{i}]",
            )


def apply_memory_options(pipe: Any, args: EngineArgs, device: str) -> tuple[Any, list[str]]:
    """Layerwise casting, then the pipeline moved to ``device`` or offloaded; returns the pipeline
    and what was applied, for the log."""
    applied: list[str] = []
    if args.layerwise_casting is not None:
        casting = args.layerwise_casting
        module = denoiser(pipe)
        module.enable_layerwise_casting(
            storage_dtype=getattr(torch, casting.storage_dtype), compute_dtype=getattr(torch, casting.compute_dtype)
        )
        applied.append(f"{type(module).__name__} stored as {casting.storage_dtype}")
    if args.offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif args.offload == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    elif args.offload == "group":
        pipe.enable_group_offload(
            onload_device=torch.device(device), offload_type="block_level", num_blocks_per_group=1
        )
    else:
        pipe = pipe.to(device)
    if args.offload is not None:
        applied.append(f"{args.offload} CPU offload")
    if args.quantization is not None:
        applied.append(f"{', '.join(args.quantization.components)} quantized {args.quantization.quant_type}")
    return pipe, applied


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes held by a tensor, a torchao quantized tensor counted by its inner tensors."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.untyped_storage().nbytes()


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (each storage once)."""
    seen: set[int] = set()
    total = 0
    for t in (*module.parameters(), *module.buffers()):
        key = id(t)
        if key in seen or t.is_meta:
            continue
        seen.add(key)
        total += tensor_bytes(t)
    return total


def weight_bytes(pipe: Any) -> dict[str, int]:
    """Resident weight bytes of each model component of a pipeline."""
    return {
        name: module_bytes(module)
        for name, module in getattr(pipe, "components", {}).items()
        if isinstance(module, torch.nn.Module)
    }


def _probe(block: torch.nn.Module) -> torch.nn.Module:
    """The first Linear inside a block: it runs only when the block (or its attention) really
    computes, whereas a cache hook answers the block's own call from its cache."""
    linears = [(name, m) for name, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
    for name, m in linears:
        if "attn" in name:  # attention caches skip the attention, not the block's norms
            return m
    return linears[0][1] if linears else block


class StepCacheControl:
    """The denoiser's cache hooks: the stage's default, a request's override per wave, and the
    count of blocks called and really run.

    Lives in the stage worker; used from its executor thread only.
    """

    def __init__(self, pipe: Any, default: StepCache | None, family: str) -> None:
        self.pipe = pipe
        self.default = default
        self.module = denoiser(pipe)
        #: Why this denoiser takes no cache hooks (None: it does).
        self.unsupported: str | None = None
        if not hasattr(self.module, "enable_cache"):
            self.unsupported = (
                f"the {family} family's {type(self.module).__name__} has no diffusers cache hooks "
                "(CacheMixin); step caching serves the flux and wan families"
            )
        if default is not None and self.unsupported is not None:
            raise ConfigError(self.unsupported, path="engine_args.cache.type")
        self._applied: tuple[StepCache, int] | None = None
        self.blocks_called = 0
        self.blocks_run = 0
        self._counting = False
        #: Per-request first-block caching for step execution (made by :meth:`row_cache`).
        self._rows: RowStepCache | None = None

    def row_cache(self) -> RowStepCache | None:
        """The denoiser's per-request first-block cache for step execution (None where it has no cache
        hooks: such requests are refused by :meth:`step_cache`). ConfigError when the stage's default
        cache cannot run step by step."""
        if self.unsupported is None:
            reason = RowStepCache.unsupported(self.module)
            if reason is not None:
                self.unsupported = f"step execution caches per request and {reason}"
        if self.unsupported is not None:
            if self.default is not None:
                raise ConfigError(self.unsupported, path="engine_args.cache.type")
            return None
        self._rows = RowStepCache(self.module, self.count)
        return self._rows

    def served(self) -> tuple[tuple[str, ...], str]:
        """The cache types a request may name here, and why others are refused (StageConstraints)."""
        if self.unsupported is not None:
            return (), self.unsupported
        if self._rows is not None:
            return ("first_block", "mag"), (
                "this stage runs with engine_args.step_execution, where each request caches on its own "
                "with first_block or mag (taylorseer and pab keep diffusers' per-module state)"
            )
        return tuple(t for t in ("first_block", "taylorseer", "mag", "pab") if t not in REFUSED_CACHE_TYPES), (
            REFUSED_CACHE_TYPES["faster"]
        )

    def step_cache(self, value: Any, steps: int) -> RowState | None:
        """A step-execution request's own cache state from its ``cache`` param (or the stage's
        default), for its ``steps`` steps; InvalidRequestError for a cache it cannot run step by step."""
        cache = self.resolve(value)
        if cache is None:
            return None
        if not isinstance(cache, FirstBlockCache | MagCache):
            raise InvalidRequestError(
                f"invalid sampling param `cache.type`: {cache_type(cache)!r} keeps its state per module "
                "(diffusers' hooks), which a step-execution batch shares between requests; this stage "
                "caches per request with first_block or mag",
                param="cache",
            )
        if self._rows is None:  # resolve refused an unsupported denoiser already
            raise InvalidRequestError("invalid sampling param `cache`: this stage runs no step caching", param="cache")
        if isinstance(cache, FirstBlockCache):
            return RowCacheState(threshold=cache.threshold)
        # diffusers' own config interpolates the ratios to the step count, as its hook would.
        config = self._diffusers_config(cache, steps)
        return RowMagState(
            threshold=cache.threshold,
            max_skip_steps=cache.max_skip_steps,
            retention_steps=int(cache.retention_ratio * steps + 0.5),
            mag_ratios=[float(r) for r in config.mag_ratios],
        )

    def count(self, called: int, run: int) -> None:
        """Blocks called and really run, counted by the per-request cache (one per request a block served)."""
        self.blocks_called += called
        self.blocks_run += run

    def _count_blocks(self) -> None:
        """Counting hooks on the denoiser's blocks, from the first wave that caches on (a stage that
        never caches keeps its blocks free of hooks, for torch.compile's sake)."""
        self._counting = True
        for block in [b for name in BLOCK_LISTS for b in getattr(self.module, name, None) or ()]:
            block.register_forward_pre_hook(self._called)
            _probe(block).register_forward_pre_hook(self._ran)

    def _called(self, module: torch.nn.Module, args: Any) -> None:
        if not self._per_request():
            self.blocks_called += 1

    def _ran(self, module: torch.nn.Module, args: Any) -> None:
        if not self._per_request():
            self.blocks_run += 1

    def _per_request(self) -> bool:
        """Whether the per-request cache is counting this call itself (a step of cached requests)."""
        return self._rows is not None and self._rows.active

    def resolve(self, value: Any) -> StepCache | None:
        """The cache a request runs with: its own ``cache`` param, else the stage's default.
        Raises InvalidRequestError for one this stage cannot run."""
        try:
            requested = parse_cache(value)
        except Exception as e:
            raise InvalidRequestError(f"invalid sampling param `cache`: {e}", param="cache") from None
        if requested == "off":
            return None
        if requested is None:
            return self.default
        if self.unsupported is not None:
            raise InvalidRequestError(f"invalid sampling param `cache`: {self.unsupported}", param="cache")
        if cache_type(requested) in REFUSED_CACHE_TYPES:
            raise InvalidRequestError(
                f"invalid sampling param `cache.type`: {REFUSED_CACHE_TYPES[cache_type(requested)]}", param="cache"
            )
        return requested

    def use(self, cache: StepCache | None, steps: int) -> None:
        """Hooks set for a wave of ``steps`` steps with ``cache`` (None: no caching), their state reset."""
        wanted = (cache, steps) if cache is not None else None
        if cache is not None and not self._counting:
            self._count_blocks()
        if wanted != self._applied:
            if self._applied is not None:
                self.module.disable_cache()
                self._applied = None
            if cache is not None:
                self.module.enable_cache(self._diffusers_config(cache, steps))
                self._applied = wanted
        if self._applied is not None:
            # A wave starts from no cached residual: nothing of the previous wave's images leaks in.
            self.module._reset_stateful_cache()

    def _diffusers_config(self, cache: StepCache, steps: int) -> Any:
        from diffusers.hooks import (
            FirstBlockCacheConfig,
            MagCacheConfig,
            PyramidAttentionBroadcastConfig,
            TaylorSeerCacheConfig,
        )

        if isinstance(cache, FirstBlockCache):
            return FirstBlockCacheConfig(threshold=cache.threshold)
        if isinstance(cache, TaylorSeerCache):
            return TaylorSeerCacheConfig(
                cache_interval=cache.cache_interval,
                disable_cache_before_step=cache.disable_cache_before_step,
                disable_cache_after_step=cache.disable_cache_after_step,
                max_order=cache.max_order,
            )
        if isinstance(cache, MagCache):
            return MagCacheConfig(
                threshold=cache.threshold,
                max_skip_steps=cache.max_skip_steps,
                retention_ratio=cache.retention_ratio,
                num_inference_steps=steps,
                mag_ratios=list(cache.mag_ratios) if cache.mag_ratios else [1.0] * steps,
            )
        if isinstance(cache, PyramidAttentionBroadcast):
            pipe = self.pipe
            return PyramidAttentionBroadcastConfig(
                spatial_attention_block_skip_range=cache.spatial_attention_block_skip_range,
                spatial_attention_timestep_skip_range=cache.spatial_attention_timestep_skip_range,
                current_timestep_callback=lambda: pipe.current_timestep,
            )
        raise InvalidRequestError(f"cache type {cache_type(cache)!r} is not served", param="cache")

    def stats(self) -> dict[str, Any]:
        """Blocks called and run since the first wave that cached (counted from then on, cached or
        not); ``hit_rate``: the share skipped."""
        skipped = self.blocks_called - self.blocks_run
        return {
            "enabled": self.unsupported is None,
            "default": cache_type(self.default) if self.default is not None else None,
            "blocks_called": self.blocks_called,
            "blocks_run": self.blocks_run,
            "blocks_skipped": skipped,
            "hit_rate": skipped / self.blocks_called if self.blocks_called else 0.0,
        }
