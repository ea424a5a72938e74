"""The ``transcribe`` stage: batched speech recognition with a transformers Whisper model
(``WhisperForConditionalGeneration``, its ``WhisperFeatureExtractor`` and tokenizer).

Runs in the stage worker's executor thread. A request's audio comes in its params (float32 mono
at ``sample_rate``, checked and bounded in the caller's thread: :mod:`omni_runtime.audio_input`).
One ``execute()`` resamples each clip to the model's rate, makes the whole wave's log-mel features
in one call (padded to the model's window), runs the encoder once, then decodes greedily, one
token per row per forward against the cache, each row to its end-of-text or its own
``max_transcript_tokens``; an aborted row leaves the batch at the next token.

A request without audio hears nothing: its transcript is empty and it costs no forward. A
pipeline that starts with this stage thus still answers text prompts
(:func:`omni_runtime.input_funcs.prompt_then_transcript` puts the caller's prompt before the
transcript).

Outputs: the transcript as the request's ``text``, and the metrics ``batch_size``,
``execution_ms``, ``audio_seconds`` and ``transcript_tokens``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import msgspec
import numpy as np
import torch

from omni_runtime.audio_input import DEFAULT_INPUT_RATE
from omni_runtime.encoders import resample
from omni_runtime.exceptions import StageAsleepError
from omni_runtime.messages import StageConstraints
from omni_runtime.models.builtin import resolve_model
from omni_runtime.params import TranscriptionSamplingParams, in_force
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.torch_common import TransformersRunner, live_rows


@dataclass
class _Row:
    index: int
    request_id: str
    samples: np.ndarray
    max_tokens: int
    tokens: list[int]
    done: bool = False
    error: BaseException | None = None


class TranscribeRunner(TransformersRunner):
    """Speech recognition with any local Whisper checkpoint (model, feature extractor, tokenizer)."""

    params_cls: ClassVar[type[msgspec.Struct]] = TranscriptionSamplingParams
    needs_model = True

    def load(self) -> None:
        from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration, WhisperTokenizer

        assert self.stage.model is not None  # needs_model: checked when the config is resolved
        path = resolve_model(self.stage.model)
        self.features = WhisperFeatureExtractor.from_pretrained(path, local_files_only=True)
        self.tokenizer = WhisperTokenizer.from_pretrained(path, local_files_only=True)
        dtype = getattr(torch, self.stage.engine_args.dtype)
        model = WhisperForConditionalGeneration.from_pretrained(path, local_files_only=True, dtype=dtype)
        self.model = model.to(self.device).eval()
        gen = self.model.generation_config
        self.start_id = int(gen.decoder_start_token_id)
        eos = gen.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.suppress = torch.tensor(list(gen.suppress_tokens or []), dtype=torch.long, device=self.device)
        self.sample_rate = int(self.features.sampling_rate)
        # The encoder takes exactly its window of features; longer audio would be cut, so it is
        # refused before it is queued.
        self.window_s = float(self.features.n_samples) / self.sample_rate

    def constraints(self) -> StageConstraints:
        return StageConstraints(
            max_input_audio_s=self.window_s, input_audio_reason="the speech-recognition model's window"
        )

    def profile_request(self) -> RunnerRequest:
        silence = np.zeros(self.sample_rate, dtype=np.float32)
        return self._default_request("", audio=silence, sample_rate=self.sample_rate)

    def batch_key(self, request: RunnerRequest) -> tuple[()]:
        return ()  # every clip is padded to the model's window: any requests can share a wave

    def execute(
        self, batch: list[RunnerRequest[TranscriptionSamplingParams]], ctx: ExecuteContext
    ) -> list[RunnerOutput]:
        started = time.perf_counter()
        if self.model is None:
            return [RunnerOutput(error=StageAsleepError("the transcribe stage is asleep")) for _ in batch]
        outputs: list[RunnerOutput | None] = [None] * len(batch)
        rows = []
        for i, req in enumerate(batch):
            p = req.params
            if p.audio is None:
                outputs[i] = RunnerOutput(text="", metrics={"audio_seconds": 0.0, "transcript_tokens": 0})
                continue
            rate = int(p.sample_rate or DEFAULT_INPUT_RATE)
            mono = np.asarray(p.audio, dtype=np.float32).reshape(-1, 1)
            samples = resample(mono, rate, self.sample_rate)[:, 0]
            rows.append(_Row(i, req.request_id, samples, int(in_force(p.max_transcript_tokens)), []))
        if rows:
            self._transcribe(rows, ctx)
        elapsed_ms = (time.perf_counter() - started) * 1000
        for row in rows:
            outputs[row.index] = RunnerOutput(
                text=self.tokenizer.decode(row.tokens, skip_special_tokens=True),
                error=row.error,
                metrics={
                    "batch_size": len(batch),
                    "execution_ms": elapsed_ms,
                    "audio_seconds": len(row.samples) / self.sample_rate,
                    "transcript_tokens": len(row.tokens),
                },
            )
        return cast(list[RunnerOutput], outputs)  # every slot is filled above

    @torch.inference_mode()
    def _transcribe(self, rows: list[_Row], ctx: ExecuteContext) -> None:
        from transformers.modeling_outputs import BaseModelOutput

        # 1) the wave's log-mel features, each clip padded to the window, then one encoder forward
        feats = self.features(
            [r.samples for r in rows], sampling_rate=self.sample_rate, return_tensors="pt"
        ).input_features
        dtype = self.model.model.encoder.conv1.weight.dtype
        encoded = self.model.model.encoder(input_features=feats.to(self.device, dtype)).last_hidden_state
        ids = torch.full((len(rows), 1), self.start_id, dtype=torch.long, device=self.device)
        cache: Any = None
        active = list(rows)
        while active:
            # 2) drop aborted rows before paying for their forward
            keep = live_rows(active, ctx)
            if not keep:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=self.device)
                active = [active[b] for b in keep]
                ids, encoded = ids[idx], encoded[idx]
                if cache is not None:
                    cache.batch_select_indices(idx)
            # 3) one decoder forward: one token per row against the cache
            out = self.model(
                encoder_outputs=BaseModelOutput(last_hidden_state=encoded),
                decoder_input_ids=ids,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
            if self.suppress.numel():
                logits[:, self.suppress] = float("-inf")
            picked = logits.argmax(-1).tolist()
            # 4) each row's token; a row ends at end-of-text or its own token limit
            for row, token in zip(active, picked, strict=True):
                if token in self.eos_ids:
                    row.done = True
                    continue
                row.tokens.append(int(token))
                row.done = len(row.tokens) >= row.max_tokens
            ids = torch.tensor(picked, device=self.device).unsqueeze(1)
