"""A Debian bookworm tree booted under systemd-nspawn, for tests that need a live systemd.

The tree (debootstrap, minbase plus systemd, dbus, python3, python3-venv, ca-certificates) is built
once into a cache outside the checkout, named by a hash of its recipe; each test run boots a copy
of it, removed afterwards. The container shares the host's network (pip inside reaches PyPI, the
agent reaches the collector on 127.0.0.1); commands run inside through nsenter into its PID 1's
namespaces (--register=no). Environment: XPUSENSE_NSPAWN_CACHE (default /var/cache/xpusense-test),
XPUSENSE_DEBIAN_MIRROR (default http://deb.debian.org/debian)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

SUITE = "bookworm"
VARIANT = "minbase"
PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "ca-certificates")
CACHE = Path(os.environ.get("XPUSENSE_NSPAWN_CACHE", "/var/cache/xpusense-test"))
MIRROR = os.environ.get("XPUSENSE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
STALE_RUN_S = 12 * 3600
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ContainerError(AssertionError):
    pass


def missing_tools() -> str:
    """Why the container cannot run here, or "" when it can."""
    if os.geteuid() != 0:
        return "needs root (debootstrap and systemd-nspawn); CI runs the privileged tests as root"
    for tool, package in (("systemd-nspawn", "systemd-container"), ("debootstrap", "debootstrap"),
                          ("nsenter", "util-linux")):
        if not shutil.which(tool):
            return f"needs {tool} (Debian package {package}; scripts/setup.sh installs it)"
    return ""


def recipe() -> str:
    return f"debootstrap --variant={VARIANT} --include={','.join(PACKAGES)} {SUITE}"


def cached_tree(log=print) -> tuple[Path, float]:
    """The cached tree (built when absent) and the seconds spent building it (0: it was there)."""
    tag = hashlib.sha256(recipe().encode()).hexdigest()[:12]
    tree = CACHE / f"nspawn-{SUITE}-{tag}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # one builder at a time; the others wait and reuse it
        for old in CACHE.glob("run-*"):   # copies left by a run that was killed (SIGKILL, power loss)
            if time.time() - old.stat().st_mtime > STALE_RUN_S:
                shutil.rmtree(old, ignore_errors=True)
        if (tree / ".complete").exists():
            return tree, 0.0
        t0 = time.monotonic()
        tmp = CACHE / f".build-{tag}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"building {tree} ({recipe()} from {MIRROR}); later runs reuse it")
        cmd = ["debootstrap", f"--variant={VARIANT}", f"--include={','.join(PACKAGES)}", SUITE, str(tmp), MIRROR]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ContainerError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
        (tmp / ".complete").write_text(recipe() + "\n")
        shutil.rmtree(tree, ignore_errors=True)
        tmp.rename(tree)
        return tree, time.monotonic() - t0


class Container:
    """A copy of the cached tree, booted; `run()` executes inside; `close()` powers off and removes it."""

    def __init__(self, tree: Path, name: str, capabilities: list[str], log_path: Path):
        self.name = name
        self.dir = CACHE / f"run-{name}"
        self.log_path = log_path
        self.capabilities = capabilities
        self.proc: subprocess.Popen | None = None
        self.pid1 = 0
        try:
            self._prepare(tree)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def _prepare(self, tree: Path) -> None:
        subprocess.run(["cp", "-a", "--reflink=auto", str(tree), str(self.dir)], check=True)
        (self.dir / ".complete").unlink(missing_ok=True)
        os.utime(self.dir)   # cp -a kept the tree's time: this copy's age counts from now (STALE_RUN_S)
        (self.dir / "etc/hostname").write_text(self.name + "\n")
        # The host's resolver and trust anchors: pip inside reaches PyPI the way the host does
        # (through the same DNS and, where the network intercepts TLS, the same CA bundle).
        (self.dir / "etc/resolv.conf").unlink(missing_ok=True)
        shutil.copyfile("/etc/resolv.conf", self.dir / "etc/resolv.conf")
        bundle = "/etc/ssl/certs/ca-certificates.crt"
        if os.path.exists(bundle):
            shutil.copyfile(bundle, self.dir / bundle.lstrip("/"))

    def put(self, src: Path, dest: str) -> None:
        """Copy a host file or folder into the tree at `dest` (an absolute path inside)."""
        target = self.dir / dest.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(src, target)

    def boot(self, timeout_s: float = 180.0) -> float:
        """Boot it and wait for systemd to finish starting up; the seconds that took."""
        t0 = time.monotonic()
        log = open(self.log_path, "ab")
        cmd = ["systemd-nspawn", "--boot", "--keep-unit", "--register=no", "--quiet", "--console=passive",
               f"--machine={self.name}", f"--directory={self.dir}"]
        if self.capabilities:
            cmd.append("--capability=" + ",".join(self.capabilities))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not self.pid1:
            if self.proc.poll() is not None:
                raise ContainerError(f"systemd-nspawn exited {self.proc.returncode}: {self.log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise ContainerError(f"no container init within {timeout_s} s: {self.log_path.read_text()[-3000:]}")
            self.pid1 = self._find_init()
            time.sleep(0.1)
        while True:   # "running" or "degraded": start-up is over either way
            out = self.run(["systemctl", "is-system-running", "--wait"], check=False, timeout=max(1.0, deadline - time.monotonic()))
            state = out.stdout.strip()
            if state in ("running", "degraded"):
                break
            if time.monotonic() > deadline or state not in ("", "starting", "initializing"):
                raise ContainerError(f"container systemd is {state!r}: {out.stderr.strip()}")
            time.sleep(0.2)
        if state == "degraded":
            failed = self.run(["systemctl", "--failed", "--no-legend", "--plain"], check=False).stdout
            print(f"container {self.name}: degraded at boot (not ours): {failed.strip()}")
        return time.monotonic() - t0

    def _find_init(self) -> int:
        """The container's PID 1 seen from the host: a descendant of nspawn whose NSpid ends in 1."""
        todo, seen = [self.proc.pid], set()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            if pid != self.proc.pid and len(nspid) >= 2 and nspid[-1] == "1":
                return pid
            todo.extend(int(c) for c in children)
        return 0

    def run(self, argv: list[str], check: bool = True, timeout: float = 120.0, env: dict | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
        """Run `argv` inside the container as its root, in its namespaces, with a clean environment."""
        envs = [f"{k}={v}" for k, v in {"PATH": PATH, "LANG": "C.UTF-8", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0",
                                         **(env or {})}.items()]
        cmd = ["nsenter", f"--target={self.pid1}", "--all", "--root", "--wd", "env", "-i", *envs, *argv]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input)
        if check and out.returncode != 0:
            raise ContainerError(f"{' '.join(argv)} exited {out.returncode} in {self.name}:\n"
                                 f"{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
        return out

    def close(self) -> None:
        """Power off (then kill what is left) and remove the copy; never raises."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                if self.pid1:
                    self.run(["systemctl", "poweroff", "--no-block"], check=False, timeout=30)
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    for pid in (self.pid1, self.proc.pid):
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                    self.proc.wait(timeout=30)
        except Exception as e:   # cleanup goes on: the copy must not stay behind
            print(f"container {self.name}: power-off failed: {e}")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
            shutil.rmtree(f"/run/systemd/nspawn/propagate/{self.name}", ignore_errors=True)


def new_name() -> str:
    return f"xps-{uuid.uuid4().hex[:8]}"
