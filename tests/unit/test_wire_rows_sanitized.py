"""The C batch reader (collector/_wire_rows.c) and the compact encoding's C reader (common/_compact.c)
built with AddressSanitizer and UBSan and fuzzed in a subprocess (tests/wire_rows_fuzz.py,
tests/compact_c_fuzz.py): no sanitizer report, and every input read whole, protobuf (or
decode_columns in Python) reads the same. Bugs planted in copies of the sources show the build
catches them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "collector" / "_wire_rows.c"
DRIVER = ROOT / "tests" / "wire_rows_fuzz.py"
COMPACT_SOURCE = ROOT / "common" / "_compact.c"
COMPACT_DRIVER = ROOT / "tests" / "compact_c_fuzz.py"
COMPACT_FUZZ_S = 5
FUZZ_S = 20        # the fuzzing's time budget; the inputs are the same on every run (a fixed seed)
SEED = 20_240_613
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer", "SUMMARY: UndefinedBehaviorSanitizer")


def _runtime(gcc: str, name: str) -> str | None:
    """The path of a sanitizer runtime gcc links against, or None (gcc then prints the bare name)."""
    out = subprocess.run([gcc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return out if os.path.isabs(out) and os.path.exists(out) else None


def _toolchain() -> tuple[str, str]:
    """gcc and its libasan.so, or the test skipped saying which is missing (scripts/setup.sh
    installs gcc, whose Debian package brings libasan and libubsan)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc to build the C reader with sanitizers (scripts/setup.sh installs it)")
    asan = _runtime(gcc, "libasan.so")
    if asan is None or _runtime(gcc, "libubsan.so") is None:
        pytest.skip("gcc has no libasan/libubsan (Debian: libasan8, libubsan1, which gcc depends on)")
    return gcc, asan


def _build(source: str, out: Path, name: str = "_wire_rows", libs: tuple[str, ...] = ()) -> Path:
    gcc, _ = _toolchain()
    out.mkdir(parents=True, exist_ok=True)
    src = out / f"{name}.c"
    src.write_text(source)
    so = out / (name + sysconfig.get_config_var("EXT_SUFFIX"))
    cmd = [gcc, "-shared", "-fPIC", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
           "-fno-omit-frame-pointer", "-O1", "-g", "-Wall", "-I", sysconfig.get_paths()["include"], str(src), *libs, "-o", str(so)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stderr}"
    return so


def _fuzz(so: Path, tmp: Path, seconds: float, one_input: str | None = None,
          driver: Path = DRIVER) -> tuple[subprocess.CompletedProcess, str]:
    """The driver's run against the build `so` (its stdout, stderr and status) and the hex of the
    last input it was given (the one that crashed it, where it crashed)."""
    _, asan = _toolchain()
    last = tmp / f"last-input-{so.parent.name}"
    last.write_bytes(bytes(1 << 20))
    env = {**os.environ,
           "LD_PRELOAD": asan,            # Python is not built with ASan: its runtime must load first
           "ASAN_OPTIONS": "detect_leaks=0:exitcode=99:strict_string_checks=1:detect_stack_use_after_return=1",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=98",
           "PYTHONMALLOC": "malloc"}      # every Python object on ASan's heap, bounds-checked
    args = [sys.executable, str(driver), str(so), str(seconds), str(SEED), str(last)] + (one_input.split() if one_input else [])
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=seconds + 300)
    raw = last.read_bytes()
    n = int.from_bytes(raw[:4], "little")
    return r, raw[4:4 + n].hex()


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory) -> Path:
    return _build(SOURCE.read_text(), tmp_path_factory.mktemp("wire_rows_asan"))


def test_mutated_batches_give_no_sanitizer_report_and_what_is_read_whole_protobuf_reads_the_same(sanitized, tmp_path):
    r, last = _fuzz(sanitized, tmp_path, FUZZ_S)
    reports = [x for x in REPORTS if x in r.stderr]
    assert r.returncode == 0 and not reports, (
        f"status {r.returncode}, sanitizer reports {reports}; last input {last}\n{r.stderr[-6000:]}")
    counts = json.loads(r.stdout)
    # enough inputs, and enough of them read whole, that the checks were not vacuous
    assert counts["inputs"] >= 4000, counts
    for read in ("lean_batch", "lean_batch_wire", "rows_checked", "lean_compact"):
        assert counts[read] >= 50, (read, counts)
    assert counts["rows"] > counts["rows_checked"], counts   # some the lenient reader read, protobuf refused


# Two bugs planted in a copy of the source: a sample's value read without its bound (a heap
# over-read of the input past its end), and a varint's eleventh byte shifted by 70 bits (undefined).
PLANTED = {
    "            if (end - p < 8)\n                return -1;\n            uint64_t bits = 0;": "            uint64_t bits = 0;",
    "    for (int i = 0; i < 10; i++) {": "    for (int i = 0; i < 11; i++) {",
}
OVER_READ = "2204" + "29" + "000000"             # a Batch whose one sample has a value of 3 bytes, not 8
BAD_SHIFT = "220c" + "40" + "ff" * 10 + "01"     # a sample whose series_ref is an 11-byte varint


def test_the_sanitized_build_reports_a_planted_over_read_and_undefined_shift(tmp_path):
    source = SOURCE.read_text()
    for old, new in PLANTED.items():
        assert source.count(old) == 1, f"the line a bug is planted in is no longer in {SOURCE.name}: {old!r}"
        source = source.replace(old, new)
    so = _build(source, tmp_path / "planted")
    r, _ = _fuzz(so, tmp_path, 0, OVER_READ)
    assert r.returncode == 99 and "AddressSanitizer: heap-buffer-overflow" in r.stderr, r.stderr[-3000:]
    assert "read_sample" in r.stderr, r.stderr[-3000:]
    r, _ = _fuzz(so, tmp_path, 0, BAD_SHIFT)
    assert r.returncode != 0 and "shift exponent 70 is too large" in r.stderr, r.stderr[-3000:]


@pytest.fixture(scope="module")
def compact_sanitized(tmp_path_factory) -> Path:
    return _build(COMPACT_SOURCE.read_text(), tmp_path_factory.mktemp("compact_asan"), "_compact", ("-lz",))


def test_mutated_compact_blocks_give_no_sanitizer_report_and_read_as_python_reads_them(compact_sanitized, tmp_path):
    r, last = _fuzz(compact_sanitized, tmp_path, COMPACT_FUZZ_S, driver=COMPACT_DRIVER)
    reports = [x for x in REPORTS if x in r.stderr]
    assert r.returncode == 0 and not reports, (
        f"status {r.returncode}, sanitizer reports {reports}; last input {last}\n{r.stderr[-6000:]}")
    counts = json.loads(r.stdout)
    assert counts["inputs"] >= 4000 and counts["read"] >= 200 and counts["refused"] >= 200, counts
    assert counts["like_last"] >= 20, counts   # the shortcut of a block whose refs are the last one's
    assert counts["deflated"] >= 100, counts   # the deflate kept between calls, at levels and dictionaries that change


# A bug planted in a copy of the compact reader: a 32-bit little-endian read whose top byte is
# shifted as an int (undefined past 127), as a block's ref delta of 2**32 - 1 has it.
COMPACT_PLANTED = ("    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;",
                   "    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)(p[3] << 24);")


def test_the_sanitized_compact_build_reports_a_planted_undefined_shift(tmp_path):
    from xpusense.common import compact
    source = COMPACT_SOURCE.read_text()
    assert source.count(COMPACT_PLANTED[0]) == 1, f"the line the bug is planted in is no longer in {COMPACT_SOURCE.name}"
    so = _build(source.replace(*COMPACT_PLANTED), tmp_path / "planted", "_compact", ("-lz",))
    block = compact.encode_columns([(2**32 - 1, 5, 1.0)])
    r, _ = _fuzz(so, tmp_path, 0, f"{block.hex()} 1", COMPACT_DRIVER)
    assert r.returncode != 0 and "cannot be represented in type 'int'" in r.stderr, r.stderr[-3000:]
    r, _ = _fuzz(so, tmp_path, 0, f"{compact.encode_columns([(5, 5, 1.0)]).hex()} 1", COMPACT_DRIVER)
    assert r.returncode == 0, r.stderr[-3000:]   # the planted line is harmless below 128
