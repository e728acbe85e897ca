"""common/journal.py: records as journald native entries with the fields operators filter on."""

from __future__ import annotations

import logging
import os
import socket

from xpusense.common import journal


def decode(data: bytes) -> dict[str, str]:
    """journald's native format back into fields (both the KEY=value and the binary form)."""
    fields, i = {}, 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            k, v = line.split(b"=", 1)
            fields[k.decode()] = v.decode()
            i = nl + 1
        else:
            n = int.from_bytes(data[nl + 1:nl + 9], "little")
            fields[line.decode()] = data[nl + 9:nl + 9 + n].decode()
            assert data[nl + 9 + n:nl + 10 + n] == b"\n"
            i = nl + 10 + n
    return fields


def entries(tmp_path, emit) -> list[dict[str, str]]:
    path = str(tmp_path / "journal.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        server.settimeout(2)
        handler = journal.JournalHandler("xpusense-agent", path)
        log = logging.getLogger("test.journal")
        try:
            n = emit(handler)
            return [decode(server.recv(1 << 20)) for _ in range(n)]
        finally:
            handler.close()
            log.handlers.clear()


def record(name, level, msg, *args, exc_info=None, **extra):
    r = logging.LogRecord(name, level, "/x/y.py", 7, msg, args, exc_info, func="f")
    r.__dict__.update(extra)
    return r


def test_fields_priority_source_and_logger(tmp_path):
    def emit(h):
        h.handle(record("xpusense.agent.tiers", logging.WARNING, "source %s unavailable: %s", "npu_smi", "not found"))
        h.handle(record("xpusense.agent.sources.ebpf", logging.ERROR, "probe failed"))
        h.handle(record("xpusense.agent.nvml", logging.INFO, "GPU 0 ok"))
        h.handle(record("xpusense.agent.stream", logging.DEBUG, "sent"))
        h.handle(record("xpusense.agent", logging.INFO, "hello", source="host"))
        return 5
    a, b, c, d, e = entries(tmp_path, emit)
    assert a["MESSAGE"] == "source npu_smi unavailable: not found"
    assert (a["PRIORITY"], a["XPUSENSE_SOURCE"], a["XPUSENSE_LOGGER"]) == ("4", "npu_smi", "xpusense.agent.tiers")
    assert (a["SYSLOG_IDENTIFIER"], a["CODE_FILE"], a["CODE_LINE"], a["CODE_FUNC"]) == ("xpusense-agent", "/x/y.py", "7", "f")
    assert (b["PRIORITY"], b["XPUSENSE_SOURCE"]) == ("3", "ebpf")
    assert (c["PRIORITY"], c["XPUSENSE_SOURCE"]) == ("6", "nvml")
    assert d["PRIORITY"] == "7" and "XPUSENSE_SOURCE" not in d
    assert e["XPUSENSE_SOURCE"] == "host"


def test_multiline_message_uses_the_binary_form(tmp_path):
    try:
        raise ValueError("boom")
    except ValueError:
        import sys
        exc = sys.exc_info()

    def emit(h):
        h.handle(record("xpusense.agent", logging.CRITICAL, "failed\nbadly", exc_info=exc))
        return 1
    (f,) = entries(tmp_path, emit)
    assert f["PRIORITY"] == "2"
    assert f["MESSAGE"].startswith("failed\nbadly\nTraceback")
    assert "ValueError: boom" in f["MESSAGE"]


def test_refused_record_goes_to_stderr(tmp_path, capsys):
    h = journal.JournalHandler("xpusense-agent", str(tmp_path / "absent.sock"))
    try:
        h.handle(record("xpusense.agent", logging.WARNING, "still %s", "seen"))
    finally:
        h.close()
    assert "WARNING xpusense.agent: still seen" in capsys.readouterr().err


def test_journal_only_when_stderr_is_the_stream_systemd_named(tmp_path, monkeypatch):
    st = os.fstat(2)
    import sys
    monkeypatch.setattr(sys, "stderr", os.fdopen(os.dup(2), "w"))
    assert journal.stderr_is_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
    assert not journal.stderr_is_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"})
    assert not journal.stderr_is_journal({"JOURNAL_STREAM": "nonsense"})
    assert not journal.stderr_is_journal({})
