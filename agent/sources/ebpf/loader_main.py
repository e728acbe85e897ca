"""The eBPF loader process: compiles the probes' C with bcc, loads and attaches the programs, hands
their fds to the agent (fd_channel.py), and exits with os._exit so bcc's clean-up, which would detach
them, never runs; clang and LLVM live and die with it. Started with the agent's config named, it
compiles the request the agent will most likely send before it comes (Ahead).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from . import fd_channel
from . import kallsyms as kallsyms_mod

REQUEST_WAIT_S = 120.0     # started early by the agent: how long to wait for what to load


@contextlib.contextmanager
def capture_stderr() -> Iterator[dict[str, str]]:
    """Collect what bcc/clang print on fd 2 (warnings, compile errors) so it can be quoted."""
    buf = {"text": ""}
    try:
        saved = os.dup(2)
    except OSError:
        yield buf
        return
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        try:
            sys.stderr.flush()
            os.dup2(tmp.fileno(), 2)
            yield buf
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            buf["text"] = tmp.read().decode(errors="replace")


def first_errors(text: str, n: int = 3) -> str:
    lines = [line.strip() for line in text.splitlines() if "error" in line.lower()]
    return "; ".join(lines[:n]) or text.strip()[-300:]


class Refused(Exception):
    """A probe could not be loaded or attached; the message is its Unavailable reason."""


class Builder:
    """What one run of the loader built: bcc objects, fds to send, the manifest that names them."""

    def __init__(self, req: dict, compiling: threading.Event | None = None) -> None:
        self.req = req
        self.compiling = compiling      # set when clang starts (preload's later imports wait for it)
        self.fds: list[int] = []
        self.manifest: dict[str, Any] = {"ok": True, "probes": {}, "maps": [], "compile_errors": {}}
        self.objects: dict[str, Any] = {}       # probe -> bcc BPF object
        self._all: list[Any] = []
        self._tc_cleanup: list[Any] = []
        self.early: dict[str, Any] = {}         # probe -> groundwork done while compiling

    def fd(self, fd: int) -> int:
        """Index of fd in the list sent to the agent."""
        self.fds.append(fd)
        return len(self.fds) - 1

    # -- compiling
    def bpf_class(self) -> Any:
        from bcc import BPF

        class _BPF(BPF):
            # bcc attaches every tracepoint__* function as soon as it compiles the module; one failing
            # attach would take the whole object down. Each probe attaches its own programs instead.
            def _trace_autoload(self) -> None:
                pass

        return _BPF

    def compile_one(self, text: str, cflags: list[str]) -> Any:
        cls = self.bpf_class()
        with capture_stderr() as err:
            try:
                obj = cls(text=text.encode(), cflags=cflags)
            except Exception as e:
                obj = e
        if err["text"].strip():
            self.manifest.setdefault("bcc_output", "")
            self.manifest["bcc_output"] = (self.manifest["bcc_output"] + err["text"])[-4000:]
        if isinstance(obj, Exception):
            raise RuntimeError(first_errors(err["text"]) or str(obj))
        return obj

    def compile_all(self) -> None:
        probes = self.req["probes"]
        t0 = time.perf_counter()
        if self.compiling is not None:
            self.compiling.set()
        if self.req.get("combined") and len(probes) > 1:
            try:
                obj = self.compile_one(self.req["combined_text"], [f for p in probes for f in p["cflags"]])
                self._all.append(obj)
                for p in probes:
                    self.objects[p["name"]] = obj
                self.manifest["compile_mode"] = f"combined ({len(probes)} probes, one clang run)"
            except RuntimeError as e:
                self.manifest["combined_error"] = str(e)
        if not self.objects:
            self.manifest["compile_mode"] = "per probe"
            for p in probes:
                try:
                    obj = self.compile_one(p["text"], p["cflags"])
                    self._all.append(obj)
                    self.objects[p["name"]] = obj
                except RuntimeError as e:
                    self.manifest["compile_errors"][p["name"]] = str(e)
        self.manifest["compile_s"] = time.perf_counter() - t0

    # -- loading and attaching
    def load(self, obj: Any, probe: str, fn: str, prog_type: str) -> Any:
        from bcc import BPF
        try:
            return obj.load_func(fn.encode(), getattr(BPF, prog_type))
        except Exception as e:
            raise Refused(f"{probe}: the kernel refused program {fn} ({e}); run with "
                          f"`python -m xpusense.agent.sources.ebpf --print-c` to see the C") from e

    def attach_probe(self, p: dict) -> dict:
        name, obj, spec = p["name"], self.objects[p["name"]], p["attach"]
        progs: dict[str, Any] = {}
        links: list[dict] = []
        extra: dict[str, Any] = {}
        for map_name, entries in spec.get("map_init", {}).items():
            write_entries(obj.get_table(map_name.encode()), entries)
        for tp in spec.get("tracepoints", []):
            cat, _, ev = tp.partition(":")
            fn = f"tracepoint__{cat}__{ev}"
            progs[fn] = self.load(obj, name, fn, "TRACEPOINT")
            try:
                obj.attach_tracepoint(tp=tp.encode(), fn_name=fn.encode())
            except Exception as e:
                raise Refused(f"{name}: could not attach to tracepoint {tp}: {e}") from e
            links.append({"kind": "tracepoint", "target": tp, "fd": obj.tracepoint_fds[tp.encode()]})
        for tp, fn in spec.get("raw_tracepoints", {}).items():
            progs[fn] = self.load(obj, name, fn, "RAW_TRACEPOINT")
            try:
                obj.attach_raw_tracepoint(tp=tp.encode(), fn_name=fn.encode())
            except Exception as e:
                raise Refused(f"{name}: could not attach to raw tracepoint {tp}: {e}") from e
            links.append({"kind": "raw_tracepoint", "target": tp, "fd": obj.raw_tracepoint_fds[tp.encode()]})
        if "uprobes" in spec:
            links += self.attach_uprobes(obj, name, spec["uprobes"], progs)
        if "tc" in spec:
            from .tc import add_filters, prepare_filters
            t = spec["tc"]
            for fn in (t["ingress_fn"], t["egress_fn"]):
                progs[fn] = self.load(obj, name, fn, "SCHED_CLS")
            early = self.early.pop(name, None)
            done, ipr = early if isinstance(early, tuple) else prepare_filters(t)
            self._tc_cleanup.append(done)
            if ipr is not None:
                done = add_filters(done, ipr, {"ingress": progs[t["ingress_fn"]].fd, "egress": progs[t["egress_fn"]].fd})
            if done.get("error"):
                raise Refused(done["error"])
            links += [{"kind": "tc", "target": target, "fd": None} for target in done["attached"]]
            extra.update({k: v for k, v in done.items() if k != "attached"})
        return {"ok": True, "progs": [{"fn": fn, "fd": self.fd(f.fd)} for fn, f in progs.items()],
                "links": [{**link, "fd": None if link["fd"] is None else self.fd(link["fd"])} for link in links],
                "extra": extra}

    def attach_uprobes(self, obj: Any, probe: str, spec: dict, progs: dict) -> list[dict]:
        from bcc import BPF
        lib = spec["library"]
        found = self.early.pop(probe, None)
        if found is None or isinstance(found, Exception):
            try:
                found = BPF.get_user_functions_and_addresses(lib.encode(), b"^cu")
            except Exception as e:
                raise Refused(f"{probe}: cannot read the symbols of {lib}: {e}") from e
        addr_of: dict[str, int] = {}
        for sym_name, addr in found:
            sym_name = sym_name.decode() if isinstance(sym_name, bytes) else sym_name
            addr_of.setdefault(sym_name, addr)
        seen_addr, links = set(), []
        for sym, fn in spec["symbols"].items():
            addr = addr_of.get(sym)
            if addr is None or addr in seen_addr:    # absent, or an alias of one already probed
                continue
            progs[fn] = self.load(obj, probe, fn, "KPROBE")
            before = set(obj.uprobe_fds)
            try:
                obj.attach_uprobe(name=lib.encode(), sym=sym.encode(), fn_name=fn.encode())
            except Exception as e:
                raise Refused(f"{probe}: could not attach a uprobe to {sym} in {lib}: {e}") from e
            seen_addr.add(addr)
            for ev in set(obj.uprobe_fds) - before:
                links.append({"kind": "uprobe", "target": sym, "event": ev.decode(), "fd": obj.uprobe_fds[ev]})
        if not links:
            raise Refused(f"{probe}: {lib} exports none of {', '.join(list(spec['symbols'])[:4])}...: is it libcuda "
                          f"(the driver library)? set [sources.ebpf] cuda_library")
        return links

    def groundwork(self) -> None:
        """What attaching needs that does not depend on the compiled programs: tc's stale filters
        and clsact qdiscs, libcuda's symbols. Kept in self.early by probe (an error is kept too)."""
        for p in self.req["probes"]:
            spec = p["attach"]
            try:
                if "tc" in spec:
                    from .tc import prepare_filters
                    self.early[p["name"]] = prepare_filters(spec["tc"])
                if "uprobes" in spec:
                    from bcc import BPF
                    self.early[p["name"]] = BPF.get_user_functions_and_addresses(spec["uprobes"]["library"].encode(),
                                                                                 b"^cu")
            except Exception as e:
                self.early[p["name"]] = e

    def maps(self) -> None:
        """Every map of every bcc object: fd and layout (bcc's type descriptions) for the agent."""
        from bcc.libbcc import lib
        lib.bpf_num_tables.restype, lib.bpf_num_tables.argtypes = ctypes.c_ulonglong, [ctypes.c_void_p]
        lib.bpf_table_name.restype, lib.bpf_table_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_ulonglong]
        for fn in ("bpf_table_key_size_id", "bpf_table_leaf_size_id"):
            getattr(lib, fn).restype = ctypes.c_size_t
            getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
        seen = set()
        for obj in self._all:
            m = obj.module
            for i in range(lib.bpf_num_tables(m)):
                name = lib.bpf_table_name(m, i)
                if name in seen:
                    continue
                seen.add(name)
                fd = lib.bpf_table_fd(m, name)
                if fd < 0:
                    continue
                self.manifest["maps"].append({
                    "name": name.decode(), "fd": self.fd(fd), "type": lib.bpf_table_type_id(m, i),
                    "key_size": lib.bpf_table_key_size_id(m, i), "value_size": lib.bpf_table_leaf_size_id(m, i),
                    "max_entries": lib.bpf_table_max_entries_id(m, i),
                    "key_desc": _json(lib.bpf_table_key_desc(m, name)),
                    "leaf_desc": _json(lib.bpf_table_leaf_desc(m, name))})

    def adopt(self, ahead: Builder) -> None:
        """Take what `ahead` compiled for the same C and flags instead of compiling again."""
        self.objects, self._all = ahead.objects, ahead._all
        for key in ("compile_mode", "combined_error", "compile_errors", "compile_s", "bcc_output"):
            if key in ahead.manifest:
                self.manifest[key] = ahead.manifest[key]

    def run(self, ahead: Callable[[], Builder | None] = lambda: None) -> None:
        """Compile (or adopt what `ahead()` gives, compiled from the same inputs: it may wait for that
        compile to end, while the groundwork runs), load, attach, list the maps."""
        t0 = time.perf_counter()
        try:
            import bcc  # noqa: F401  (Debian's python3-bpfcc)
        except Exception as e:
            raise Refused(f"bcc's Python module is not importable from {sys.executable} ({e}): install "
                          f"python3-bpfcc and link it into the virtualenv (scripts/setup.sh does both)") from e
        self.manifest["import_s"] = time.perf_counter() - t0
        early = threading.Thread(target=self.groundwork, daemon=True)
        early.start()       # netlink and ELF work needs no program: done while clang runs
        try:
            compiled = ahead()
            self.manifest["compiled_ahead"] = compiled is not None
            if compiled is not None:
                self.adopt(compiled)
            else:
                self.compile_all()
        finally:
            early.join()
            if not self.objects:
                self.undo_early()
        t1 = time.perf_counter()
        for p in self.req["probes"]:
            name = p["name"]
            if name not in self.objects:
                continue
            t = time.perf_counter()
            try:
                self.manifest["probes"][name] = self.attach_probe(p)
                self.manifest["probes"][name]["attach_s"] = round(time.perf_counter() - t, 4)
            except Refused as e:
                self.manifest["probes"][name] = {"ok": False, "reason": str(e)}
                self.undo_tc()
            except Exception as e:      # a host detail we did not foresee: say it, attach the others
                self.manifest["probes"][name] = {"ok": False,
                                                 "reason": f"{name}: attaching failed: {type(e).__name__}: {e}"}
                self.undo_tc()
            self._tc_cleanup.clear()
        self.manifest["attach_s"] = time.perf_counter() - t1
        self.undo_early()
        self.maps()

    def undo_early(self) -> None:
        """Groundwork for probes that were not attached after all (their C did not compile)."""
        from .tc import detach_filters
        for early in self.early.values():
            if isinstance(early, tuple):
                done, ipr = early
                if ipr is not None:
                    ipr.close()
                detach_filters(done)
        self.early.clear()

    def undo_tc(self) -> None:
        from .tc import detach_filters
        for done in self._tc_cleanup:
            detach_filters(done)


def write_entries(table: Any, entries: list | dict) -> None:
    """[[key, {field: value or [values]}], ...] -> map entries, or {"push": [values]} onto a queue
    (before the programs are attached)."""
    if isinstance(entries, dict):
        for x in entries.get("push", []):
            table.push(table.Leaf(x))
        return
    for key, fields in entries:
        v = table.Leaf()
        for field, val in fields.items():
            if isinstance(val, list):
                arr = getattr(v, field)
                for i, x in enumerate(val):
                    arr[i] = x
            else:
                setattr(v, field, val)
        table[table.Key(key)] = v


def _json(raw: bytes | None) -> Any:
    return json.loads(raw.decode()) if raw else "unsigned char"


def vm_hwm_kb() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


LIBBCC = b"libbcc.so.0"      # the name bcc's libbcc.py opens


def map_libbcc() -> None:
    """dlopen libbcc (and the libclang-cpp and libLLVM it needs) through a foreign call, which lets go of
    the GIL, so the guess's planning runs meanwhile (CPython's CDLL holds the GIL through dlopen); bcc's
    own ctypes.CDLL then finds it loaded. A failure is left to `import bcc` to say."""
    libc = ctypes.CDLL(None)
    libc.dlopen.restype, libc.dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
    libc.dlopen(LIBBCC, os.RTLD_NOW)    # never closed: the loader ends with os._exit


def preload(kallsyms: dict[str, str], compile_ready: threading.Event, compiling: threading.Event) -> None:
    """What every request needs, done while the agent is still planning: bcc's view of kallsyms made
    small (kallsyms.py, its outcome in kallsyms["note"]) while libbcc is mapped (map_libbcc, in a
    thread), then bcc imported and compile_ready set; then, once clang runs (`compiling`: it leaves the
    GIL free), pyroute2 for tc_traffic's filters (its import would otherwise hold up the guess)."""
    mapping = threading.Thread(target=map_libbcc, name="map-libbcc", daemon=True)
    mapping.start()     # reads from disk while kallsyms is read (kernel work)
    try:
        kallsyms["note"] = kallsyms.get("note") or kallsyms_mod.bind_bpf_symbols()
        mapping.join()
        import bcc  # noqa: F401
    except Exception as e:      # an import error is said again, with the reason, when the request needs bcc
        kallsyms["note"] = kallsyms.get("note") or f"{type(e).__name__}: {e}"
    finally:
        compile_ready.set()     # whatever happened: the compile must not wait for ever
    compiling.wait(REQUEST_WAIT_S)
    try:
        import pyroute2  # noqa: F401
    except Exception:
        pass


def compile_inputs(req: dict) -> str:
    """What compiling a request depends on (Builder.compile_all): equal inputs, equal programs and maps."""
    return json.dumps([bool(req.get("combined")), req.get("combined_text", ""),
                       [[p["name"], p["text"], p["cflags"]] for p in req["probes"]]])


class Ahead:
    """A guess of the agent's request (from its config), compiled in a thread before the request comes."""

    def __init__(self, guess: Callable[[], dict | None], compile_ready: threading.Event,
                 compiling: threading.Event) -> None:
        self.builder: Builder | None = None
        self.note = "not started"
        self.t0 = time.perf_counter()
        self.times: dict[str, float] = {}   # guessed, imported, compiled: seconds from the loader's start
        self._thread = threading.Thread(target=self._run, args=(guess, compile_ready, compiling),
                                        daemon=True)
        self._thread.start()

    def _run(self, guess: Callable[[], dict | None], compile_ready: threading.Event,
             compiling: threading.Event) -> None:
        try:
            req = guess()
            self.times["guessed"] = round(time.perf_counter() - self.t0, 3)
            if not req or not req["probes"]:
                self.note = "no probe can run here"
                return
            compile_ready.wait()
            self.times["imported"] = round(time.perf_counter() - self.t0, 3)
            b = Builder(req, compiling)
            b.compile_all()
            self.times["compiled"] = round(time.perf_counter() - self.t0, 3)
            self.builder, self.note = b, "compiled"
        except Exception as e:      # a guess that cannot be made only costs the time saved
            self.note = f"the guess failed: {type(e).__name__}: {e}"

    def take(self, req: dict) -> Builder | None:
        """The compiled guess if `req` asks for exactly that (waits for the compile to end: a second
        compile beside it would fight over fd 2, where bcc's output is caught)."""
        self._thread.join()
        if self.builder is None:
            return None
        if compile_inputs(self.builder.req) != compile_inputs(req):
            self.note = "the request asked for other probes or flags: compiled again"
            return None
        return self.builder


def guess_request(config_path: str) -> dict | None:
    """The request an agent with `config_path` ("": the built-in defaults) will send on this host: the
    agent's own planning (family.expected_request) run on that file's [sources.ebpf] table."""
    import tomllib

    from xpusense.common.config import load

    from .family import SCHEMA, expected_request
    keys: dict = {}
    if config_path:
        with open(config_path, "rb") as f:
            keys = tomllib.load(f).get("sources", {}).get("ebpf", {})
    table = load({"sources": {"ebpf": SCHEMA}}, None, env={}, flags={"sources.ebpf": keys} if keys else None)
    return expected_request(table.sources.ebpf)


def main(fd: int, config_path: str | None = None) -> None:
    """Serve one request on socket `fd`, then leave without bcc's clean-up (os._exit). Started before
    the agent has planned the probes: it imports bcc meanwhile, and gives up if no request comes. With
    `config_path` (the agent's config; "": the built-in defaults), the request that config makes is
    compiled meanwhile too (Ahead)."""
    sock = socket.socket(fileno=fd)
    code = 0
    t0 = time.perf_counter()
    kallsyms = {"note": kallsyms_mod.private_mounts()}     # before any thread starts
    compile_ready, compiling = threading.Event(), threading.Event()
    threading.Thread(target=preload, args=(kallsyms, compile_ready, compiling), daemon=True).start()
    ahead = None if config_path is None else Ahead(lambda: guess_request(config_path), compile_ready, compiling)
    try:
        try:
            req, _ = fd_channel.recv(sock, REQUEST_WAIT_S)
        except fd_channel.ChannelError:       # the agent closed (nothing to load) or never asked
            os._exit(0)
        t_req = time.perf_counter()
        compile_ready.wait()
        b = Builder(req, compiling)
        try:
            b.run((lambda: ahead.take(req)) if ahead is not None else (lambda: None))
        except Refused as e:
            b.manifest = {"ok": False, "reason": str(e)}
            b.fds = []
        except Exception as e:
            b.manifest = {"ok": False, "reason": f"the eBPF loader failed: {type(e).__name__}: {e}",
                          "traceback": traceback.format_exc()[-2000:]}
            b.fds = []
        b.manifest["pid"] = os.getpid()
        b.manifest["kallsyms"] = kallsyms["note"] or "private (bpf symbols only)"
        if ahead is not None:
            b.manifest["ahead"] = f"{ahead.note} {ahead.times}"
        b.manifest["request_after_s"] = round(t_req - t0, 3)
        b.manifest["done_after_s"] = round(time.perf_counter() - t0, 3)
        b.manifest["vm_hwm_kb"] = vm_hwm_kb()
        fd_channel.send(sock, b.manifest, b.fds)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
