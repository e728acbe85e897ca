"""Wire and disk bytes a point of a real agent streaming to a durable collector in Sample messages, the
compact encoding's version 1, the agent's default and its blocks chained (`[stream] batch_encoding`):
the agent (8 fake H100 at 1 s, the host, every eBPF probe that runs here; `--npu`: 8 Ascend 910B4
through the fake npu-smi) sends through a byte-counting TCP relay, cut once mid-run so it reconnects
and resends, to `xpusense-collector serve --data-dir`; every point the collector then serves
(GetHistory) is counted. Needs root (eBPF, network namespaces, a device node).

    sudo .venv/bin/python bench/wire_bytes.py [--seconds 60] [--npu] [--only before|columns-1|after|chained ...] [--record]

Prints a table, then one line of JSON (bench/README.md says what each figure is)."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from datetime import UTC, datetime
from pathlib import Path

from _proc import free_port, stop, tool, wait_collector, write_bytes
from ebpf_cost import sh, wait_for
from fleet_scale import cpu_model
from footprint import agent_config, make_fakes

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "wire_bytes.jsonl"
NPU_SMI = ROOT / "tests" / "fakes" / "npu-smi" / "npu-smi"
NPU_SCENARIO = ROOT / "tests" / "fixtures" / "npu-smi" / "scenario-8x910B4"
GOALS = {"wire_bytes_per_point": 4.0, "collector_disk_bytes_per_point": 6.0}
# The agent's [stream] batch_encoding per run: "" is Sample messages only; None leaves the key out
# (the agent's default, the compact encoding where the agent has it).
RUNS = {"before": "", "columns-1": "columns-zlib-1", "after": None, "chained": "columns-zlib-2-chained"}
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
KEEP_BYTES = 256 * 2**20   # upstream bytes the relay keeps to read apart (far above a run's)


class Relay:
    """A TCP relay on loopback to `target`, counting the bytes each way (up: agent to collector);
    cut() closes every connection it carries, so the agent reconnects through it."""

    def __init__(self, target: tuple[str, int], keep_bytes: int = KEEP_BYTES):
        self.target = target
        self.keep_bytes = keep_bytes   # upstream bytes kept to be read apart (wire_parts), at most
        self.kept: list[bytearray] = []   # per connection, in order
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.lock = threading.Lock()
        self.up = self.down = self.accepted = self.pumps = 0
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self.lock:
                self.accepted += 1
                self.pumps += 2
                self.socks = [s for s in self.socks if s.fileno() != -1] + [client, upstream]
                kept = bytearray()
                self.kept.append(kept)
            threading.Thread(target=self._pump, args=(client, upstream, True, kept), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool, kept: bytearray | None = None) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
                with self.lock:
                    if up:
                        self.up += len(data)
                        if kept is not None and self.up <= self.keep_bytes:
                            kept += data
                    else:
                        self.down += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            src.close()   # each socket is closed by the pump that reads it
            with self.lock:
                self.pumps -= 1

    def cut(self) -> None:
        with self.lock:
            for s in self.socks:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()
        self.cut()


def wire_parts(connections: list[bytes], compressed: dict[str, int] | None = None) -> dict[str, int]:
    """The upstream bytes of HTTP/2 connections carrying the Ingest stream, by what they carry: each
    AgentMessage kind's message bytes ("batch", "series", "hello", ...; a message gRPC compressed
    counts its compressed bytes, less the AgentMessage's own tag and length), and "framing" for the
    rest (the connection preface, frame headers, frames other than DATA, gRPC's 5-byte message
    prefixes, a message cut off by the end of a connection). `compressed`: counts the messages of
    each kind that went compressed."""
    from xpusense.v1 import telemetry_pb2 as pb
    out: dict[str, int] = {"framing": 0}
    for data in connections:
        i = len(H2_PREFACE) if data.startswith(H2_PREFACE) else 0
        out["framing"] += i
        streams: dict[int, bytearray] = {}
        while i + 9 <= len(data):
            length, kind, stream = int.from_bytes(data[i:i + 3], "big"), data[i + 3], \
                int.from_bytes(data[i + 5:i + 9], "big") & 0x7FFFFFFF
            payload = data[i + 9:i + 9 + length]
            out["framing"] += 9 + (0 if kind == 0 else len(payload))
            if kind == 0:   # DATA (gRPC never pads)
                streams.setdefault(stream, bytearray()).extend(payload)
            i += 9 + length
        out["framing"] += len(data) - min(i, len(data))
        for buf in streams.values():
            j = 0
            while j + 5 <= len(buf):
                n = int.from_bytes(buf[j + 1:j + 5], "big")
                if j + 5 + n > len(buf):
                    break
                body = bytes(buf[j + 5:j + 5 + n])
                msg = pb.AgentMessage.FromString(gzip.decompress(body) if buf[j] == 1 else body)
                what = msg.WhichOneof("msg") or "empty"
                inner = getattr(msg, what).ByteSize() if what != "empty" else 0
                if buf[j] == 1:   # gRPC's compressed flag: the bytes sent, less what the tag took
                    inner = max(0, n - (msg.ByteSize() - inner))
                    if compressed is not None:
                        compressed[what] = compressed.get(what, 0) + 1
                out[what] = out.get(what, 0) + inner
                out["framing"] += 5 + n - inner   # the prefix, AgentMessage's tag and length
                j += 5 + n
            out["framing"] += len(buf) - j
    return out


class FileBytes:
    """The bytes the files under some directories reached, polled every 0.2 s: per file its largest
    size seen, summed (temporary files renamed into place count under their final name)."""

    def __init__(self, *dirs: str):
        self.dirs = dirs
        self.sizes: dict[str, int] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def poll(self) -> None:
        for d in self.dirs:
            for base, _, files in os.walk(d):
                for name in files:
                    if name.startswith(".tmp-") or name.endswith(".tmp"):
                        continue
                    path = os.path.join(base, name)
                    try:
                        size = os.stat(path).st_size
                    except OSError:
                        continue
                    self.sizes[path] = max(size, self.sizes.get(path, 0))

    def _run(self) -> None:
        while not self.done.wait(0.2):
            self.poll()

    def total(self) -> int:
        self.done.set()
        self.thread.join(10)
        self.poll()
        return sum(self.sizes.values())


class Log:
    """A process's output through a pipe (written to no disk, so not in its write_bytes): the last lines."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: deque[str] = deque(maxlen=40)
        assert proc.stdout is not None
        out = proc.stdout
        threading.Thread(target=lambda: self.lines.extend(out), daemon=True).start()

    def tail(self) -> str:
        return "".join(self.lines)


def default_encoding() -> str | None:
    """This agent's default [stream] batch_encoding; None where it has no such key (an agent that
    sends Sample messages only)."""
    from xpusense.agent.config import AGENT_SCHEMA
    key = AGENT_SCHEMA["stream"].get("batch_encoding")
    return None if key is None else key.default


def count_points(address: str, node_id: str) -> tuple[int, int, dict]:
    """(points, series, the node's view) the collector holds for `node_id`: every series of
    ListNodes, page after page, and GetHistory of each."""
    import grpc

    from xpusense.v1 import telemetry_pb2 as pb
    from xpusense.v1 import telemetry_pb2_grpc as pb_grpc
    keys: set[tuple] = set()
    node: dict = {}
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 * 2**20)]) as ch:
        q = pb_grpc.QueryStub(ch)
        token = ""
        while True:
            reply = q.ListNodes(pb.ListNodesRequest(node_id=node_id, page_token=token), timeout=30)
            node.setdefault("store", {k[6:]: v for k, v in reply.counters.items() if k.startswith("store.")})
            for n in reply.nodes:
                if n.node_id == node_id:
                    node.setdefault("batches_stored", n.batches_stored)
                    node.setdefault("batches_duplicate", n.batches_duplicate)
                    keys.update((s.name, tuple(sorted(s.labels.items()))) for s in n.series)
            token = reply.next_page_token
            if not token:
                break
        points = 0
        for name, labels in sorted(keys):
            h = q.GetHistory(pb.HistoryRequest(node_id=node_id, name=name, labels=dict(labels)), timeout=30)
            points += len(h.points)
    return points, len(keys), node


def agent_toml(run_dir: str, args, net: tuple[str, str], lib: str, glob: str, encoding: str | None) -> str:
    """footprint.py's agent config (spool in run_dir, the eBPF probes on the bench's veth), with NVML or
    npu-smi, eBPF off with --no-ebpf, and [stream] batch_encoding where this agent has the key."""
    path = agent_config(run_dir, net[0], net[1], lib, glob)
    text = Path(path).read_text()
    if args.npu:
        text = text.replace("[sources.npu_smi]\nenabled = false\n", "[sources.nvml]\nenabled = false\n")
    if args.no_ebpf:
        text = text.replace("[sources.ebpf]\n", "[sources.ebpf]\nenabled = false\n")
    if encoding is not None and default_encoding() is not None:
        text += f"[stream]\nbatch_encoding = {json.dumps(encoding)}\n"
    Path(path).write_text(text)
    return path


def one_run(name: str, encoding: str | None, args, tmp: str, env: dict, net: tuple[str, str], lib: str,
            glob: str) -> dict:
    """A fresh durable collector, relay and agent for --seconds; the figures of that run."""
    run_dir = os.path.join(tmp, name)
    data = os.path.join(run_dir, "data")
    os.makedirs(data)
    address = f"127.0.0.1:{free_port()}"
    node_id = f"wire-{name}-{uuid.uuid4().hex[:6]}"
    collector = agent = relay = None
    try:
        collector = subprocess.Popen(tool("xpusense-collector") + ["serve", "--listen", address, "--data-dir", data,
                                                                  "--log-level", "warning"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     text=True)
        col_log = Log(collector)
        try:
            wait_collector(address, 60)
        except Exception:
            raise SystemExit(f"wire_bytes: the collector did not come up:\n{col_log.tail()}") from None
        relay = Relay(("127.0.0.1", int(address.rsplit(":", 1)[1])))
        cfg = agent_toml(run_dir, args, net, lib, glob, encoding)
        cmd = tool("xpusense-agent") + ["run", "--config", cfg, "--collector", f"127.0.0.1:{relay.port}",
                                       "--node-id", node_id, "--log-level", "warning"]
        run_env = dict(env, PYTHONDONTWRITEBYTECODE="1")   # its disk writes: the spool's, no .pyc of an edited module
        if args.npu:
            scenario = os.path.join(run_dir, "npu-scenario")
            shutil.copytree(NPU_SCENARIO, scenario)
            cmd += ["--npu-smi", str(NPU_SMI)]
            run_env["FAKE_NPU_SMI_DIR"] = scenario
        files = FileBytes(os.path.join(run_dir, "spool"), data)
        c0 = write_bytes(collector.pid)
        t0 = time.monotonic()
        agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=run_env, text=True)
        agent_log = Log(agent)

        def alive() -> bool:
            if agent.poll() is not None:
                raise SystemExit(f"wire_bytes: the agent exited {agent.returncode}:\n{agent_log.tail()}")
            return True

        wait_for(lambda: alive() and relay.accepted, 120, "the agent's first connection")
        time.sleep(max(0.0, t0 + args.cut_at - time.monotonic()))
        alive()
        relay.cut()
        wait_for(lambda: alive() and relay.accepted >= 2, 120, "the agent to reconnect after the cut")
        time.sleep(max(0.0, t0 + args.seconds - time.monotonic()))
        alive()
        spool_written = write_bytes(agent.pid)
        stop(agent, 30)
        wait_for(lambda: relay.pumps == 0, 60, "the agent's connections to close")
        wall = time.monotonic() - t0
        points, series, node = count_points(address, node_id)
        collector_written = write_bytes(collector.pid) - c0
        file_bytes = files.total()
        spool_files = sum(v for k, v in files.sizes.items() if not k.startswith(data + os.sep))
    finally:
        stop(agent)
        if relay is not None:
            relay.close()
        stop(collector)
    if points == 0:
        raise SystemExit(f"wire_bytes: the collector holds no point of {node_id}")
    per = 1.0 / points
    compressed: dict[str, int] = {}
    parts = wire_parts([bytes(b) for b in relay.kept], compressed) if relay.up <= relay.keep_bytes else {}
    used = default_encoding() if encoding is None else encoding
    return {"encoding": "samples (no key)" if used is None else (used or "samples"),
            "seconds": round(wall, 1), "points": points, "points_per_s": round(points / wall, 1), "series": series,
            "wire_up_bytes": relay.up, "wire_down_bytes": relay.down,
            "wire_bytes_per_point": round(relay.up * per, 2), "wire_down_bytes_per_point": round(relay.down * per, 2),
            # wire up by what it carried: batches (what a JetStream batch stream keeps, less its own
            # per-message bytes), series tables (what the series bucket keeps), Hellos, framing
            "wire_up_parts": parts, "wire_up_compressed": compressed,
            **{f"{k}_bytes_per_point": round(parts.get(k, 0) * per, 2) for k in ("batch", "series", "hello", "framing")
               if parts},
            "collector_disk_bytes_per_point": round(collector_written * per, 2),
            "collector_file_bytes_per_point": round((file_bytes - spool_files) * per, 2),
            # the store's own counters: bytes it wrote to the log and to snapshots (no page rounding)
            "store_log_bytes_per_point": round(node["store"].get("log_bytes_written", 0) * per, 2),
            "store_snapshot_bytes_per_point": round(node["store"].get("snapshot_bytes_written", 0) * per, 2),
            "agent_spool_bytes_per_point": round(spool_written * per, 2),
            "agent_spool_file_bytes_per_point": round(spool_files * per, 2),
            "batches": node.get("batches_stored", 0), "batches_duplicate": node.get("batches_duplicate", 0),
            "reconnects": relay.accepted - 1}


def verdicts(after: dict) -> dict:
    return {"wire <= 4 B/point": after["wire_bytes_per_point"] <= GOALS["wire_bytes_per_point"],
            "collector disk <= 6 B/point": after["collector_disk_bytes_per_point"]
            <= GOALS["collector_disk_bytes_per_point"],
            "agent spool <= wire per point": after["agent_spool_bytes_per_point"] <= after["wire_bytes_per_point"]}


ROWS = [("seconds", "seconds"), ("points held (GetHistory)", "points"), ("points/s", "points_per_s"),
        ("series", "series"), ("wire up, bytes", "wire_up_bytes"), ("wire down, bytes", "wire_down_bytes"),
        ("wire up, B/point", "wire_bytes_per_point"), ("  of it batches, B/point", "batch_bytes_per_point"),
        ("  series tables", "series_bytes_per_point"), ("  Hellos", "hello_bytes_per_point"),
        ("  HTTP/2 and gRPC framing", "framing_bytes_per_point"), ("wire down, B/point", "wire_down_bytes_per_point"),
        ("collector disk writes, B/point", "collector_disk_bytes_per_point"),
        ("collector files grew, B/point", "collector_file_bytes_per_point"),
        ("store wrote to its log, B/point", "store_log_bytes_per_point"),
        ("store wrote to snapshots, B/point", "store_snapshot_bytes_per_point"),
        ("agent spool disk writes, B/point", "agent_spool_bytes_per_point"),
        ("agent spool files grew, B/point", "agent_spool_file_bytes_per_point"),
        ("batches stored", "batches"), ("batches duplicate", "batches_duplicate"), ("reconnects", "reconnects")]


def report(result: dict) -> None:
    runs = result["runs"]
    print(f"wire_bytes: {'8 Ascend 910B4 (fake npu-smi)' if result['npu'] else '8 H100 (fake NVML)'}, host, "
          f"eBPF {'off' if not result['ebpf'] else 'on'}; relay cut at {result['cut_at_s']} s; {result['cpu_model']}")
    print(f"  {'':34}" + "".join(f" {k:>14}" for k in runs))
    print(f"  {'encoding':34}" + "".join(f" {v['encoding']:>14}" for v in runs.values()))
    for label, key in ROWS:
        print(f"  {label:34}" + "".join(f" {v[key]:>14,}" if key in v else f" {'-':>14}" for v in runs.values()))
    for goal, ok in result.get("goals", {}).items():
        print(f"  goal {goal} (after): {'met' if ok else 'MISSED'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="each run, from the agent's exec (default 60)")
    ap.add_argument("--cut-at", type=float, default=None, help="when the relay cuts the connections (default: half-way)")
    ap.add_argument("--only", choices=sorted(RUNS), action="append",
                    help=f"this run (again for more) instead of all: {', '.join(RUNS)}")
    ap.add_argument("--npu", action="store_true", help="8 Ascend NPUs through the fake npu-smi instead of NVML")
    ap.add_argument("--no-ebpf", action="store_true", help="without the eBPF probes")
    ap.add_argument("--record", nargs="?", const=str(RESULTS), default="", metavar="FILE",
                    help=f"append the JSON line to FILE (default {RESULTS.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    args.cut_at = args.seconds / 2 if args.cut_at is None else args.cut_at
    if not 0 < args.cut_at < args.seconds:
        ap.error(f"--cut-at {args.cut_at:g} must be within the run (0 < cut < --seconds {args.seconds:g})")
    if os.geteuid() != 0:
        print("wire_bytes: needs root (eBPF probes, network namespaces, a device node)", file=sys.stderr)
        return 1
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b, if_a, if_b = f"xwb-a-{tag}", f"xwb-b-{tag}", f"xwa{tag}", f"xwb{tag}"
    tmp = tempfile.mkdtemp(prefix="xwb", dir="/tmp")     # short: accel_ioctl's prefixes are < 32 bytes; not tmpfs here
    result: dict = {"bench": "wire_bytes", "npu": args.npu, "ebpf": not args.no_ebpf,
                    "seconds_asked": args.seconds, "cut_at_s": args.cut_at, "runs": {}}
    try:
        if not args.no_ebpf:
            sh("ip", "netns", "add", ns_a)
            sh("ip", "netns", "add", ns_b)
            sh("ip", "link", "add", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)
            for ns, ifname, addr in ((ns_a, if_a, "10.234.0.1/30"), (ns_b, if_b, "10.234.0.2/30")):
                sh("ip", "-n", ns, "addr", "add", addr, "dev", ifname)
                sh("ip", "-n", ns, "link", "set", ifname, "up")
        env, lib, glob = make_fakes(tmp)
        for name, encoding in RUNS.items():
            if args.only is None or name in args.only:
                print(f"{name}: {args.seconds:g} s ...", file=sys.stderr, flush=True)
                result["runs"][name] = one_run(name, encoding, args, tmp, env, (ns_a, if_a), lib, glob)
    finally:
        if not args.no_ebpf:
            subprocess.run(["ip", "netns", "del", ns_a], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns_b], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if "after" in result["runs"]:
        result["goals"] = verdicts(result["runs"]["after"])
    result.update(date=datetime.now(UTC).isoformat(timespec="seconds"), cpu_model=cpu_model())
    report(result)
    line = json.dumps(result)
    print(line, flush=True)
    if args.record:
        with open(args.record, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
