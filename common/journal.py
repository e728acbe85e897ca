"""Logging set-up for the CLIs: lines on stderr, or, under systemd with stderr going to journald,
journal entries with fields an operator filters on (JournalHandler; standard library only)."""

from __future__ import annotations

import logging
import os
import socket
import sys

JOURNAL_SOCKET = "/run/systemd/journal/socket"

# logging level -> syslog priority (journalctl -p): CRITICAL 2 crit, ERROR 3 err, WARNING 4, INFO 6, DEBUG 7.
PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))

# Loggers of the sources' own modules: xpusense.agent.sources.NAME[.module], and the nvml package's.
SOURCES_LOGGER = "xpusense.agent.sources."
NAMED_LOGGERS = {"xpusense.agent.nvml": "nvml"}

LINE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def priority(levelno: int) -> int:
    return next((p for level, p in PRIORITIES if levelno >= level), 7)


def source_of(record: logging.LogRecord) -> str:
    """The source a record is about: `extra={"source": ...}`, a source's own logger, or the
    runner's "source %s ..." lines; "" when none."""
    given = getattr(record, "source", None)
    if isinstance(given, str) and given:
        return given
    if record.name.startswith(SOURCES_LOGGER):
        return record.name[len(SOURCES_LOGGER):].split(".")[0]
    if record.name in NAMED_LOGGERS:
        return NAMED_LOGGERS[record.name]
    if isinstance(record.msg, str) and record.msg.startswith("source %s") and record.args:
        args = record.args if isinstance(record.args, tuple) else (record.args,)
        return str(args[0])
    return ""


def encode(fields: dict[str, str]) -> bytes:
    """journald's native protocol: KEY=value lines; a value with a newline as KEY, newline,
    64-bit little-endian length, value, newline."""
    out = bytearray()
    for key, value in fields.items():
        data = value.encode("utf-8", "replace")
        if b"\n" in data:
            out += key.encode() + b"\n" + len(data).to_bytes(8, "little") + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


class JournalHandler(logging.Handler):
    """One native journal entry per record, as sd_journal_send(3) sends them, when $JOURNAL_STREAM
    (systemd.exec(5)) names the stream stderr is: PRIORITY (`journalctl -p warning`),
    SYSLOG_IDENTIFIER, XPUSENSE_LOGGER, XPUSENSE_SOURCE (the agent's source a record is about:
    `journalctl -u xpusense-agent XPUSENSE_SOURCE=nvml`), CODE_FILE/CODE_LINE/CODE_FUNC; journald
    adds _SYSTEMD_UNIT, _PID and the rest. A record the socket refuses (too large, no journald) is
    written to stderr, which still reaches the journal, so nothing is lost."""

    def __init__(self, identifier: str, path: str = JOURNAL_SOCKET):
        super().__init__()
        self.identifier = identifier
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.fallback = logging.StreamHandler(sys.stderr)
        self.fallback.setFormatter(logging.Formatter(LINE_FORMAT))

    def fields(self, record: logging.LogRecord) -> dict[str, str]:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + logging.Formatter().formatException(record.exc_info)
        f = {"MESSAGE": message, "PRIORITY": str(priority(record.levelno)), "SYSLOG_IDENTIFIER": self.identifier,
             "XPUSENSE_LOGGER": record.name, "CODE_FILE": record.pathname, "CODE_LINE": str(record.lineno),
             "CODE_FUNC": record.funcName}
        if src := source_of(record):
            f["XPUSENSE_SOURCE"] = src
        return f

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sock.sendto(encode(self.fields(record)), self.path)
        except OSError:
            self.fallback.handle(record)
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        self.sock.close()
        super().close()


def stderr_is_journal(env=None) -> bool:
    """True when systemd connected stderr to journald ($JOURNAL_STREAM names its device:inode)."""
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def configure_logging(level: str, identifier: str) -> None:
    """The root logger at `level`: journal entries under journald, else lines on stderr."""
    if stderr_is_journal() and os.path.exists(JOURNAL_SOCKET):
        logging.basicConfig(level=level.upper(), handlers=[JournalHandler(identifier)])
    else:
        logging.basicConfig(level=level.upper(), format=LINE_FORMAT)
