"""What ``engine_args`` may ask of a diffusion stage to run faster or in less memory: step caching
(``cache``, also a request param), weight quantization (``quantization``), layerwise casting
(``layerwise_casting``) and CPU offload (``offload``).

Pure declarations and the checks that need no model, shared by the deploy config (YAML) and the
request params; :mod:`omni_runtime.stage.runners.acceleration` applies them to a loaded pipeline.
Every option is a diffusers (or torchao) feature: this module only names and bounds them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec

from omni_runtime.bounds import meta
from omni_runtime.exceptions import ConfigError
from omni_runtime.serialization import find_unencodable

_Cache = {"kw_only": True, "forbid_unknown_fields": True, "tag_field": "type", "frozen": True}
_Struct = {"kw_only": True, "forbid_unknown_fields": True}

Threshold = Annotated[float, meta("cache.threshold")]
#: A step or timestep index (the scheduler's 0..1000 scale).
Step = Annotated[int, msgspec.Meta(ge=0, le=1000)]
#: One of MagCache's ratios of consecutive steps' residual magnitudes (calibrated ones are near 1).
#: Bounded here rather than in omni_runtime.bounds, whose table bounds fields, not list items.
MagRatio = Annotated[float, msgspec.Meta(ge=0, le=10)]


class FirstBlockCache(msgspec.Struct, tag="first_block", **_Cache):
    """diffusers' ``FirstBlockCacheConfig``: when the first block's residual changed less than
    ``threshold`` (mean absolute relative change) since the last full step, the other blocks are
    skipped and their cached residual reused."""

    threshold: Threshold = 0.05


class TaylorSeerCache(msgspec.Struct, tag="taylorseer", **_Cache):
    """diffusers' ``TaylorSeerCacheConfig``: attention outputs computed every ``cache_interval``
    steps and predicted by a Taylor expansion (of ``max_order``) in between."""

    cache_interval: Annotated[int, meta("cache.cache_interval")] = 5
    #: Steps run in full before any prediction (the first steps change the image most).
    disable_cache_before_step: Annotated[int, meta("cache.disable_cache_before_step")] = 3
    #: Steps from this one on run in full again; null: none.
    disable_cache_after_step: Annotated[int, meta("cache.disable_cache_after_step")] | None = None
    max_order: Annotated[int, meta("cache.max_order")] = 1


class MagCache(msgspec.Struct, tag="mag", **_Cache):
    """diffusers' ``MagCacheConfig``: whole steps skipped while the accumulated change predicted by
    the model's magnitude ratios stays under ``threshold``."""

    threshold: Threshold = 0.06
    #: Most steps skipped in a row.
    max_skip_steps: Annotated[int, meta("cache.max_skip_steps")] = 3
    #: Share of the first steps always run in full.
    retention_ratio: Annotated[float, meta("cache.retention_ratio")] = 0.2
    #: The model's calibrated ratio per step (diffusers interpolates them to the step count); null:
    #: ratios of 1 (no calibration: every step past the retained ones may be skipped, up to
    #: ``max_skip_steps`` in a row). Calibrate a real model with diffusers' ``calibrate=True``.
    mag_ratios: Annotated[list[MagRatio], msgspec.Meta(max_length=1000)] | None = None


class PyramidAttentionBroadcast(msgspec.Struct, tag="pab", **_Cache):
    """diffusers' ``PyramidAttentionBroadcastConfig``: a block's spatial attention is computed
    every ``spatial_attention_block_skip_range`` steps inside the timestep range and reused in
    between."""

    spatial_attention_block_skip_range: Annotated[int, meta("cache.spatial_attention_block_skip_range")] = 2
    #: Timesteps (of the scheduler's 0..1000 scale) inside which attention is reused.
    spatial_attention_timestep_skip_range: tuple[Step, Step] = (100, 800)


class FasterCache(msgspec.Struct, tag="faster", **_Cache):
    """diffusers' ``FasterCacheConfig``: declared so a YAML that names it gets a clear refusal."""

    spatial_attention_block_skip_range: Annotated[int, meta("cache.spatial_attention_block_skip_range")] = 2


StepCache = FirstBlockCache | TaylorSeerCache | MagCache | PyramidAttentionBroadcast | FasterCache
#: The cache types by their ``type`` name.
CACHE_TYPES: dict[str, type[StepCache]] = {
    "first_block": FirstBlockCache,
    "taylorseer": TaylorSeerCache,
    "mag": MagCache,
    "pab": PyramidAttentionBroadcast,
    "faster": FasterCache,
}
#: Why a declared cache type is refused (at load and per request).
REFUSED_CACHE_TYPES: dict[str, str] = {
    "faster": "FasterCache fails inside diffusers' hooks with the guidance-distilled and "
    "single-batch denoisers served here (it needs a conditional/unconditional batch); "
    "use first_block, taylorseer, mag or pab",
}


class Quantization(msgspec.Struct, **_Struct):
    """``engine_args.quantization``: weights of some components quantized at load through
    diffusers' ``PipelineQuantizationConfig`` (``pip install omni_runtime[accel]``)."""

    backend: Literal["torchao"] = "torchao"
    #: ``int8wo``: int8 weights, activations in the model dtype (CPU and GPU; about 1/4 the bytes
    #: of float32 weights). ``int8dq``: int8 weights and dynamically quantized int8 activations.
    #: ``float8wo``: float8 weights (a GPU with float8, e.g. sm89+).
    quant_type: Literal["int8wo", "int8dq", "float8wo"] = "int8wo"
    #: Pipeline components to quantize (``transformer``, ``unet``, ``text_encoder``...).
    components: Annotated[list[str], msgspec.Meta(min_length=1, max_length=16)] = msgspec.field(
        default_factory=lambda: ["transformer"]
    )


class LayerwiseCasting(msgspec.Struct, **_Struct):
    """``engine_args.layerwise_casting``: the denoiser's weights stored in ``storage_dtype`` and
    cast to ``compute_dtype`` layer by layer as each runs (diffusers' ``enable_layerwise_casting``)."""

    storage_dtype: Literal["float8_e4m3fn", "float8_e5m2", "bfloat16", "float16"] = "float8_e4m3fn"
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"


Offload = Literal["model", "sequential", "group"]
#: The denoiser's component name in each pipeline kind; what layerwise casting applies to.
DENOISER_COMPONENTS = ("transformer", "unet")


def check_acceleration(
    engine_args: Any, devices: str, at: str, source: str | None = None, step_execution: bool = False
) -> None:
    """The combinations of acceleration options that cannot work, refused before any model loads.
    ``at`` is the stage's YAML path (``stage_args[0]``); errors name the field under it."""
    cache: StepCache | None = engine_args.cache
    if cache is not None:
        if cache_type(cache) in REFUSED_CACHE_TYPES:
            reason = REFUSED_CACHE_TYPES[cache_type(cache)]
            raise ConfigError(reason, path=f"{at}.engine_args.cache.type", source=source)
        if step_execution and not isinstance(cache, FirstBlockCache | MagCache):
            raise ConfigError(
                f"step execution caches per request with first_block or mag; {cache_type(cache)} keeps its "
                "state per module (diffusers' hooks), which a step batch would share between requests; use "
                "type: first_block or mag, or drop engine_args.step_execution",
                path=f"{at}.engine_args.cache.type",
                source=source,
            )
    quant: Quantization | None = engine_args.quantization
    casting: LayerwiseCasting | None = engine_args.layerwise_casting
    if quant is not None and casting is not None:
        both = [c for c in quant.components if c in DENOISER_COMPONENTS]
        if both:
            raise ConfigError(
                f"layerwise casting applies to the denoiser, which quantization already stores as "
                f"{quant.quant_type} ({both[0]}); choose one for it",
                path=f"{at}.engine_args.layerwise_casting",
                source=source,
            )
    if quant is not None and quant.quant_type == "float8wo" and devices.startswith("cpu"):
        raise ConfigError(
            "float8 weights need a GPU with float8 (sm89+); on CPU use int8wo",
            path=f"{at}.engine_args.quantization.quant_type",
            source=source,
        )
    if engine_args.offload is not None and devices.startswith("cpu"):
        raise ConfigError(
            f"offload: {engine_args.offload} moves weights between the CPU and an accelerator; this stage "
            f"runs on {devices!r}, where the weights are in CPU memory already (set runtime.devices: cuda)",
            path=f"{at}.engine_args.offload",
            source=source,
        )
    if engine_args.offload is not None and engine_args.torch_compile:
        raise ConfigError(
            "offload moves weights at every forward, which torch.compile would recompile around; choose one",
            path=f"{at}.engine_args.offload",
            source=source,
        )


def cache_type(cache: StepCache) -> str:
    """The ``type`` name of a cache struct (its msgspec tag)."""
    return str(type(cache).__struct_config__.tag)


def parse_cache(value: Any) -> StepCache | Literal["off"] | None:
    """A request's ``cache`` param (``"off"``, a mapping with ``type``, or a struct) as a struct.
    Strict: no string for a number, no bool, NaN and infinities outside every bound. A struct is
    checked as its mapping is (its constructor checks nothing). Anything else raises
    msgspec.ValidationError, whatever the value holds."""
    if value is None or value == "off":
        return value
    if isinstance(value, FirstBlockCache | TaylorSeerCache | MagCache | PyramidAttentionBroadcast | FasterCache):
        try:
            value = msgspec.to_builtins(value)
        except TypeError as e:  # a field holding a value of no plain type
            raise msgspec.ValidationError(str(e)) from None
    try:
        return msgspec.convert(value, StepCache, strict=True)
    except UnicodeEncodeError:
        # msgspec reads a string (lax mode parses text) as UTF-8, which a lone surrogate has none
        # of: the value is malformed like any other, so the caller gets the same typed error,
        # naming where it is.
        found = find_unencodable(value)
        where, why = found if found is not None else ("", "cannot be encoded as UTF-8")
        raise msgspec.ValidationError(f"{why} - at `$.{where}`" if where else why) from None


def cache_key(value: Any) -> str:
    """A request's ``cache`` param as a batch key part: requests with different settings run apart."""
    if value is None or value == "off":
        return str(value)
    return json.dumps(msgspec.to_builtins(parse_cache(value)), sort_keys=True)
