"""Builds the fake libnvidia-ml.so.1 (fake_nvml.c, beside this file) and the environment that plays a scenario.

    libdir = fakenvml.build(tmp_dir)                       # compiles once; reused while the C is unchanged
    env = fakenvml.env(libdir, fakenvml.scenario("h100x8"), t0=fakenvml.t0_at(8.0))
    subprocess.run([sys.executable, "-c", "import pynvml; ..."], env=env)

The scenario format and the environment variables are described in README.md beside this file.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "fake_nvml.c"
BUILD_SH = HERE / "build.sh"
SCENARIOS = HERE / "scenarios"
LIBNAME = "libnvidia-ml.so.1"
_STAMP = ".fake_nvml.sha256"
_VARS = ("FAKE_NVML_SCENARIO", "FAKE_NVML_T0", "FAKE_NVML_T0_FILE", "FAKE_NVML_PROCS", "FAKE_NVML_CALLS")


class BuildError(RuntimeError):
    """The fake library could not be compiled (no C compiler, or the compiler failed)."""


def compiler() -> str | None:
    """Path of the C compiler build.sh will use ($CC, default cc), or None when there is none."""
    return shutil.which(os.environ.get("CC", "cc"))


def _digest(missing: tuple[str, ...] = ()) -> str:
    h = hashlib.sha256()
    for p in (SOURCE, BUILD_SH):
        h.update(p.read_bytes())
    h.update(os.environ.get("CC", "cc").encode())
    h.update(" ".join(missing).encode())
    return h.hexdigest()


def build(outdir: str | os.PathLike, missing: tuple[str, ...] | list[str] = ()) -> Path:
    """Compile the fake into OUTDIR/libnvidia-ml.so.1 unless an up-to-date one is there; return OUTDIR.

    `missing`: NVML functions left out of the library (an older driver), as a scenario's
    `missing_symbols` asks; `env()` builds those variants itself.
    Safe to call from several processes at once (a lock file in OUTDIR serialises them).
    Raises BuildError with the compiler's output when it cannot build.
    """
    missing = tuple(sorted(set(missing)))
    out = Path(outdir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    digest = _digest(missing)
    lib, stamp = out / LIBNAME, out / _STAMP
    with open(out / ".fake_nvml.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists() and stamp.exists() and stamp.read_text() == digest:
            return out
        if compiler() is None:
            raise BuildError(f"no C compiler ({os.environ.get('CC', 'cc')}) on PATH: install gcc "
                             "(apt-get install gcc) or set CC to build the fake libnvidia-ml")
        r = subprocess.run(["sh", str(BUILD_SH), str(out)], capture_output=True, text=True,
                           env={**os.environ, "FAKE_NVML_MISSING": " ".join(missing)})
        if r.returncode != 0:
            raise BuildError(f"building the fake libnvidia-ml failed:\n{r.stdout}{r.stderr}")
        stamp.write_text(digest)
    return out


def scenario(name: str) -> Path:
    """Path of a shipped scenario: scenario("h100x8") -> .../scenarios/h100x8.scn."""
    p = SCENARIOS / (name if name.endswith(".scn") else name + ".scn")
    if not p.exists():
        raise FileNotFoundError(f"no scenario {p}; shipped: {sorted(x.stem for x in SCENARIOS.glob('*.scn'))}")
    return p


def missing_symbols(scenario_path: str | os.PathLike) -> tuple[str, ...]:
    """The scenario's `missing_symbols` (system keys: before any [gpu] section, or under [system])."""
    names: set[str] = set()
    system = True
    try:
        text = Path(scenario_path).read_text()
    except OSError:
        return ()   # the library reports an unreadable scenario itself, at nvmlInit
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("["):
            system = line.strip("[] ") == "system"
        elif system and "=" in line:
            key, _, val = line.partition("=")
            if key.strip() == "missing_symbols":
                names.update(val.replace(",", " ").split())
    return tuple(sorted(names))


def t0_at(t: float) -> float:
    """A FAKE_NVML_T0 that puts a process started now at second `t` of its scenario."""
    return time.time() - t


def after_init(seconds: float) -> str:
    """A FAKE_NVML_T0 that puts scenario second 0 `seconds` after the process's first nvmlInit:
    for a test whose timeline must not start before a slowly starting process reads it (the
    resolved time is written to `t0_file`, see env and read_t0)."""
    return f"init+{float(seconds)!r}"


def read_t0(path: str | os.PathLike) -> float | None:
    """The scenario's second 0 (unix time) the library wrote to FAKE_NVML_T0_FILE; None before."""
    try:
        return float(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None


def env(libdir: str | os.PathLike, scenario_path: str | os.PathLike, t0: float | str | None = None, *,
        procs: str | os.PathLike | None = None, calls: str | os.PathLike | None = None,
        t0_file: str | os.PathLike | None = None, base: dict | None = None) -> dict:
    """A complete environment for a subprocess that loads the fake through pynvml.

    `base` (default os.environ) is copied; libdir goes first on LD_LIBRARY_PATH; FAKE_NVML_SCENARIO
    names the scenario; t0 (unix time of scenario second 0, or after_init(S)) sets FAKE_NVML_T0,
    else the library starts its clock at its first nvmlInit; t0_file sets FAKE_NVML_T0_FILE (where
    the library writes the second 0 it resolved); procs sets FAKE_NVML_PROCS (processes file re-read on
    every call); calls sets FAKE_NVML_CALLS (per-function call counts written there). A scenario
    with `missing_symbols` gets a library built without them (once, under libdir). FAKE_NVML_*
    variables not given here are removed, so an outer setting never leaks into a test.
    """
    missing = missing_symbols(scenario_path)
    if missing:   # a library without those symbols, beside the full one
        tag = hashlib.sha256(" ".join(missing).encode()).hexdigest()[:12]
        libdir = build(Path(libdir) / f"missing-{tag}", missing)
    e = dict(os.environ if base is None else base)
    for k in _VARS:
        e.pop(k, None)
    old = e.get("LD_LIBRARY_PATH")
    e["LD_LIBRARY_PATH"] = str(Path(libdir).resolve()) + (os.pathsep + old if old else "")
    e["FAKE_NVML_SCENARIO"] = str(Path(scenario_path).resolve())
    if t0 is not None:
        e["FAKE_NVML_T0"] = t0 if isinstance(t0, str) else repr(float(t0))
    if t0_file is not None:
        e["FAKE_NVML_T0_FILE"] = str(Path(t0_file).resolve())
    if procs is not None:
        e["FAKE_NVML_PROCS"] = str(Path(procs).resolve())
    if calls is not None:
        e["FAKE_NVML_CALLS"] = str(Path(calls).resolve())
    return e


def read_calls(path: str | os.PathLike) -> dict[str, int]:
    """The per-function call counts the library wrote to FAKE_NVML_CALLS ("_total" included)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        name, _, n = line.partition(" ")
        if n:
            out[name] = int(n)
    return out
