"""A stage's freed memory given back to the operating system: glibc's mmap threshold, fixed.

Applied once, where the stage worker runs (a stage process, a Ray actor, or the engine's own
process for ``backend: inproc``: the setting is the whole process's), before its first forward.

Why: torch allocates a forward's activations with ``malloc``. glibc serves a block of at least its
mmap threshold (128 KiB at first) with ``mmap`` and unmaps it when it is freed; but the first time
such a block is freed it raises the threshold to that block's size (up to 32 MiB), and from then on
carves blocks below it out of its heaps, which it gives back only from their top. A stage whose
forwards change shape from wave to wave (speech of varied lengths, images of varied sizes) leaves
those heaps full of free holes that the next shapes do not fit, and the heaps grow: ``tiny-tts``
under rounds of varied-length speech held 1.7 GB free in its heaps after 8 rounds next to 0.3 GB in
use, and its RSS rose from 1.3 to 2.5 GB (docs/reliability.md, "Memory: huge inputs and long
runs"). Setting the threshold (``mallopt(M_MMAP_THRESHOLD)``) turns that adjustment off: every
block of at least :data:`MMAP_THRESHOLD` is mapped for itself and returned whole when freed, so
nothing large is left in the heaps to fragment them. Why 4 MiB: at 256 KiB the heap stayed as flat, but every
block from there up was mapped and faulted in afresh, and ``tiny-tts``'s rounds took 19 % longer;
at 4 MiB, 2 to 8 % longer, for a level about 0.1 GB higher.
``malloc_trim`` after each wave was measured too: it returns the holes' pages, but costs about
0.1 s a call on such a heap and leaves the heap itself growing.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

#: Blocks of at least this many bytes are mapped for themselves and unmapped when freed.
MMAP_THRESHOLD = 4 << 20
#: glibc's ``mallopt`` parameter number (malloc.h).
M_MMAP_THRESHOLD = -3


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix this process's glibc mmap threshold at ``threshold`` bytes (its dynamic adjustment off).
    False, and nothing changed, where the C library is not glibc (musl, macOS)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt  # glibc's name; another C library has no mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        logger.warning("mallopt(M_MMAP_THRESHOLD, %d) failed: freed memory may stay in the heap", threshold)
        return False
    return True
