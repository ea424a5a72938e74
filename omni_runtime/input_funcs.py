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


def prompt_then_transcript(prompt: Any, upstream: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The caller's prompt, then what the speech-recognition stage(s) heard, as a text stage's prompt.

    For an audio -> text pipeline: a request with audio has its transcript as the user's turn,
    after what the caller's prompt says (instructions, earlier context); one without audio has an
    empty transcript, so its prompt is the caller's alone and the pipeline answers text as a text
    model does. Parts are joined by a blank line.
    """
    parts = [str(prompt).strip()]
    parts += [" ".join((out.get("text") or "").split()) for _, out in sorted(upstream.items())]
    return {"prompt": "\n\n".join(p for p in parts if p)}


def speak_or_pause(prompt: Any, upstream: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """What the text stage(s) wrote, on one line, as the text a speech stage speaks; a text with
    nothing a speech model can say (punctuation or symbols alone) is a short pause (a comma).

    For a pipeline whose answer is spoken chunk by chunk while the caller's prompt is not what the
    user said (instructions, or empty for a spoken turn): a chunk of symbols must neither fail the
    answer's audio nor speak the prompt in the middle of it.
    """
    texts = [" ".join((out.get("text") or "").split()) for _, out in sorted(upstream.items())]
    answer = " ".join(t for t in texts if t)
    return {"prompt": answer if any(c.isalnum() for c in answer) else ","}
