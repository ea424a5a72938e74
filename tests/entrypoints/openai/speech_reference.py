"""A speech runner with one control call more, named in a test's deploy config (``module:Class``):
``speak_alone`` speaks each text in a request of its own, in the stage's own process, the
reference a chunked speech stage's audio is checked against."""

from __future__ import annotations

from typing import Any

from omni_runtime.params import resolve_params
from omni_runtime.stage.runners.base import ExecuteContext, RunnerRequest
from omni_runtime.stage.runners.speech import SpeechRunner


class ReferenceSpeechRunner(SpeechRunner):
    def rpc_speak_alone(self, prompts: list[str], params: dict[str, Any]) -> list[list[float]]:
        ctx = ExecuteContext(lambda _: False)
        resolved = resolve_params(self.params_cls, {}, params)  # a validated request's dict view, typed again
        clips = []
        for i, prompt in enumerate(prompts):
            out = self.execute([RunnerRequest(request_id=f"alone-{i}", prompt=prompt, params=resolved)], ctx)[0]
            clips.append(out.media[0].samples[0].tolist())
        return clips
