"""Run the agent's NVML source in this process (started with the fake on LD_LIBRARY_PATH) and
print what it saw as one JSON document: inventory, describe(), and the samples of each round.

    python drive_source.py ROUNDS [--gap-s 0.25] [--until-event TYPE] [--until-t T] [--deadline-s 15]
                                  [--no-gpm] [--no-events] [--max-process-samples N]

ROUNDS is a comma list of tiers (realtime, nearline, offline) run in order, `gap-s` apart (main())."""

import argparse
import json
import math
import time

import pynvml

from xpusense.agent.sources.nvml.source import NvmlSource


def dump(samples):
    return [{"name": s.name, "value": s.value if math.isfinite(s.value) else repr(s.value), "unit": s.unit,
             "labels": s.labels, "kind": s.kind} for s in samples]


def scenario_now() -> float:
    fn = pynvml.nvmlLib.fakeNvmlNow
    fn.restype = pynvml.c_double
    return fn()


def main():
    """GPM metrics are computed between two samples, so realtime rounds need time between them; with
    --until-event or --until-t the list of rounds repeats until that event arrived or the scenario
    clock reached T (or the deadline passed). Each round records `st`, the scenario time when it
    started (the fake's fakeNvmlNow()), so a test judges rounds by where they fell on the timeline,
    not by how fast it ran; each event records the index of the round after which it was drained."""
    p = argparse.ArgumentParser()
    p.add_argument("rounds")
    p.add_argument("--gap-s", type=float, default=0.25)
    p.add_argument("--until-event", default="")
    p.add_argument("--until-t", type=float, default=None)
    p.add_argument("--deadline-s", type=float, default=15.0)
    p.add_argument("--no-gpm", action="store_true")
    p.add_argument("--no-events", action="store_true")
    p.add_argument("--sysfs", default="/sys")
    p.add_argument("--max-process-samples", type=int, default=64)
    a = p.parse_args()
    src = NvmlSource(event_wait_ms=50, gpm=not a.no_gpm, events=not a.no_events, sysfs=a.sysfs,
                     max_process_samples=a.max_process_samples)
    src.setup()
    out = {"inventory": src.inventory(), "rounds": [], "events": [], "errors": []}

    def more(i: int) -> bool:
        if time.monotonic() >= deadline:
            return False
        if a.until_event and not any(e["type"] == a.until_event for e in out["events"]):
            return True
        return a.until_t is not None and scenario_now() < a.until_t

    try:
        tiers = a.rounds.split(",")
        deadline = time.monotonic() + a.deadline_s
        i = 0
        while i < len(tiers) or more(i):
            tier = tiers[i % len(tiers)]
            st = scenario_now()
            try:
                samples = src.collect(tier)
            except Exception as e:  # recorded: the test decides whether that is a failure
                out["errors"].append(f"{type(e).__name__}: {e}")
                samples = []
            out["rounds"].append({"tier": tier, "t": time.time(), "st": st, "samples": dump(samples)})
            out["events"] += [{"type": e.type, "device": e.device, "severity": e.severity, "message": e.message,
                               "attributes": e.attributes, "round": i} for e in src.events()]
            i += 1
            time.sleep(a.gap_s)
        out["events"] += [{"type": e.type, "device": e.device, "severity": e.severity, "message": e.message,
                           "attributes": e.attributes, "round": i} for e in src.events()]
        out["describe"] = src.describe()
        out["coverage"] = src.hbm_watch_coverage()
        out["processes"] = {str(k): sorted(v) for k, v in src.processes().items()}
    finally:
        src.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
