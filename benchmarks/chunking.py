"""The orchestrator thread's work per streamed update: one update of 100,000 characters of each
hostile text cut at once (every chunk it completes) and as the sequencer cuts it (only the chunks
the stage can take now, ``limit = max_buffered``), side by side in one run.

    .venv/bin/python -m benchmarks.chunking
"""

from __future__ import annotations

import time

from omni_runtime.bounds import MAX_PROMPT_CHARS
from omni_runtime.engine.chunking import Chunker
from omni_runtime.engine.sequencer import STREAMING_INPUT_CHUNKING

TEXTS = {
    "cjk": "\u4e2d\u6587" * (MAX_PROMPT_CHARS // 2),
    "no spaces": "x" * MAX_PROMPT_CHARS,
    "marks": "!)" * (MAX_PROMPT_CHARS // 2),
    "words": "ab " * (MAX_PROMPT_CHARS // 3),
    "sentences": "a. " * (MAX_PROMPT_CHARS // 3),
}


def feed_ms(text: str, limit: int | None, rounds: int = 5) -> tuple[float, int]:
    """The best of ``rounds`` times of one feed of ``text``, and the chunks it handed on."""
    best, cuts = float("inf"), 0
    for _ in range(rounds):
        chunker = Chunker(STREAMING_INPUT_CHUNKING)
        start = time.perf_counter()
        cuts = len(chunker.feed(text, limit=limit))
        best = min(best, time.perf_counter() - start)
    return best * 1e3, cuts


def main() -> None:
    limit = STREAMING_INPUT_CHUNKING.max_buffered
    print(f"| text (100k chars, one update) | all at once: ms (chunks) | limit {limit}: ms (chunks) |")
    print("|---|---|---|")
    for name, text in TEXTS.items():
        eager, eager_cuts = feed_ms(text, None)
        lazy, lazy_cuts = feed_ms(text, limit)
        print(f"| {name} | {eager:.2f} ({eager_cuts}) | {lazy:.2f} ({lazy_cuts}) |")


if __name__ == "__main__":
    main()
