"""What the eBPF loader process handed over for one probe (`ProbeHandle`): its program and attachment
fds and its maps. Closing the attachment fds (perf events, raw tracepoints) detaches the probe.
"""

from __future__ import annotations

import logging
import os

from .bpfmap import BpfMap

log = logging.getLogger("xpusense.agent.sources.ebpf")


class ProbeHandle:
    """What the loader process handed over for one probe: its programs' and attachments' fds, and the
    maps (shared by all probes of the loader). Closing the attachment fds detaches the probe."""

    def __init__(self, probe: str, maps: dict[str, BpfMap], progs: list[tuple[str, int]], links: list[dict],
                 extra: dict, tracefs: str, attach_s: float = 0.0):
        self.probe, self.maps, self.progs, self.links, self.extra = probe, maps, progs, links, extra
        self.attach_s = attach_s         # loading (verifier) and attaching its programs, in the loader
        self.tracefs = tracefs
        self.closed = False

    def table(self, name: str) -> BpfMap:
        try:
            return self.maps[name]
        except KeyError:
            raise KeyError(f"{self.probe}: the loader handed over no map {name!r}") from None

    @property
    def attached(self) -> list[tuple[str, str]]:
        return [(link["kind"], link["target"]) for link in self.links]

    def close(self) -> None:
        """Detach (close the perf event and raw tracepoint fds), then drop the programs."""
        if self.closed:
            return
        self.closed = True
        for link in reversed(self.links):
            if link.get("fd") is not None:
                close_fd(link["fd"])
            if link["kind"] == "uprobe" and link.get("event"):
                remove_uprobe_event(self.tracefs, link["event"])
        for _fn, fd in self.progs:
            close_fd(fd)


def remove_uprobe_event(tracefs: str, event: str) -> None:
    """A uprobe bcc created through tracefs (kernels without the uprobe PMU) is removed by name;
    one made through the PMU (Linux 4.17+) went with its perf event fd, and is not listed."""
    path = os.path.join(tracefs, "uprobe_events")
    try:
        with open(path) as f:
            listed = any(line.split(" ", 1)[0].endswith("/" + event) for line in f)
        if listed:
            with open(path, "a") as f:
                f.write(f"-:{event}\n")
    except OSError:
        log.debug("removing uprobe event %s failed", event, exc_info=True)


def close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
