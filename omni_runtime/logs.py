"""Log lines of bounded length, in the server and in every stage process.

A request's text reaches logs through libraries we do not control (a tokenizer that quotes the
part of a prompt it cut, an exception message that embeds its input). A prompt may be 100 000
characters, so one request could write that much per log line. :func:`bound_log_messages`
replaces the process's log-record factory so every record, whichever library made it, renders at
most about :data:`MAX_MESSAGE_CHARS` characters: its beginning and its end (where a traceback
says what went wrong), with a note of how much was cut between them.

:func:`configure_logging` sets up a process the runtime owns (the server, a stage process, the
stage launcher): the runtime's lines at the chosen level, every library's (and Python warnings)
only at ``debug`` or from ``error`` up.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

#: Characters of a log message kept: half from its start, half from its end.
MAX_MESSAGE_CHARS = 2000


class BoundedLogRecord(logging.LogRecord):
    """A log record whose message is cut to :data:`MAX_MESSAGE_CHARS` characters."""

    def getMessage(self) -> str:
        message = super().getMessage()
        if len(message) <= MAX_MESSAGE_CHARS:
            return message
        half = MAX_MESSAGE_CHARS // 2
        return f"{message[:half]} [... {len(message) - 2 * half} characters cut ...] {message[-half:]}"


def bound_log_messages() -> None:
    """Make every log record of this process a :class:`BoundedLogRecord` (idempotent)."""
    logging.setLogRecordFactory(BoundedLogRecord)


# --------------------------------------------------------------------------- levels of a process

#: The runtime's own loggers; every other logger is a library's.
RUNTIME_LOGGER = "omni_runtime"
#: Libraries that give their root logger a handler and a level of their own as they are imported,
#: read from an environment variable: what they log while importing (optional backends they cannot
#: find, kernels they cannot load, deprecations) is printed before any call could set a level, so
#: these variables are the one way to hold it back. Each maps a level to the variable's value.
LIBRARY_ENV: dict[str, tuple[str, Callable[[int], str | None]]] = {
    "transformers": ("TRANSFORMERS_VERBOSITY", lambda level: logging.getLevelName(level).lower()),
    "diffusers": ("DIFFUSERS_VERBOSITY", lambda level: logging.getLevelName(level).lower()),
    # ``-all``: every torch logger at ERROR; torch's own default (WARNING) at debug, as its ``+all``
    # would turn on the compiler's debug traces.
    "torch": ("TORCH_LOGS", lambda level: "-all" if level >= logging.ERROR else None),
}


def library_level(level: int) -> int:
    """The level of every library's records in a process logging the runtime's at ``level``.

    A library's warnings (deprecations, optional backends it cannot find, kernels it cannot load)
    say nothing a user of the runtime can act on, so they show only at ``debug``; errors always do.
    """
    return level if level <= logging.DEBUG else max(level, logging.ERROR)


def configure_logging(level: int | str, fmt: str) -> None:
    """Set up logging for a process the runtime owns: the server, a stage process, the launcher.

    The runtime's own records at ``level``, the libraries' at :func:`library_level`, Python
    warnings (``warnings.warn``) routed to the ``py.warnings`` logger so that they follow the
    libraries' level too, and every record bounded (:func:`bound_log_messages`). Replaces what a
    forked process inherited from its parent. Never called in a caller's own process (``Omni`` in a
    script): how that logs is the caller's choice.
    """
    if isinstance(level, str):
        level = logging.getLevelNamesMapping()[level.upper()]
    libraries = library_level(level)
    logging.basicConfig(level=libraries, format=fmt, force=True)
    logging.getLogger(RUNTIME_LOGGER).setLevel(level)
    logging.captureWarnings(True)
    for library, (variable, value) in LIBRARY_ENV.items():
        wanted = value(libraries)
        if variable in os.environ or wanted is None:
            continue  # a value the user set is theirs to keep
        os.environ[variable] = wanted  # read when the library is first imported
        if library in sys.modules:  # imported already (a forked process): too late for the variable
            logging.getLogger(library).setLevel(libraries)
    bound_log_messages()


def runtime_log_level() -> int:
    """The level of the processes this one starts (stage processes, the launcher): the effective
    level of the runtime's logger here (the server's ``--log-level``; a script's own setup)."""
    return logging.getLogger(RUNTIME_LOGGER).getEffectiveLevel() or logging.INFO
