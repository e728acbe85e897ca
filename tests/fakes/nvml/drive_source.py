"""Run the agent's NVML source in this process (started with the fake on LD_LIBRARY_PATH) and
print what it saw as one JSON document: inventory, describe(), and the samples of each round.

    python drive_source.py ROUNDS [--gap-s 0.25] [--until-event TYPE --deadline-s 15]

ROUNDS is a comma list of tiers (realtime, nearline, offline) run in order, `gap-s` apart (GPM
metrics are computed between two samples, so realtime rounds need time between them).
"""

import argparse
import json
import time

from xpusense.agent.sources.nvml.source import NvmlSource


def dump(samples):
    return [{"name": s.name, "value": s.value, "unit": s.unit, "labels": s.labels, "kind": s.kind} for s in samples]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("rounds")
    p.add_argument("--gap-s", type=float, default=0.25)
    p.add_argument("--until-event", default="")
    p.add_argument("--deadline-s", type=float, default=15.0)
    a = p.parse_args()
    src = NvmlSource(event_wait_ms=50)
    src.setup()
    out = {"inventory": src.inventory(), "rounds": [], "events": [], "errors": []}
    try:
        tiers = a.rounds.split(",")
        deadline = time.monotonic() + a.deadline_s
        i = 0
        while i < len(tiers) or (a.until_event and not any(e["type"] == a.until_event for e in out["events"])
                                 and time.monotonic() < deadline):
            tier = tiers[i % len(tiers)]
            try:
                samples = src.collect(tier)
            except Exception as e:  # recorded: the test decides whether that is a failure
                out["errors"].append(f"{type(e).__name__}: {e}")
                samples = []
            out["rounds"].append({"tier": tier, "t": time.time(), "samples": dump(samples)})
            out["events"] += [{"type": e.type, "device": e.device, "severity": e.severity, "message": e.message,
                               "attributes": e.attributes} for e in src.events()]
            i += 1
            time.sleep(a.gap_s)
        out["describe"] = src.describe()
        out["processes"] = {str(k): sorted(v) for k, v in src.processes().items()}
    finally:
        src.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
