"""Wires the agent together: sources from config -> tier loop -> stream client to the collector."""

from __future__ import annotations

import logging
import os
import platform
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable

from xpusense import __version__
from xpusense.common.config import addresses
from xpusense.common.tls import channel_options, make_channel
from xpusense.v1 import telemetry_pb2 as pb

from .batch_build import batch_problem
from .diagnosis.base import Context
from .diagnosis.registry import build_diagnoser
from .hbm_watch import HbmWatch, Rule
from .nfd_labels import build_nfd_writer
from .otlp_export import build_agent_exporter
from .pod_rollup import pod_rollups
from .pods import build_pod_labeler
from .sdnotify import Watchdog
from .sources.agent_self import AgentSelfSource
from .sources.base import Source
from .sources.registry import FAMILIES
from .spool import Spool
from .stream import StreamClient
from .tiers import SourceState, TierLoop, periods_from_config, setup_source, setup_sources

log = logging.getLogger("xpusense.agent")


def build_sources(cfg) -> list[Source]:
    """Every source enabled in config, family by family in the registry's order (host first)."""
    out: list[Source] = []
    for family in FAMILIES:
        table = getattr(cfg.sources, family.name)
        if table.enabled:
            out.extend(family.build(table))
    return out


def host_resource() -> dict:
    import psutil
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gb = psutil.virtual_memory().total / 1e9
    return {"type": "CPU", "vendor": platform.machine(), "model": model,
            "attributes": {"logical_cpus": str(psutil.cpu_count() or 0), "memory": f"{mem_gb:.0f}GB"},
            "interconnects": []}


def inventory(cfg, states: list[SourceState]) -> dict:
    resources = [host_resource()]
    for st in states:
        if st.state == "running":
            resources.extend(st.source.inventory())
    return {"hostname": socket.gethostname(), "node_id": cfg.node_id, "labels": dict(cfg.labels),
            "resources": resources}


def inventory_to_proto(inv: dict) -> pb.Inventory:
    m = pb.Inventory(hostname=inv["hostname"], labels=inv["labels"])
    for r in inv["resources"]:
        m.resources.add(type=r["type"], vendor=r.get("vendor", ""), model=r.get("model", ""),
                        id=str(r.get("id", "")),
                        attributes={k: str(v) for k, v in r.get("attributes", {}).items()},
                        interconnects=[pb.Interconnect(type=i["type"], bandwidth=str(i.get("bandwidth", "")))
                                       for i in r.get("interconnects", [])])
    return m


def watch_rules(w) -> dict[str, Rule]:
    general = Rule(w.threshold, w.window_s, w.low_mark, w.cooldown_s)
    rules = {"default": general}
    for vendor, r in vars(w.vendor).items():
        rules[vendor] = Rule(*(getattr(r, k) if getattr(r, k) is not None else getattr(general, k)
                               for k in ("threshold", "window_s", "low_mark", "cooldown_s")))
    return rules


def process_map(states: list[SourceState]) -> dict[int, set[str]]:
    """pid -> accelerators it uses, merged from every running source that lists processes."""
    out: dict[int, set[str]] = {}
    for st in states:
        if st.state != "running":
            continue
        try:
            found = st.source.processes()
        except Exception as e:  # a request for the other accelerators must still go out
            log.warning("source %s: cannot list accelerator processes: %s", st.name, e)
            continue
        for pid, devs in found.items():
            out.setdefault(pid, set()).update(devs)
    return out


class InventoryWatch:
    """Says when this node's inventory changed (a GPU lost, MIG reconfigured, a driver update), so the
    stream sends it again: checked when a round brings events, else at most every `period_s`."""

    def __init__(self, compute: Callable[[], dict], on_change: Callable[[], None], period_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.compute, self.on_change, self.period_s, self.clock = compute, on_change, period_s, clock
        self._last: dict | None = None
        self._checked = float("-inf")

    def check(self, events: list) -> None:
        now = self.clock()
        if not events and now - self._checked < self.period_s:
            return
        self._checked = now
        current = self.compute()
        if self._last is not None and current != self._last:
            self.on_change()
        self._last = current


STARTUP_WAIT_S = 2.0   # how long start-up waits for the sources' setup before streaming what it has


class Agent:
    def __init__(self, cfg, setup_in_background: bool = True):
        """`setup_in_background`: sources that take longer than STARTUP_WAIT_S to set up (a hanging
        npu-smi, a slow eBPF compile) join the running loop when ready, so the others stream at once;
        `run --once` sets them all up first."""
        self.cfg = cfg
        self.boot_id = uuid.uuid4().hex
        self.stop_event = threading.Event()
        self.spool, spooled = None, []
        if cfg.spool.enabled:   # first: a spool that cannot open stops the agent before probes load
            sp = cfg.spool
            self.spool = Spool(Spool.for_node(sp.dir, cfg.node_id), sp.max_bytes, sp.segment_bytes, sp.fsync,
                               sp.fsync_interval_s, on_drop=lambda keys, n: self.stream.spool_dropped(keys, n),
                               max_batches=sp.max_batches, damaged_max_bytes=sp.damaged_max_bytes,
                               validate=batch_problem(cfg.node_id), node_id=cfg.node_id)
            spooled = self.spool.open()   # SpoolError: the CLI says what to fix
        sources = build_sources(cfg)
        self._states_lock = threading.Lock()
        self._setting_up: set[Source] = set()
        self.states, startup_events = ([], []) if setup_in_background else setup_sources(sources)
        s = cfg.stream
        self.stream = StreamClient(
            cfg.collector.address, cfg.node_id, self.boot_id,
            lambda: inventory_to_proto(inventory(cfg, self.states)),
            queue_batches=s.queue_batches, flush_s=s.flush_s, max_samples_per_batch=s.max_samples_per_batch,
            backoff_initial_s=s.backoff_initial_s, backoff_max_s=s.backoff_max_s, agent_version=__version__,
            backoff_reset_s=s.backoff_reset_s, reconnect_max_s=s.reconnect_max_s, series_idle_s=s.series_idle_s,
            batch_encoding=s.batch_encoding, max_series_defs=s.max_series_defs,
            spool=self.spool, channel=[make_channel(a, cfg.collector, options=channel_options(
                s.backoff_initial_s, min(s.backoff_max_s, s.reconnect_max_s), connect_timeout_s=5.0))
                for a in addresses(cfg.collector.address)])
        self.stream.resume(spooled)
        self_state, _ = setup_sources([AgentSelfSource(self.stream.status, self._nfd_status)])
        self.states = self.states + self_state
        w = cfg.hbm_watch
        self.watch = HbmWatch(watch_rules(w), lambda: process_map(self.states), actions=w.actions,
                              signal_name=w.signal, request_dir=w.request_dir,
                              group_by=w.group_by) if w.enabled else None
        self.diagnoser = build_diagnoser(cfg.diagnosis, Context(processes=lambda: process_map(self.states)))
        self._sink_lock = threading.Lock()
        self.inventory_watch = InventoryWatch(lambda: inventory(cfg, self.states), self.stream.inventory_changed)
        self.loop = TierLoop(self.states, periods_from_config(cfg.tiers), self._sink,
                             timeout_ratio=cfg.tiers.timeout_ratio)
        if startup_events:
            self.stream.put([], startup_events)
        self.pods = build_pod_labeler(cfg, lambda: inventory(cfg, self.states)["resources"])   # [k8s]
        self.nfd = build_nfd_writer(cfg, lambda: inventory(cfg, self.states)["resources"])   # [k8s] nfd_*
        self.otlp = build_agent_exporter(cfg, lambda: inventory_to_proto(inventory(cfg, self.states)))
        tiers = {t for src in sources for t in src.tiers} | set(self.loop.tiers_in_use())
        self.watchdog = Watchdog(lambda: sum(self.loop.rounds.values()),   # systemd READY=1 / WATCHDOG=1
                                 stall_s=2 * min((self.loop.periods_s[t] for t in tiers), default=60),
                                 status=self.stream.health)
        if self.otlp is None or not self.otlp.only:   # delivery stopped (batcher or sender stuck): no pings
            self.watchdog.watch("delivery", self.stream.progress, stall_s=max(5.0, 10 * s.flush_s))
        if setup_in_background:
            self._setup_in_background(sources)

    def _nfd_status(self) -> dict | None:
        """The NFD feature file's counters for the agent's own metrics (None: not written)."""
        nfd = getattr(self, "nfd", None)   # built after the agent's own source
        return nfd.describe() if nfd is not None else None

    def _setup_in_background(self, sources: list[Source]) -> None:
        """Every source's setup in a thread of its own; waits up to STARTUP_WAIT_S for them all."""
        self.loop.joining = len(sources)
        self._setting_up = set(sources)
        threads = [threading.Thread(target=self._setup_late, args=(src,), name=f"setup-{src.name}", daemon=True)
                   for src in sources]
        for t in threads:
            t.start()
        deadline = time.monotonic() + STARTUP_WAIT_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if late := [t.name.removeprefix("setup-") for t in threads if t.is_alive()]:
            log.info("still setting up: %s (they join when ready; the other sources stream now)", ", ".join(late))

    def _setup_late(self, src: Source) -> None:
        st, events = setup_source(src)
        with self._states_lock:
            self._setting_up.discard(src)
            stopped = self.stop_event.is_set()
            self.states = self.states + [st]
            if st.state == "running" and not stopped:
                self.loop.add(st)
            self.loop.joining -= 1
        if stopped and st.state == "running":   # the agent stopped while this source set up
            src.close()
            return
        if events:
            self.stream.put([], events)
        self.stream.inventory_changed()

    def _sink(self, samples, events) -> None:
        """Tier loop -> HBM watch -> stream (called from the sources' worker threads)."""
        if self.pods is not None:   # [k8s] enabled: pod labels, and per-pod sums of the process series
            samples = self.pods.label(samples)
            samples += pod_rollups(samples)
        with self._sink_lock:
            if self.watch is not None:
                events = events + self.watch.observe(samples)
            if self.diagnoser is not None:
                found = self.diagnoser.observe(samples)
                if self.pods is not None:   # [k8s]: the pod a diagnosis concerns
                    found = [self.pods.label_event(e) for e in found]
                events = events + found
            self.inventory_watch.check(events)
            if self.nfd is not None:
                self.nfd.observe(samples, events)
        if self.otlp is not None:
            self.otlp.put(samples)
            if self.otlp.only:   # [export.otlp] only: no collector stream
                return
        self.stream.put(samples, events)

    def run(self, once: bool = False) -> int:
        if self.otlp is None or not self.otlp.only:
            self.stream.start()
        if self.otlp is not None and not once:
            self.otlp.start()
        self.watchdog.start()
        try:
            if once:
                self.loop.run_once()
                if self.otlp is not None and not self.otlp.flush():
                    log.error("OTLP backend %s did not accept the points", self.cfg.export.otlp.endpoint)
                    return 1
                if self.otlp is not None and self.otlp.only:
                    return 0
                if not self.stream.drain(timeout_s=15.0):
                    log.error("collector %s did not acknowledge %d batches within 15 s (%s)",
                              self.cfg.collector.address, self.stream.pending(), self.stream.last_error)
                    return 1
                return 0
            log.info("agent %s (boot %s) streaming to %s; sources: %s", self.cfg.node_id, self.boot_id,
                     self.cfg.collector.address,
                     ", ".join(f"{s.name}={s.state}" for s in self.states))
            self.loop.run(self.stop_event)
            return 0
        finally:
            with self._states_lock:
                self.stop_event.set()   # a source still setting up closes itself when it is done...
                setting_up = list(self._setting_up)
            for src in setting_up:      # ...and is told to give up now (kills a hung npu-smi call)
                try:
                    src.close()
                except Exception:
                    log.exception("source %s: close during setup failed", src.name)
            self.watchdog.stop()
            if self.otlp is not None:
                self.otlp.stop()
            if self.pods is not None:
                self.pods.close()
            self.loop.close()
            self.stream.stop(drain_s=2.0)
            if self.spool is not None:
                self.spool.close()

    def install_signal_handlers(self) -> None:
        agent_pid = os.getpid()

        def on_signal(signum, _frame):
            if os.getpid() != agent_pid:   # a child a library forked (pyroute2's netns helper): die as told
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            log.info("received %s, stopping", signal.Signals(signum).name)
            self.stop_event.set()
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
