"""A Qwen-Omni speech pipeline as three stages: ``omni_thinker`` -> ``omni_talker`` -> ``omni_code2wav``.

Each runs in its own stage worker's executor thread, on one part of a Qwen2.5-Omni checkpoint
(``model:`` names the checkpoint's directory, holding ``thinker/``, ``talker/`` and ``token2wav/``;
or the part's own directory):

- ``omni_thinker``: the text stage's generation on ``Qwen2_5OmniThinkerForConditionalGeneration``
  (text in, text deltas out). Its final output also carries what the talker reads: per position,
  the token's input embedding plus the last layer's state, for the prompt and for the reply, the
  ids, and the embeddings of the talker's three text markers (start, end, pad).
- ``omni_talker``: ``Qwen2_5OmniTalkerForConditionalGeneration`` generates codec codes, one per
  step, conditioned on the prompt's states and fed one reply state per step (then the end marker,
  then pads), as the model's own ``generate`` does. It streams ``tensors={"codes": ...}`` deltas
  (only the new codes, along axis 0) and ends with all of them.
- ``omni_code2wav``: ``Qwen2_5OmniToken2WavModel`` turns codes into a mono waveform: its DiT solves
  a mel spectrogram from seeded noise, conditioned on the voice, and BigVGAN renders it. It takes
  all of a request's codes at once, or one chunk of them (``inputs["chunk_index"]``,
  ``inputs["last_chunk"]``) and returns that chunk's audio.

The talker and the decoder keep no state between requests; a chunk's audio depends on the chunk's
codes, the voice and the seed only (so it equals decoding those codes alone). It does not equal the
matching stretch of the whole-codes audio: the DiT attends a block ahead and behind, BigVGAN's
convolutions see past both ends, and the noise of each decode starts at its own first frame.
"""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import numpy as np
import torch

from omni_runtime.exceptions import InvalidRequestError, RequestAbortedError, StageAsleepError
from omni_runtime.media import AudioItem
from omni_runtime.messages import StageConstraints
from omni_runtime.models.builtin import resolve_model
from omni_runtime.params import Code2WavSamplingParams, TalkerSamplingParams, in_force
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.speech import speaker_table
from omni_runtime.stage.runners.text import TextRunner
from omni_runtime.stage.runners.torch_common import TransformersRunner

#: What the thinker hands the talker (``RunnerOutput.tensors`` names).
PROMPT_IDS = "thinker_prompt_ids"
PROMPT_STATES = "thinker_prompt_states"
REPLY_IDS = "thinker_reply_ids"
REPLY_STATES = "thinker_reply_states"
#: The thinker's embeddings of the talker's text start, end and pad markers, ``3 x hidden``.
MARKER_EMBEDS = "tts_text_embeds"
THINKER_TENSORS = (PROMPT_IDS, PROMPT_STATES, REPLY_IDS, REPLY_STATES, MARKER_EMBEDS)
#: The codes the talker streams and the decoder reads.
CODES = "codes"


#: Held while a stage of this module loads. Stages of one process (the inproc backend) load in
#: threads at once, and transformers imported from several threads at once can see its own
#: modules half-initialised (its lazy top level and circular imports): one load at a time, each
#: sees them whole. A load is a fraction of a second, so little is lost.
_LOAD_LOCK = threading.Lock()


def _omni_modeling() -> Any:
    """transformers' Qwen2.5-Omni modeling module; the classes are read from it, not from the
    package's lazy top level."""
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni

    return modeling_qwen2_5_omni


def part_dir(model: str, part: str) -> str:
    """The directory of one part: ``<checkpoint>/<part>`` when the checkpoint has it, else the
    directory named (a part saved on its own)."""
    root = Path(resolve_model(model))
    return str(root / part if (root / part).is_dir() else root)


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator) -> int:
    """One token from ``logits`` (1-D): greedy at temperature 0, else from top-k / top-p.

    ``argmax(p / E)`` with ``E ~ Exp(1)`` is a draw from ``p``, one number per vocabulary entry
    from the request's own generator: the draws do not depend on anything else in the process."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        logits[logits < torch.topk(logits, top_k).values[-1]] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        probs[order[sorted_probs.cumsum(-1) - sorted_probs >= top_p]] = 0.0
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


class ThinkerRunner(TextRunner):
    """The text stage on a Qwen2.5-Omni thinker, whose final output also carries the states the
    talker conditions on (computed in one forward over prompt and reply once the text is done)."""

    def load(self) -> None:
        with _LOAD_LOCK:
            self._load()

    def _load(self) -> None:
        from transformers import AutoTokenizer

        modeling = _omni_modeling()
        assert self.stage.model is not None  # needs_model: checked when the config is resolved
        path = part_dir(self.stage.model, "thinker")
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.tokenizer.padding_side = "left"
        dtype = getattr(torch, self.stage.engine_args.dtype)
        thinker_cls = modeling.Qwen2_5OmniThinkerForConditionalGeneration
        model = thinker_cls.from_pretrained(path, local_files_only=True, dtype=dtype)
        self.model = model.to(self.device).eval()
        self._read_decoding_settings()  # the text runner's, from the thinker's generation config
        self.max_positions = self.model.config.text_config.max_position_embeddings
        talker_cfg = Path(part_dir(self.stage.model, "talker")) / "config.json"
        self.marker_ids = self._marker_ids(talker_cfg)
        # request id -> its prompt ids and the tokens picked so far (this wave only).
        self._prompts: dict[str, list[int]] = {}
        self._picked: dict[str, list[int]] = {}

    @staticmethod
    def _marker_ids(talker_config: Path) -> list[int]:
        """The thinker ids of the talker's text start, end and pad markers, from the talker's config."""
        import json

        cfg = json.loads(talker_config.read_text()) if talker_config.is_file() else {}
        names = ("tts_text_start_token_id", "tts_text_end_token_id", "tts_text_pad_token_id")
        defaults = (151860, 151861, 151859)  # Qwen2.5-Omni's
        return [int(cfg.get(n, d)) for n, d in zip(names, defaults, strict=True)]

    def step_support(self) -> str | None:
        return "the thinker hands its states on per wave, so it runs whole waves"

    def _new_row(self, index: int, req: RunnerRequest) -> Any:
        row = super()._new_row(index, req)
        self._prompts[req.request_id] = list(row.prompt_ids)
        self._picked[req.request_id] = []
        return row

    def _pick(self, logits: torch.Tensor, row: Any) -> int:  # type: ignore[override]
        token = TextRunner._pick(logits, row)
        self._picked[row.request_id].append(token)
        return token

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        try:
            outputs = super().execute(batch, ctx)
            for req, out in zip(batch, outputs, strict=True):
                if out.error is None and req.request_id in self._prompts:
                    out.tensors.update(self._states(self._prompts[req.request_id], self._picked[req.request_id]))
            return outputs
        finally:
            for req in batch:
                self._prompts.pop(req.request_id, None)
                self._picked.pop(req.request_id, None)

    @torch.inference_mode()
    def _states(self, prompt_ids: list[int], picked: list[int]) -> dict[str, np.ndarray]:
        """What the talker reads: each position's input embedding plus its last-layer state (the
        model's own hand-off), for the prompt and the reply up to its first end token."""
        reply = []
        for token in picked:
            if token in self.eos_ids:
                break
            reply.append(token)
        ids = torch.tensor([prompt_ids + reply], device=self.device)
        out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
        states = (out.hidden_states[0] + out.hidden_states[-1])[0].float().cpu().numpy()
        embed = self.model.get_input_embeddings()
        markers = embed(torch.tensor(self.marker_ids, device=self.device)).float().cpu().numpy()
        n = len(prompt_ids)
        return {
            PROMPT_IDS: np.asarray(prompt_ids, dtype=np.int64),
            PROMPT_STATES: states[:n],
            REPLY_IDS: np.asarray(reply, dtype=np.int64),
            REPLY_STATES: states[n:],
            MARKER_EMBEDS: markers,
        }


class TalkerRunner(TransformersRunner):
    """Codec codes from a thinker's states with a Qwen2.5-Omni talker, streamed as they come.

    The requests of a wave are decoded one after another: the talker model keeps its position
    offset on itself between steps (``rope_deltas``), so two requests cannot share its forward."""

    params_cls: ClassVar[type[msgspec.Struct]] = TalkerSamplingParams
    needs_model = True

    def load(self) -> None:
        with _LOAD_LOCK:
            self._load()

    def _load(self) -> None:
        modeling = _omni_modeling()
        assert self.stage.model is not None
        path = part_dir(self.stage.model, "talker")
        dtype = getattr(torch, self.stage.engine_args.dtype)
        talker_cls = modeling.Qwen2_5OmniTalkerForConditionalGeneration
        model = talker_cls.from_pretrained(path, local_files_only=True, dtype=dtype)
        self.model = model.to(self.device).eval()
        cfg = self.model.config
        self.eos = int(cfg.tts_codec_end_token_id)
        self.text_start = int(cfg.tts_text_start_token_id)
        specials = [cfg.tts_codec_pad_token_id, cfg.tts_codec_start_token_id, self.eos, cfg.tts_codec_mask_token_id]
        # Codes below the first special token are sounds; every other id but the end is never
        # generated (a trained talker does not pick them; a random one would).
        self.sounds = min(specials)
        never = [i for i in range(self.sounds, cfg.vocab_size) if i != self.eos]
        self.suppress = torch.tensor(never, dtype=torch.long, device=self.device)

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        if self.model is None:
            return [RunnerOutput(error=StageAsleepError("the talker stage is asleep")) for _ in batch]
        outputs = []
        for req in batch:
            started = time.perf_counter()
            try:
                out = self._talk(req, ctx)
            except InvalidRequestError as e:  # this request alone fails; the others go on
                out = RunnerOutput(error=e)
            out.metrics.update({"batch_size": len(batch), "execution_ms": (time.perf_counter() - started) * 1000})
            outputs.append(out)
        return outputs

    @staticmethod
    def _thinker_inputs(req: RunnerRequest) -> dict[str, np.ndarray]:
        missing = [k for k in THINKER_TENSORS if k not in req.inputs]
        if missing:
            raise InvalidRequestError(
                f"a talker stage reads a thinker's output; missing {', '.join(missing)}", param="inputs"
            )
        arrays = {k: np.asarray(req.inputs[k]) for k in THINKER_TENSORS}
        hidden = arrays[PROMPT_STATES].shape[-1] if arrays[PROMPT_STATES].ndim == 2 else -1
        if (
            hidden < 1
            or arrays[REPLY_STATES].shape[-1:] != (hidden,)
            or arrays[MARKER_EMBEDS].shape != (3, hidden)
            or arrays[PROMPT_IDS].shape != (len(arrays[PROMPT_STATES]),)
            or arrays[REPLY_IDS].shape != (len(arrays[REPLY_STATES]),)
            or len(arrays[PROMPT_IDS]) == 0
        ):
            raise InvalidRequestError("the thinker's states have mismatched shapes", param="inputs")
        return arrays

    @torch.inference_mode()
    def _talk(self, req: RunnerRequest[TalkerSamplingParams], ctx: ExecuteContext) -> RunnerOutput:
        arrays = self._thinker_inputs(req)
        p = req.params
        seed = p.seed if p.seed is not None else secrets.randbits(63)
        max_codes = in_force(p.max_codes)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        dtype = self.model.thinker_to_talker_proj.weight.dtype

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.tensor(a, device=self.device, dtype=dtype)  # a copy: arrays from shared memory are read-only

        prompt, reply, markers = (
            tensor(arrays[PROMPT_STATES]),
            tensor(arrays[REPLY_STATES]),
            tensor(arrays[MARKER_EMBEDS]),
        )
        start, end, pad = markers[0:1], markers[1:2], markers[2:3]
        # 1) the reply's states, then the end marker, then pads: one is added to each step's input
        stream = torch.cat([reply, end, pad], dim=0)
        first_id = int(arrays[REPLY_IDS][0]) if len(arrays[REPLY_IDS]) else self.text_start
        # 2) the first forward: the prompt, the start marker and the first reply state (the model
        #    adds the codec's pad and start embeddings to the last two itself)
        embeds = torch.cat([prompt, start, stream[:1]], dim=0).unsqueeze(0)
        text_ids = np.concatenate([arrays[PROMPT_IDS], [self.text_start, first_id]])
        text_ids_t = torch.as_tensor(text_ids, device=self.device).unsqueeze(0)
        mask = torch.ones_like(text_ids_t)
        out = self.model(inputs_embeds=embeds, input_text_ids=text_ids_t, attention_mask=mask, use_cache=True)
        codes: list[int] = []
        fed = 1
        while True:
            if ctx.is_aborted(req.request_id):
                return RunnerOutput(error=RequestAbortedError(f"request {req.request_id} aborted"))
            # 3) pick a code with the request's own generator; at least one code before the end
            logits = out.logits[0, -1].float()
            logits[self.suppress] = float("-inf")
            if not codes:
                logits[self.eos] = float("-inf")
            code = _sample(logits, in_force(p.temperature), in_force(p.top_k), in_force(p.top_p), generator)
            if code == self.eos:
                break
            codes.append(code)
            # 4) stream the new code at once (a delta: only what is new)
            ctx.emit(req.request_id, RunnerOutput(tensors={CODES: np.asarray([code], dtype=np.int64)}))
            if len(codes) >= max_codes:
                break
            # 5) the next forward: the code's embedding plus the next reply state (pads at the end)
            state = stream[min(fed, len(stream) - 1)].view(1, 1, -1)
            fed += 1
            mask = torch.cat([mask, mask.new_ones((1, 1))], dim=1)
            out = self.model(
                input_ids=torch.tensor([[code]], device=self.device),
                thinker_reply_part=state,
                attention_mask=mask,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        return RunnerOutput(
            tensors={CODES: np.asarray(codes, dtype=np.int64)},
            metrics={"seed": seed, "codes": len(codes), "prompt_tokens": len(arrays[PROMPT_IDS])},
        )


class Code2WavRunner(TransformersRunner):
    """Codes to a waveform with a Qwen2.5-Omni token2wav (DiT + BigVGAN), in a voice of its
    ``speakers.safetensors``: all of a request's codes, or one chunk of them."""

    params_cls: ClassVar[type[msgspec.Struct]] = Code2WavSamplingParams
    needs_model = True

    def load(self) -> None:
        with _LOAD_LOCK:
            self._load()

    def _load(self) -> None:
        from safetensors.torch import load_file

        modeling = _omni_modeling()

        assert self.stage.model is not None
        path = part_dir(self.stage.model, "token2wav")
        # The DiT and BigVGAN run in float32 whatever the stage's dtype (the model's own rule).
        model = modeling.Qwen2_5OmniToken2WavModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        self.model = model.to(self.device).eval()
        cfg = self.model.config
        self.sample_rate = int(getattr(cfg, "sampling_rate", 24_000))
        self.speakers = speaker_table(cfg)
        voices = load_file(str(Path(path) / "speakers.safetensors"))
        names = sorted(set(getattr(cfg, "speakers", {}) or {}), key=lambda n: self.speakers[n])
        self.conds = [voices[f"{n}.cond"].to(self.device) for n in names]
        self.ref_mels = [voices[f"{n}.ref_mel"].to(self.device) for n in names]
        dit = cfg.dit_config
        self.num_codes = int(dit.num_embeds) - 1
        self.max_codes = int(dit.max_position_embeddings) // int(dit.repeats)
        self.steps = int(self.stage.runner_args.get("ode_steps", 4))
        self.guidance = float(self.stage.runner_args.get("guidance_scale", 0.5))

    def constraints(self) -> StageConstraints:
        # ``max_input_codes`` bounds the talker's ``max_codes`` before a request is queued, where
        # this stage takes the talker's codes whole (params.link_constraints).
        return StageConstraints(voices=tuple(self.speakers), max_input_codes=self.max_codes)

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        if self.model is None:
            return [RunnerOutput(error=StageAsleepError("the code2wav stage is asleep")) for _ in batch]
        outputs = []
        for req in batch:
            started = time.perf_counter()
            try:
                out = self._decode(req)
            except InvalidRequestError as e:
                out = RunnerOutput(error=e)
            out.metrics.update({"batch_size": len(batch), "execution_ms": (time.perf_counter() - started) * 1000})
            outputs.append(out)
        return outputs

    def _codes(self, req: RunnerRequest) -> np.ndarray:
        """The request's codes as 1-D int64, checked against the decoder's codebook and length."""
        if CODES not in req.inputs:
            raise InvalidRequestError("a code2wav stage reads `codes` (a talker's output)", param="codes")
        codes = np.asarray(req.inputs[CODES])
        if codes.dtype.kind not in "iu" or codes.ndim != 1:
            raise InvalidRequestError(
                f"`codes` must be a 1-D integer array, got {codes.dtype} of shape {codes.shape}", param="codes"
            )
        if not 1 <= len(codes) <= self.max_codes:
            raise InvalidRequestError(f"`codes` must hold 1 to {self.max_codes} codes, got {len(codes)}", param="codes")
        if codes.min() < 0 or codes.max() >= self.num_codes:
            raise InvalidRequestError(f"`codes` must lie in [0, {self.num_codes}), got one outside", param="codes")
        chunk = req.inputs.get("chunk_index")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 0):
            raise InvalidRequestError(f"`chunk_index` must be an int >= 0, got {chunk!r}", param="chunk_index")
        return codes.astype(np.int64)

    @torch.inference_mode()
    def _decode(self, req: RunnerRequest[Code2WavSamplingParams]) -> RunnerOutput:
        codes = self._codes(req)
        p = req.params
        voice = p.voice
        if voice is None:
            speaker = 0
        elif voice in self.speakers:
            speaker = self.speakers[voice] % len(self.conds)
        else:
            raise InvalidRequestError(f"invalid sampling param `voice`: unknown voice {voice[:64]!r}", param="voice")
        seed = p.seed if p.seed is not None else secrets.randbits(63)
        speed = float(in_force(p.speed))
        code = torch.as_tensor(codes, device=self.device).unsqueeze(0)
        # 1) the mel spectrogram, solved from noise. The DiT draws it from torch's global RNG, so
        #    that RNG is forked and seeded here: the same codes, voice and seed give the same audio.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            mel = self.model.code2wav_dit_model.sample(
                self.conds[speaker].unsqueeze(0),
                self.ref_mels[speaker].unsqueeze(0),
                code,
                num_steps=self.steps,
                guidance_scale=self.guidance,
            )
        # 2) the speaking rate: the mel stretched in time (pitch kept), then the vocoder
        if speed != 1.0:
            frames = max(1, round(mel.shape[-1] / speed))
            mel = torch.nn.functional.interpolate(mel, size=frames, mode="linear", align_corners=False)
        wave = self.model.code2wav_bigvgan_model(mel).reshape(-1).float().cpu().numpy()
        metrics: dict[str, float | int] = {
            "seed": seed,
            "codes": len(codes),
            "input_tokens": len(codes),
            "audio_samples": int(wave.shape[0]),
        }
        if req.inputs.get("chunk_index") is not None:
            metrics["chunk_index"] = int(req.inputs["chunk_index"])
        return RunnerOutput(
            media=[AudioItem(data=wave[None, :].astype(np.float32), sample_rate=self.sample_rate, seed=seed)],
            metrics=metrics,
        )
