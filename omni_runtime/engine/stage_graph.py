"""The stage graph of a resolved config: which stage feeds which, the stages a request needs for
its final outputs, and a stage's input made from its upstream outputs.

A stage's input is made by its input function (``custom_process_input_func``, see
:mod:`omni_runtime.input_funcs`) when it has one; otherwise by the default mapping: upstream text
becomes the prompt (and ``inputs["text"]``), tensors pass by name, images as ``inputs["images"]``.
Pure, and fixed once made: the orchestrator routes by it, in its thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from omni_runtime.config import InputChunking, StageConfig
from omni_runtime.media import MediaItem, items_of
from omni_runtime.messages import StageOutput
from omni_runtime.resolve import ResolvedConfig


class StageGraph:
    """The stages of a config as a graph (``engine_input_source`` edges)."""

    def __init__(self, resolved: ResolvedConfig) -> None:
        config = resolved.config
        self._stages: dict[int, StageConfig] = {s.stage_id: s for s in config.stage_args}
        #: Stage id -> the stages that take its output, in config order.
        self.downstream: dict[int, list[int]] = {sid: [] for sid in self._stages}
        for s in config.stage_args:
            for src in s.engine_input_source:
                self.downstream[src].append(s.stage_id)
        #: Stage id -> its input function, for the stages that have one.
        self.input_funcs = {s.stage_id: s.input_func for s in resolved.stages if s.input_func is not None}
        #: The chunked stages (``input_chunking``): stage id -> its policy.
        self.chunked: dict[int, InputChunking] = {
            s.stage_id: s.input_chunking for s in config.stage_args if s.input_chunking is not None
        }
        #: Stage id -> the chunked stages that take its output.
        self._chunked_downstream = {
            sid: [d for d in downs if d in self.chunked] for sid, downs in self.downstream.items()
        }

    def stage(self, stage_id: int) -> StageConfig:
        return self._stages[stage_id]

    def needed(self, finals: Iterable[int]) -> set[int]:
        """The stages that run for these final stages: they and every stage upstream of them."""
        needed: set[int] = set()
        todo = list(finals)
        while todo:
            sid = todo.pop()
            if sid not in needed:
                needed.add(sid)
                todo.extend(self._stages[sid].engine_input_source)
        return needed

    def fed_by(self, stage_id: int) -> set[int]:
        """The stages downstream of ``stage_id``, however far."""
        fed: set[int] = set()
        todo = [stage_id]
        while todo:
            for down in self.downstream[todo.pop()]:
                if down not in fed:
                    fed.add(down)
                    todo.append(down)
        return fed

    def chunk_consumers(self, stage_id: int, finals: Iterable[int]) -> list[int]:
        """The chunked stages that take ``stage_id``'s streamed output and run for these finals."""
        downs = self._chunked_downstream[stage_id]
        if not downs:
            return []
        needed = self.needed(finals)
        return [d for d in downs if d in needed]

    def sources(self, needed: set[int]) -> list[int]:
        """The stages among ``needed`` that take the caller's prompt (no upstream), in config order."""
        return [sid for sid, s in self._stages.items() if sid in needed and not s.engine_input_source]

    def sole_taker(self, consumers: list[int]) -> int | None:
        """The one stage of ``consumers`` when it takes an upstream output unchanged (no input
        function, not chunked): to it an output may go on as it is (arrays left where they are)."""
        if len(consumers) != 1 or consumers[0] in self.input_funcs or consumers[0] in self.chunked:
            return None
        return consumers[0]

    def input(self, stage_id: int, prompt: Any, upstream: Mapping[int, StageOutput]) -> tuple[Any, dict[str, Any]]:
        """The stage's (prompt, inputs) from its upstream outputs (by stage id) and the caller's prompt."""
        func = self.input_funcs.get(stage_id)
        if func is not None:
            result = func(
                prompt,
                {
                    sid: {"text": o.payload.text, "images": _arrays(o.payload.media), "tensors": o.payload.tensors}
                    for sid, o in upstream.items()
                },
            )
            return result.get("prompt", prompt), dict(result.get("inputs", {}))
        # Default: upstream text becomes the prompt; tensors pass through by name.
        inputs: dict[str, Any] = {}
        texts = []
        for o in upstream.values():
            inputs.update(o.payload.tensors)
            images = _arrays(o.payload.media)
            if images:
                inputs["images"] = images
            if o.payload.text is not None:
                texts.append(o.payload.text)
        if texts:
            inputs["text"] = "\n".join(texts)
            return inputs["text"], inputs
        return prompt, inputs


def _arrays(media: list[MediaItem]) -> list[Any]:
    """The arrays of the images among ``media``: what a downstream stage and an input function
    get as ``inputs["images"]`` / ``upstream[sid]["images"]``."""
    return [m.data for m in items_of(media, "image")]
