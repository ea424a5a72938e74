"""Input functions for ``custom_process_input_func`` in deploy YAMLs (``module:function``).

An input function runs in the orchestrator thread when all of a stage's upstream stages are done.
It gets the caller's original prompt and ``{upstream stage id: {"text", "images", "tensors"}}``
and returns ``{"prompt": ..., "inputs": {...}}`` for the stage (either key may be left out: the
prompt then stays the caller's, and the inputs empty). ``images`` are the uint8 HxWx3 arrays of
the upstream stage's image items (omni_runtime/media.py). Arrays it receives are plain copies it
may keep or change.
"""

from __future__ import annotations

from typing import Any


def prompt_with_expansion(prompt: Any, upstream: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The caller's prompt, then what the text stage(s) added to it, comma-separated.

    For a text -> image pipeline: the text stage writes a continuation of the prompt (its output
    is the new text only), and the image stage should draw the subject the caller named, with the
    expansion as extra detail, not the expansion alone. An empty expansion leaves the prompt as is.
    """
    parts = [str(prompt).strip()]
    for _, out in sorted(upstream.items()):
        text = (out.get("text") or "").strip()
        if text:
            parts.append(" ".join(text.split()))  # one line: newlines mean nothing to a text encoder
    return {"prompt": ", ".join(p for p in parts if p), "inputs": {"original_prompt": prompt}}


def speak_text(prompt: Any, upstream: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """What the text stage(s) wrote, on one line, as the text a speech stage speaks.

    For a text -> speech pipeline the answer is what is heard, not the question. An answer without
    a letter or digit (empty, or punctuation alone) has nothing a speech model can say: the
    caller's prompt is spoken instead, so the request still gets its audio.
    """
    texts = [" ".join((out.get("text") or "").split()) for _, out in sorted(upstream.items())]
    answer = " ".join(t for t in texts if t)
    return {"prompt": answer if any(c.isalnum() for c in answer) else str(prompt).strip()}
