"""The scheduler core over gRPC (`xpusense.v1.Scheduler/Place` on the collector's port) and the
`xpusense-collector place` command that calls it and prints the ranked answer as JSON or a table."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys

import grpc
from google.protobuf import json_format

from xpusense.v1 import scheduler_pb2 as spb
from xpusense.v1 import scheduler_pb2_grpc as spb_grpc

from ..config import load_collector
from ..fleet_interface import Fleet
from .config import DIMENSIONS, PlaceError
from .core import Scheduler
from .inventory import parse_memory

log = logging.getLogger("xpusense.collector.scheduler")

SCHEDULER_SERVICE = spb.DESCRIPTOR.services_by_name["Scheduler"].full_name
ACCELERATORS = {"any": spb.ACCELERATOR_ANY, "gpu": spb.ACCELERATOR_GPU, "npu": spb.ACCELERATOR_NPU}
RESIDENCIES = {"none": spb.RESIDENCY_NONE, "region": spb.RESIDENCY_REGION, "province": spb.RESIDENCY_PROVINCE}


class SchedulerServicer(spb_grpc.SchedulerServicer):
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    async def Place(self, request, context):
        # The core runs on the loop that owns the fleet state, in one go: no await inside it.
        # Until the reply is out, the view's bulk refresh (and a replica's watch) waits (fleet.py).
        view = self.scheduler.view
        view.serve_begin()
        try:
            context.add_done_callback(lambda _ctx: view.serve_end())
        except Exception:   # a context without done callbacks: nothing is held for it
            view.serve_end()
        try:
            return self.scheduler.place(request)
        except PlaceError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


def add_to_server(server: grpc.aio.Server, state: Fleet, cfg=None) -> Scheduler:
    """Build the core over `state` (call it on the loop that owns the state) and serve it.
    `cfg`: the collector's loaded configuration; None: its defaults."""
    if cfg is None:
        cfg = load_collector(None, env={})
    core = Scheduler(state, cfg.scheduler, cfg.stale_s)
    spb_grpc.add_SchedulerServicer_to_server(SchedulerServicer(core), server)
    return core


# -- the `place` command ---------------------------------------------------------------------------

def add_place_parser(sub, default_collector: str) -> argparse.ArgumentParser:
    q = sub.add_parser("place", help="where a job would go now: ranked nodes with the score per dimension")
    q.add_argument("--collector", metavar="HOST:PORT", default=default_collector)
    q.add_argument("--accelerator", choices=list(ACCELERATORS), default="any")
    q.add_argument("--memory", default="0", help="HBM free needed on each device, e.g. 40GB (GB = 2^30 bytes)")
    q.add_argument("--count", type=int, default=1, help="devices, all on one node")
    q.add_argument("--same-domain", action="store_true", help="the devices must share one NVLink/HCCS domain")
    q.add_argument("--region", action="append", default=[], metavar="R", help="allowed region (repeat)")
    q.add_argument("--data-region", default="", metavar="R", help="where the job's data lives")
    q.add_argument("--zone", action="append", default=[], metavar="Z", help="a zone the job's other replicas use (repeat)")
    q.add_argument("--residency", choices=list(RESIDENCIES), default="none",
                   help="data may not leave its region (--data-region) or province (--data-province)")
    q.add_argument("--data-province", default="", metavar="P")
    q.add_argument("--require-encryption", action="store_true")
    q.add_argument("--require-attestation", action="store_true")
    q.add_argument("--weight", action="append", default=[], metavar="NAME=RATIO",
                   help=f"override a weight ({', '.join(DIMENSIONS)}), e.g. compute=0.45")
    q.add_argument("--limit", type=int, default=10, help="candidates shown")
    q.add_argument("--format", choices=["table", "json"], default="table")
    q.add_argument("--timeout-s", type=float, default=5.0, help="give up on the collector after this long")
    return q


def request_from_args(args) -> spb.PlaceRequest:
    if args.count < 1:
        raise ValueError(f"--count must be 1 or more, got {args.count}")
    if args.limit < 1:
        raise ValueError(f"--limit must be 1 or more, got {args.limit}")
    req = spb.PlaceRequest(accelerator=ACCELERATORS[args.accelerator], memory_bytes=parse_memory(args.memory),
                           count=args.count, same_domain=args.same_domain, allowed_regions=args.region,
                           data_region=args.data_region, replica_zones=args.zone,
                           residency=RESIDENCIES[args.residency], data_province=args.data_province,
                           require_encryption=args.require_encryption,
                           require_attestation=args.require_attestation, limit=args.limit)
    for item in args.weight:
        name, sep, value = item.partition("=")
        if not sep or name not in DIMENSIONS:
            raise ValueError(f"--weight {item!r}: give NAME=RATIO with NAME one of {', '.join(DIMENSIONS)}")
        try:
            setattr(req.weights, name, float(value))
        except ValueError:
            raise ValueError(f"--weight {item!r}: {value!r} is not a number") from None
    return req


def reply_to_dict(reply: spb.PlaceReply) -> dict:
    return json_format.MessageToDict(reply, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def render_table(reply: spb.PlaceReply, width: int = 120) -> str:
    w = reply.weights
    head = (f"{reply.nodes_feasible} of {reply.nodes_total} nodes can take it; decided in "
            f"{reply.decision_us / 1000:.2f} ms; weights " +
            " ".join(f"{k}={getattr(w, k):.2f}" for k in DIMENSIONS))
    rows = [("#", "NODE", "SCORE", "COMPUTE", "DATA", "DR", "COMPLY", "TYPE", "MODEL", "REGION/ZONE", "DEVICES", "NOTES")]
    for i, c in enumerate(reply.candidates, 1):
        dims = {d.dimension: d.score for d in c.dimensions}
        notes = [f"x{p.factor:g} {p.reason} {p.device}" for p in c.penalties]
        notes += [f"{d.device} out: {d.reason}" for d in c.excluded_devices]
        rows.append((str(i), c.node_id, f"{c.score:.3f}", *(f"{dims.get(k, 0):.2f}" for k in DIMENSIONS),
                     c.accelerator_type, c.model, f"{c.labels.get('region', '-')}/{c.labels.get('zone', '-')}",
                     ",".join(c.devices), "; ".join(notes)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head, ""]
    for r in rows:
        lines.append("  ".join(x.ljust(widths[i]) for i, x in enumerate(r)).rstrip()[:max(width, 40)])
    if not reply.candidates:
        lines.append("(no node can take this job now)")
    if reply.excluded_counts:
        lines += ["", "left out: " + ", ".join(f"{k} {v}" for k, v in sorted(reply.excluded_counts.items()))]
        for e in reply.excluded:
            lines.append(f"  {e.node_id}: {e.reason}: {e.detail}"[:max(width, 40)])
            for d in e.devices:
                lines.append(f"    {d.device}: {d.reason}: {d.detail}"[:max(width, 40)])
    return "\n".join(lines)


def place_command(args) -> int:
    """`xpusense-collector place`: 0 with an answer (even an empty one), 2 bad usage, 1 unreachable."""
    req = request_from_args(args)   # ValueError -> exit 2 in cli.main
    channel = getattr(args, "channel", None)   # TLS / token flags, as for `nodes` (collector/cli.py)
    try:
        with (channel() if channel is not None else grpc.insecure_channel(args.collector)) as ch:
            reply = spb_grpc.SchedulerStub(ch).Place(req, timeout=args.timeout_s)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            print(f"xpusense-collector: {e.details()}", file=sys.stderr)
            return 2
        hint = ("is `xpusense-collector serve` running there? set --collector HOST:PORT"
                if e.code() != grpc.StatusCode.UNIMPLEMENTED else "that collector has no scheduler: upgrade it")
        print(f"xpusense-collector: cannot place with the collector at {args.collector} "
              f"({e.code().name}: {e.details()}); {hint}", file=sys.stderr)
        return 1
    if args.format == "json":
        json.dump(reply_to_dict(reply), sys.stdout, indent=2)
        print()
    else:
        print(render_table(reply, shutil.get_terminal_size().columns))
    return 0

