"""Log lines of bounded length, in the server and in every stage process.

A request's text reaches logs through libraries we do not control (a tokenizer that quotes the
part of a prompt it cut, an exception message that embeds its input). A prompt may be 100 000
characters, so one request could write that much per log line. :func:`bound_log_messages`
replaces the process's log-record factory so every record, whichever library made it, renders at
most about :data:`MAX_MESSAGE_CHARS` characters: its beginning and its end (where a traceback
says what went wrong), with a note of how much was cut between them.
"""

from __future__ import annotations

import logging

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
