"""The ``speech`` stage: batched text-to-speech with a transformers VITS model (``VitsModel``).

Runs in the stage worker's executor thread. One ``execute()`` synthesises a whole wave in one
batched forward: the texts are padded to the longest (with an attention mask), and every row keeps
its own speaker, its own speaking rate and its own ``torch.Generator``. ``VitsModel.forward`` takes
one speaker and one rate for the batch and draws its noise from the global RNG, so the runner walks
the model's own submodules itself (text encoder, duration predictor, flow, HiFi-GAN decoder) with
per-row values, and draws each row's noise at that row's own length from its own generator. The
decoder's convolutions are run with every padded position zeroed before each convolution, which is
what a solo run's zero padding sees: a request's audio equals its solo audio up to float round-off,
whatever it is batched with.

Outputs: one mono :class:`~omni_runtime.media.AudioItem` per request (float32 ``1 x n`` at the
model's ``sampling_rate``, cut to the request's own length), and the metrics ``seed``,
``batch_size``, ``execution_ms``, ``input_tokens`` and ``audio_samples``.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import msgspec
import numpy as np
import torch
from torch import nn

from omni_runtime.exceptions import InvalidRequestError, StageAsleepError
from omni_runtime.media import AudioItem
from omni_runtime.messages import SpeechBound, StageConstraints
from omni_runtime.models.builtin import resolve_model
from omni_runtime.params import SpeechSamplingParams, in_force, resolve_params
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.torch_common import TransformersRunner, wave_rows

#: OpenAI's voice names, in the order they are mapped onto a model's speakers: the ``i``-th is
#: the model's speaker ``i mod num_speakers`` (so the stock client's voices all work, and differ
#: from each other as far as the model has speakers).
OPENAI_VOICES = (
    "alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse", "marin", "cedar",
)  # fmt: skip
#: Longest text one request may speak, in characters after the tokenizer's clean-up.
MAX_INPUT_TOKENS = 8192
#: A token's duration is capped at this many times the longest the model gives a token of the
#: probe text at load (:meth:`SpeechRunner.token_frames`): a cap a real text rarely meets, which
#: makes the clip's length, and so its memory, bounded by its token count before it runs.
TOKEN_FRAMES_MARGIN = 1.25
#: Seeds of the probe (a stochastic duration predictor draws noise).
PROBE_SEEDS = 8


def speaker_table(config: Any) -> dict[str, int]:
    """Voice name -> speaker id of a VITS config: its ``speakers`` (``{name: id}``, written by the
    tiny builder; a checkpoint without names gets ``speaker_0``...), then OpenAI's names mapped
    onto them in turn."""
    count = max(int(getattr(config, "num_speakers", 1) or 1), 1)
    named = getattr(config, "speakers", None)
    table = {str(k): int(v) for k, v in named.items()} if isinstance(named, dict) and named else {}
    if not table:
        table = {f"speaker_{i}": i for i in range(count)}
    for i, name in enumerate(OPENAI_VOICES):
        table.setdefault(name, i % count)
    return table


@dataclass
class _Encoded:
    enc: Any
    in_mask: torch.Tensor
    speakers: torch.Tensor | None
    log_duration: torch.Tensor


@dataclass
class _Row:
    index: int
    ids: list[int]
    speaker: int
    rate: float
    seed: int
    generator: torch.Generator


class SpeechRunner(TransformersRunner):
    """Text-to-speech with any local VITS checkpoint (``VitsModel`` and its ``VitsTokenizer``)."""

    params_cls: ClassVar[type[msgspec.Struct]] = SpeechSamplingParams
    needs_model = True

    def load(self) -> None:
        from transformers import VitsModel, VitsTokenizer

        assert self.stage.model is not None  # needs_model: checked when the config is resolved
        path = resolve_model(self.stage.model)
        self.tokenizer = VitsTokenizer.from_pretrained(path, local_files_only=True)
        dtype = getattr(torch, self.stage.engine_args.dtype)
        model = VitsModel.from_pretrained(path, local_files_only=True, dtype=dtype)
        self.model = model.to(self.device).eval()
        self.sample_rate = int(self.model.config.sampling_rate)
        self.hop = int(np.prod(self.model.config.upsample_rates))
        self.speakers = speaker_table(self.model.config)
        self.bound = self._bound()

    def _bound(self) -> SpeechBound:
        tokenizer = self.tokenizer
        by_character = not (getattr(tokenizer, "phonemize", False) or getattr(tokenizer, "is_uroman", False))
        blank = bool(getattr(tokenizer, "add_blank", False))
        return SpeechBound(
            max_seconds=self.stage.engine_args.max_speech_seconds,
            token_frames=self.token_frames(),
            frame_s=self.hop / self.sample_rate,
            tokens_per_char=(2 if blank else 1) if by_character else None,
            extra_tokens=1 if blank else 0,
        )

    def token_frames(self) -> int:
        """The most frames a token may last at speed 1: the longest the model gives any token of
        its whole vocabulary, spoken as one text under a few seeds, x :data:`TOKEN_FRAMES_MARGIN`."""
        symbols = "".join(sorted(k for k in self.tokenizer.get_vocab() if len(k) == 1 and k.isprintable()))
        longest = 1.0
        for seed in range(PROBE_SEEDS):
            probe = resolve_params(SpeechSamplingParams, {}, {"seed": seed})
            row = self._new_row(0, RunnerRequest(request_id="probe", prompt=symbols or "a", params=probe))
            longest = max(longest, float(self._durations([row])[0].max()))
        return int(np.ceil(longest * TOKEN_FRAMES_MARGIN))

    def constraints(self) -> StageConstraints:
        return StageConstraints(voices=tuple(self.speakers), speech=self.bound)

    def batch_key(self, request: RunnerRequest[SpeechSamplingParams]) -> tuple[()]:
        return ()  # voice, speed and seed apply per row: every speech request can join a wave

    def execute(self, batch: list[RunnerRequest[SpeechSamplingParams]], ctx: ExecuteContext) -> list[RunnerOutput]:
        started = time.perf_counter()
        if self.model is None:
            return [RunnerOutput(error=StageAsleepError("the speech stage is asleep")) for _ in batch]
        outputs, rows = wave_rows(batch, self._new_row)
        clips = self._synthesise(rows) if rows else []
        elapsed_ms = (time.perf_counter() - started) * 1000
        for row, clip in zip(rows, clips, strict=True):
            outputs[row.index] = RunnerOutput(
                media=[AudioItem(data=clip[None, :], sample_rate=self.sample_rate, seed=row.seed)],
                metrics={
                    "seed": row.seed,
                    "batch_size": len(batch),
                    "execution_ms": elapsed_ms,
                    "input_tokens": len(row.ids),
                    "audio_samples": int(clip.shape[0]),
                },
            )
        return cast(list[RunnerOutput], outputs)  # every slot is filled above

    def _new_row(self, index: int, req: RunnerRequest[SpeechSamplingParams]) -> _Row:
        if not isinstance(req.prompt, str):
            raise InvalidRequestError(
                f"a speech stage takes a string prompt, got {type(req.prompt).__name__}", param="prompt"
            )
        # The tokenizer lower-cases and drops every character outside the model's vocabulary.
        ids = self.tokenizer(req.prompt)["input_ids"]
        if not ids:
            raise InvalidRequestError(
                "the text has no character this model can speak (it speaks: "
                f"{''.join(sorted(k for k in self.tokenizer.get_vocab() if len(k) == 1))!r})",
                param="prompt",
            )
        if len(ids) > MAX_INPUT_TOKENS:
            raise InvalidRequestError(
                f"the text is {len(ids)} tokens, more than the {MAX_INPUT_TOKENS} one request may speak",
                param="prompt",
            )
        p = req.params
        voice = p.voice
        if voice is None:
            speaker = 0
        elif voice in self.speakers:
            speaker = self.speakers[voice]
        else:  # a caller that skipped the constraints check (READY lists the voices)
            raise InvalidRequestError(f"invalid sampling param `voice`: unknown voice {voice[:64]!r}", param="voice")
        seed = p.seed if p.seed is not None else secrets.randbits(63)
        rate = float(in_force(p.speed))
        bound = getattr(self, "bound", None)  # None while the bound itself is probed at load
        if bound is not None and bound.longest_s(len(ids), rate) > bound.max_seconds:
            # A caller's check counts characters; the tokens can be more (a romanizing tokenizer).
            param = "speed" if bound.longest_s(len(ids), 1.0) <= bound.max_seconds else "prompt"
            raise InvalidRequestError(
                f"invalid sampling param `{param}`: {len(ids)} tokens at speed {rate:g} could make "
                f"{bound.longest_s(len(ids), rate):.0f} s of audio, more than the {bound.max_seconds:g} s "
                "one request may make (engine_args.max_speech_seconds); split the text",
                param=param,
            )
        return _Row(
            index=index,
            ids=ids,
            speaker=speaker,
            rate=rate,
            seed=seed,
            generator=torch.Generator(device=self.device).manual_seed(seed),
        )

    @torch.inference_mode()
    def _encode(self, rows: list[_Row]) -> _Encoded:
        """Steps 1-2 of a forward: the padded batch, its encoding and each token's log duration
        (in frames, at speed 1)."""
        model, cfg = self.model, self.model.config
        dtype = model.text_encoder.embed_tokens.weight.dtype
        # 1) right-pad the texts into one batch, with their attention mask
        width = max(len(r.ids) for r in rows)
        ids = torch.full((len(rows), width), int(cfg.pad_token_id or 0), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, : len(row.ids)] = torch.tensor(row.ids)
            mask[b, : len(row.ids)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        in_mask = mask.unsqueeze(1).to(dtype)  # (B, 1, L)
        speakers = None
        if cfg.num_speakers > 1:
            speaker_ids = torch.tensor([r.speaker for r in rows], device=self.device)
            speakers = model.embed_speaker(speaker_ids).unsqueeze(-1)  # (B, E, 1)
        # 2) encode the text; predict each token's duration
        enc = model.text_encoder(
            input_ids=ids, padding_mask=in_mask.transpose(1, 2), attention_mask=mask, return_dict=True
        )
        hidden = enc.last_hidden_state.transpose(1, 2)
        log_duration = self._log_duration(hidden, in_mask, speakers, rows)
        return _Encoded(enc=enc, in_mask=in_mask, speakers=speakers, log_duration=log_duration)

    def _durations(self, rows: list[_Row]) -> torch.Tensor:
        """Each token's predicted duration in frames at speed 1, uncapped (B, 1, L; padding 0)."""
        encoded = self._encode(rows)
        return torch.exp(encoded.log_duration) * encoded.in_mask

    @torch.inference_mode()
    def _synthesise(self, rows: list[_Row]) -> list[np.ndarray]:
        """One batched forward over ``rows``; each row's mono float32 samples at its own length."""
        model = self.model
        dtype = model.text_encoder.embed_tokens.weight.dtype
        encoded = self._encode(rows)
        enc, in_mask, speakers = encoded.enc, encoded.in_mask, encoded.speakers
        width = in_mask.shape[2]
        # Each token's duration, capped (the bound every request was checked against), then
        # divided by the row's own rate.
        rates = torch.tensor([r.rate for r in rows], dtype=dtype, device=self.device).view(-1, 1, 1)
        durations = torch.clamp(torch.exp(encoded.log_duration), max=float(self.bound.token_frames))
        duration = torch.ceil(durations * in_mask / rates)
        frames = torch.clamp_min(duration.sum([1, 2]), 1).long()
        # 3) align: expand each token's prior over its frames (the model's own monotonic path)
        total = int(frames.max())
        positions = torch.arange(total, device=self.device)
        out_mask = (positions.unsqueeze(0) < frames.unsqueeze(1)).unsqueeze(1).to(dtype)  # (B, 1, T)
        path_mask = in_mask.unsqueeze(-1) * out_mask.unsqueeze(2)  # (B, 1, L, T)
        ends = torch.cumsum(duration, -1).view(len(rows) * width, 1)
        covered = (positions.to(dtype).unsqueeze(0) < ends).to(dtype).view(len(rows), width, total)
        path = (covered - nn.functional.pad(covered, [0, 0, 1, 0, 0, 0])[:, :-1]).unsqueeze(1) * path_mask
        path = path.squeeze(1).transpose(1, 2)  # (B, T, L)
        means = torch.matmul(path, enc.prior_means).transpose(1, 2)
        log_variances = torch.matmul(path, enc.prior_log_variances).transpose(1, 2)
        # 4) each row's noise from its own generator, at its own length (padding stays zero)
        noise = torch.zeros_like(means)
        for b, row in enumerate(rows):
            n = int(frames[b])
            noise[b, :, :n] = torch.randn((means.shape[1], n), generator=row.generator, device=self.device, dtype=dtype)
        latents = means + noise * torch.exp(log_variances) * model.noise_scale
        # 5) the flow back to a spectrogram, then the vocoder, padding zeroed as a solo run sees it
        spectrogram = model.flow(latents, out_mask, speakers, reverse=True) * out_mask
        waveform = self._decode(spectrogram, out_mask, speakers)
        return [
            waveform[b, : int(frames[b]) * self.hop].float().cpu().numpy().astype(np.float32) for b in range(len(rows))
        ]

    def _log_duration(
        self, hidden: torch.Tensor, in_mask: torch.Tensor, speakers: torch.Tensor | None, rows: list[_Row]
    ) -> torch.Tensor:
        """Each token's log duration in frames. A stochastic predictor's noise is drawn per row
        from the row's generator (the model's own forward draws it from the global RNG)."""
        model, cfg = self.model, self.model.config
        predictor = model.duration_predictor
        if not cfg.use_stochastic_duration_prediction:
            return cast(torch.Tensor, predictor(hidden, in_mask, speakers))
        # The reverse pass of VitsStochasticDurationPredictor, with the noise drawn per row.
        inputs = predictor.conv_pre(hidden)
        if speakers is not None:
            inputs = inputs + predictor.cond(speakers)
        inputs = predictor.conv_dds(inputs, in_mask)
        inputs = predictor.conv_proj(inputs) * in_mask
        flows = list(reversed(predictor.flows))
        flows = [*flows[:-2], flows[-1]]  # the model drops the same unused flow
        latents = torch.zeros((len(rows), 2, hidden.shape[2]), dtype=hidden.dtype, device=hidden.device)
        for b, row in enumerate(rows):
            n = len(row.ids)
            latents[b, :, :n] = torch.randn((2, n), generator=row.generator, device=self.device, dtype=hidden.dtype)
        latents = latents * model.noise_scale_duration
        for flow in flows:
            latents = torch.flip(latents, [1])
            latents, _ = flow(latents, in_mask, global_conditioning=inputs, reverse=True)
        return torch.split(latents, [1, 1], dim=1)[0]

    def _decode(self, spectrogram: torch.Tensor, mask: torch.Tensor, speakers: torch.Tensor | None) -> torch.Tensor:
        """The HiFi-GAN decoder's forward with the padding zeroed before every convolution, so a
        row's last samples see zeros past its end, as its solo run's zero padding (the model's own
        forward lets the padding's activations leak into them)."""
        decoder, slope = self.model.decoder, self.model.config.leaky_relu_slope
        hidden = decoder.conv_pre(spectrogram)
        if speakers is not None:
            hidden = hidden + decoder.cond(speakers)
        for i in range(decoder.num_upsamples):
            hidden = nn.functional.leaky_relu(hidden, slope) * mask
            hidden = decoder.upsampler[i](hidden)
            mask = mask.repeat_interleave(decoder.upsampler[i].stride[0], dim=-1)[..., : hidden.shape[-1]]
            total = None
            for j in range(decoder.num_kernels):
                block = decoder.resblocks[i * decoder.num_kernels + j]
                state = hidden
                for conv1, conv2 in zip(block.convs1, block.convs2, strict=True):
                    step = conv1(nn.functional.leaky_relu(state, block.leaky_relu_slope) * mask)
                    step = conv2(nn.functional.leaky_relu(step, block.leaky_relu_slope) * mask)
                    state = step + state
                total = state if total is None else total + state
            assert total is not None  # a decoder has at least one kernel
            hidden = total / decoder.num_kernels
        hidden = decoder.conv_post(nn.functional.leaky_relu(hidden) * mask)
        return torch.tanh(hidden).squeeze(1)
