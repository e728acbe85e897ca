"""The checksummed framing of spool, store and snapshots (common/framing.py): a frame reads back,
damage costs only the bytes it touches, and a file read by pread scans as its bytes do."""

from __future__ import annotations

import os
import zlib

import pytest

from xpusense.common import framing

MAGIC = b"TST1"


def frames(*payloads: bytes) -> bytes:
    return b"".join(framing.encode(MAGIC, p) for p in payloads)


def test_the_layout_is_magic_length_and_crc_of_length_and_payload():
    f = framing.encode(MAGIC, b"hello")
    assert f == MAGIC + (5).to_bytes(4, "little") + zlib.crc32(b"hello", zlib.crc32(f[4:8])).to_bytes(4, "little") + b"hello"
    assert framing.header(MAGIC, [b"he", memoryview(b"llo")]) + b"hello" == f
    assert framing.payload_at(f, 0, len(f), MAGIC, 100) == b"hello"


@pytest.mark.parametrize(("data", "why"), [
    (frames(b"abc")[:10], "less than a record header"),
    (b"XXXX" + frames(b"abc")[4:], "bad magic"),
    (frames(b"a" * 50), "over the 10-byte limit"),
    (frames(b"abcdef")[:-1], "cut short"),
    (frames(b"abc")[:-1] + b"x", "checksum mismatch"),
])
def test_a_frame_that_does_not_check_out_says_why(data, why):
    with pytest.raises(framing.FrameError, match=why):
        framing.payload_at(data, 0, len(data), MAGIC, 10 if "limit" in why else 100)


def test_a_scan_resynchronises_after_damage_and_covers_every_byte():
    good = [bytes([i]) * (20 + i) for i in range(6)]
    data = bytearray(frames(*good))
    second = len(framing.encode(MAGIC, good[0]))
    data[second + 14] ^= 0xFF                 # the second frame's payload
    data = b"junk" + bytes(data) + frames(b"tail")[:9]   # stray bytes before, a cut frame after
    spans = list(framing.scan(data, 0, len(data), MAGIC, 1000))
    assert [s.payload for s in spans] == [None, good[0], None, *good[2:], None]
    assert "bad magic" in spans[0].damage and spans[2].damage == "checksum mismatch"
    assert "less than a record header" in spans[-1].damage
    assert [(a.end, b.start) for a, b in zip(spans, spans[1:]) if a.end != b.start] == []
    assert (spans[0].start, spans[-1].end) == (0, len(data))
    assert framing.count(data, spans[2].start, spans[2].end, MAGIC) == 1


def test_a_file_read_by_pread_scans_as_its_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(framing, "_SEARCH_CHUNK", 7)   # magics across chunk boundaries
    data = b"\x00" * 30 + frames(*(os.urandom(n) for n in (3, 40, 0, 17))) + b"TS"
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = framing.FileBytes(fd)
        assert list(framing.scan(buf, 0, len(data), MAGIC, 100)) == list(framing.scan(data, 0, len(data), MAGIC, 100))
        assert [buf.find(MAGIC, i, len(data)) for i in range(len(data))] == [data.find(MAGIC, i) for i in range(len(data))]
    finally:
        os.close(fd)
