"""``engine_args.load_format: dummy``: a diffusers pipeline whose model components are built from
their configs with random (seeded) weights instead of read from weight files.

Every ``torch.nn.Module`` component that ``model_index.json`` lists is constructed right on the
stage's device in the stage's dtype (the default device and dtype set around its constructor), so a
12B transformer never exists in float32 in CPU memory and the build takes seconds on a GPU; the
schedulers and tokenizers load from their files as usual. A model directory of configs only (no
weight file) is enough: what benchmarks of full-size shapes need, as vLLM's ``--load-format dummy``.
Runs in the stage process at load (and in benchmarks that call a pipeline directly).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from omni_runtime.config import EngineArgs
from omni_runtime.exceptions import ConfigError
from omni_runtime.models.components import seeded
from omni_runtime.stage.runners.acceleration import check_components, quantize_components

#: Seed of the first component; the n-th (in ``model_index.json``'s name order) gets ``SEED + n``,
#: so two loads of one directory build equal weights.
SEED = 0


def dummy_pipeline(pipeline_cls: Any, model_dir: str, args: EngineArgs, device: str) -> Any:
    """The pipeline of ``model_dir`` with random weights built on ``device`` in ``args.dtype``, its
    ``args.quantization`` components quantized (torchao, as the load of real weights does)."""
    dtype = getattr(torch, args.dtype)
    with open(os.path.join(model_dir, "model_index.json")) as f:
        index = json.load(f)
    modules: dict[str, torch.nn.Module] = {}
    for n, name in enumerate(sorted(index)):
        entry = index[name]
        # Keys such as ``_class_name`` or ``force_zeros_for_empty_prompt`` are pipeline settings,
        # and ``[null, null]`` an optional component the model leaves out.
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or None in entry:
            continue
        cls = component_class(*entry)
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            modules[name] = seeded(
                SEED + n, functools.partial(_build, cls, os.path.join(model_dir, name), dtype, device)
            )
    if pipeline_cls.__name__ == "DiffusionPipeline":
        # DiffusionPipeline.from_pretrained looks up optional components in its own (empty) list, and
        # would read a module passed for one (Wan's transformer) from its file: load the named class.
        pipeline_cls = component_class("diffusers", index["_class_name"])
    # The modules passed in are taken as they are; from_pretrained reads only the other components.
    pipe = pipeline_cls.from_pretrained(model_dir, local_files_only=True, **modules)
    check_components(pipe, args)
    quantize_components(pipe, args)
    return pipe


def component_class(library: str, class_name: str) -> Any:
    """The class a ``model_index.json`` entry names: ``["diffusers", "AutoencoderKL"]``, or a module
    of a diffusers pipeline package (``["stable_diffusion", "StableDiffusionSafetyChecker"]``)."""
    for module in (library, f"diffusers.pipelines.{library}"):
        try:
            return getattr(importlib.import_module(module), class_name)
        except (ImportError, AttributeError):
            continue
    raise ConfigError(f"model_index.json names {library}.{class_name}, which cannot be imported")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _build(cls: Any, folder: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """One model component from the config in ``folder``, its tensors made on ``device`` in ``dtype``,
    except those its library keeps in float32 when it loads real weights."""
    from diffusers import ModelMixin

    with torch.device(device), _default_dtype(dtype):
        if issubclass(cls, ModelMixin):  # its config.json holds its init arguments
            model = cls.from_config(cls.load_config(folder))
            # diffusers keeps these in float32 whatever the dtype asked for.
            keep = list(getattr(cls, "_keep_in_fp32_modules", None) or ())
        else:  # a transformers model
            model = cls._from_config(cls.config_class.from_pretrained(folder), dtype=dtype)
            # transformers keeps ``_keep_in_fp32_modules`` for float16 only, the strict list for both halves.
            keep = list(getattr(cls, "_keep_in_fp32_modules_strict", None) or ()) if dtype != torch.float32 else []
            if dtype == torch.float16:
                keep += list(getattr(cls, "_keep_in_fp32_modules", None) or ())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if keep and tensor.is_floating_point() and any(k in name.split(".") for k in keep):
            tensor.data = tensor.data.float()
    return model.eval()
