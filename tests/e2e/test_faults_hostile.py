"""Hostile clients of a real collector process, and the bound each meets. The collector's RSS
(psutil) before, at its peak and after each memory attack is recorded and printed at the end of the
run (helpers.record_figure).

- The hijack: a local process reads a node's boot id from the Query API and sends seq 2**64-1 as
  that node, so that every later real batch would be acknowledged as a duplicate and dropped.
- Memory: rejected 4 MB batches, a client that never reads its acks, and series_ref = 0 with new
  labels each time (series past the limit, a ListNodes reply too big for `nodes` and `top`)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import time

import grpc
import psutil
import pytest
from helpers import BIN, FAST_HOST_ONLY, free_port, wait_until
from helpers import record_figure as record

from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

MB = 2**20
NOBODY = 65534


class Collector:
    """A real `xpusense-collector serve` on loopback (memory only), with its RSS at hand."""

    def __init__(self, procs, tmp_path, config: str = ""):
        self.addr = f"127.0.0.1:{free_port()}"
        cfg = tmp_path / "collector.toml"
        cfg.write_text(config)
        self.proc = procs([str(BIN / "xpusense-collector"), "serve", "--listen", self.addr, "--config", str(cfg)],
                          "collector")
        self.ps = psutil.Process(self.proc.p.pid)
        self.channel = grpc.insecure_channel(self.addr, options=[("grpc.max_send_message_length", 64 * MB)])
        self.query = pb_grpc.QueryStub(self.channel)
        wait_until(lambda: self.query.ListNodes(pb.ListNodesRequest(), timeout=2), what="the collector to answer")

    def rss_mb(self) -> float:
        return round(self.ps.memory_info().rss / MB, 1)

    def node(self, node_id: str) -> pb.NodeView | None:
        nodes = self.query.ListNodes(pb.ListNodesRequest(node_id=node_id, name_prefix="\x00"), timeout=5).nodes
        return nodes[0] if nodes else None

    def counters(self) -> dict[str, int]:
        return dict(self.query.ListNodes(pb.ListNodesRequest(node_id="\x00"), timeout=5).counters)

    def stream(self, msgs, timeout_s: float = 30.0) -> tuple[list, grpc.RpcError | None]:
        """One Ingest stream: the messages, then the replies until the collector ends it."""
        try:
            return list(pb_grpc.IngestStub(self.channel).Stream(iter(msgs), timeout=timeout_s)), None
        except grpc.RpcError as e:
            return [], e


def hello(node: str, boot: str) -> pb.AgentMessage:
    return pb.AgentMessage(hello=pb.Hello(node_id=node, boot_id=boot))


def batch(node: str, boot: str, seq: int, samples=()) -> pb.AgentMessage:
    return pb.AgentMessage(batch=pb.Batch(node_id=node, boot_id=boot, seq=seq, samples=list(samples)))


def start_agent(procs, tmp_path, addr: str, node: str):
    cfg = tmp_path / "agent.toml"
    cfg.write_text(FAST_HOST_ONLY)
    return procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--collector", addr, "--node-id", node],
                 "agent")


def forwarder_as_nobody(target: tuple[str, int], errors) -> tuple[int, int]:
    """A TCP forwarder to `target` in a child process running as uid 65534: what connects to its
    port reaches the collector from a socket another local user owns. (pid, port)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    pid = os.fork()
    if pid:
        lsock.close()
        return pid, port
    try:   # the child: sockets and select only (no grpc, no threads after a fork)
        import encodings.idna  # noqa: F401  (connect() needs it; nobody cannot read the interpreter's files)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        peer: dict[socket.socket, socket.socket] = {}
        while True:
            for s in select.select([lsock, *peer], [], [])[0]:
                if s is lsock:
                    client, _ = lsock.accept()
                    upstream = socket.create_connection(target)
                    peer[client], peer[upstream] = upstream, client
                    continue
                data = s.recv(65536) if s in peer else b""
                if data:
                    peer[s].sendall(data)
                elif s in peer:
                    other = peer.pop(s)
                    peer.pop(other, None)
                    s.close()
                    other.close()
    except BaseException as e:   # said in the test's failure, not lost
        errors.write_text(repr(e))
    finally:
        os._exit(0)


# ------------------------------------------------------------------------------------------ the hijack

def test_a_local_process_cannot_silence_a_node_with_a_forged_sequence_number(procs, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to run a caller as another user (uid 65534)")
    coll = Collector(procs, tmp_path)
    start_agent(procs, tmp_path, coll.addr, "victim")
    first = wait_until(lambda: (n := coll.node("victim")) and n.stored_up_to >= 3 and n, what="the victim stored")

    # What another local user's process gets from the Query API: no boot id.
    errors = tmp_path / "forwarder-errors"
    pid, port = forwarder_as_nobody(("127.0.0.1", int(coll.addr.rsplit(":", 1)[1])), errors)
    try:
        out = subprocess.run([str(BIN / "xpusense-collector"), "nodes", "--collector", f"127.0.0.1:{port}",
                              "--format", "json", "--node", "victim"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr + (errors.read_text() if errors.exists() else "")
        seen_by_other_user = json.loads(out.stdout)["nodes"][0]
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert seen_by_other_user["boot_id"] is None and seen_by_other_user["boot_tag"] == first.boot_tag
    assert first.boot_id and first.boot_id not in out.stdout
    # The collector's own user (root here) sees it; so does this test, playing a forger who found it elsewhere.
    boot = first.boot_id

    mark = coll.node("victim").stored_up_to
    refusals = []
    for msgs in ([hello("victim", boot), batch("victim", boot, 2**64 - 1)],            # as the live boot
                 [hello("victim", "forger"), batch("victim", boot, 2**64 - 1)]):       # as a replay of it
        _, err = coll.stream(msgs)
        assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
        assert "limits.max_seq_jump" in err.details() and boot not in err.details()
        refusals.append(err.code().name)
    # The victim's real batches are still stored, none taken for a resend.
    after = wait_until(lambda: (n := coll.node("victim")) and n.stored_up_to >= mark + 10 and n,
                       what="the victim's batches after the forgery")
    assert after.stored_up_to < 2**63 and after.batches_duplicate == first.batches_duplicate
    assert coll.counters()["limits.max_seq_jump"] == 2
    record("hijack: seq 2**64-1 as a live boot", forged_batches=2, refused=refusals,
           victim_stored_before=mark, victim_stored_after=after.stored_up_to,
           victim_batches_taken_as_resends=after.batches_duplicate - first.batches_duplicate,
           boot_id_shown_to_other_user=seen_by_other_user["boot_id"] is not None)


def test_a_local_process_cannot_spend_a_nodes_rate_budget(procs, tmp_path):
    """Without the boot id: batches as the node, under a boot of its own, as fast as it can. They
    once came out of the node's one token bucket, and the real agent's next batch was refused."""
    coll = Collector(procs, tmp_path, "[limits]\nbatches_per_s = 30.0\nburst_batches = 60\n")
    agent = start_agent(procs, tmp_path, coll.addr, "victim")
    first = wait_until(lambda: (n := coll.node("victim")) and n.stored_up_to >= 3 and n, what="the victim stored")
    def stored(boot: str) -> int:   # what the collector holds of that boot: its Welcome says
        return coll.stream([hello("victim", boot)])[0][0].welcome.stored_up_to

    # Kept up while the victim sends 10 batches: each stream is refused once the junk boot's budget is spent.
    floods, seq, codes = 0, 0, set()
    while stored(first.boot_id) < first.stored_up_to + 10:
        _, err = coll.stream([hello("victim", "junk")] + [batch("victim", "junk", seq + i) for i in range(1, 200)])
        floods, seq = floods + 1, seq + 200
        codes.add(err.code().name if err is not None else "OK")
    after = wait_until(lambda: (n := coll.node("victim")) and n.boot_id == first.boot_id and n,
                       what="the victim shown with its boot again")
    assert codes == {"RESOURCE_EXHAUSTED"}
    assert "unreachable" not in agent.output(), "the victim's stream was refused"
    assert after.batches_duplicate == first.batches_duplicate
    record("rate budget flood as the node", flood_streams=floods,
           flood_refused=sorted(codes), victim_stored_before=first.stored_up_to, victim_stored_after=after.stored_up_to)


def test_a_forger_inside_the_window_costs_at_most_max_seq_jump_batches(procs, tmp_path):
    """What is left to a forger who has the boot id (on a port that authenticates nobody): a seq
    within the bound is taken, and the real batches up to it are acknowledged as resends; then the
    node is stored again, by itself."""
    jump = 40    # some 15 s of the agent's batches: the forged seq is still ahead when it arrives
    coll = Collector(procs, tmp_path, f"[limits]\nmax_seq_jump = {jump}\nbatches_per_s = 100.0\n")
    start_agent(procs, tmp_path, coll.addr, "victim")
    first = wait_until(lambda: (n := coll.node("victim")) and n.stored_up_to >= 3 and n, what="the victim stored")
    forged = first.stored_up_to + jump
    replies, err = coll.stream([hello("victim", first.boot_id), batch("victim", first.boot_id, forged)])
    assert err is None and replies[-1].ack.seq == forged and not replies[-1].ack.duplicate
    after = wait_until(lambda: (n := coll.node("victim")) and n.stored_up_to > forged + 5 and n, timeout_s=120,
                       what="the victim stored again past the forged seq")
    lost = after.batches_duplicate - first.batches_duplicate
    assert 0 < lost <= jump
    record("forger inside the window", max_seq_jump=jump, real_batches_taken_as_resends=lost,
           victim_stored_after=after.stored_up_to)


# ------------------------------------------------------------------------------------------ memory

def test_rejected_big_batches_do_not_stay_in_memory(procs, tmp_path):
    coll = Collector(procs, tmp_path)
    coll.stream([hello("big", "b"), batch("big", "b", 1, [pb.Sample(name="warm", value=1)])])
    before = coll.rss_mb()
    big = batch("big", "b", 2, [pb.Sample(name="x", value=i) for i in range(290_000)])   # > max_samples_per_batch
    size_mb = round(big.ByteSize() / MB, 1)
    peak = before
    for _ in range(12):
        _, err = coll.stream([hello("big", "b"), big])
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "limits.max_samples_per_batch" in err.details()
        peak = max(peak, coll.rss_mb())
    # A rejected message must be let go once its stream has ended: an aborted stream's traceback can
    # hold the message in a cycle, which gc.freeze would make permanent.
    after = wait_until(lambda: (r := coll.rss_mb()) < before + 60 and r, timeout_s=60,
                       what="the collector's RSS back near where it was")
    record("12 rejected batches", batch_mb=size_mb, rss_before_mb=before, rss_peak_mb=peak, rss_after_mb=after)
    assert coll.node("big").stored_up_to == 1


@pytest.mark.parametrize("durable", [False, True])
def test_a_client_that_never_reads_its_acks_is_held_back(procs, tmp_path, durable):
    # Memory only, a stream's next message is read once the last is acknowledged (the ack's write
    # waits for the client's flow-control window); durable, the reader reads ahead to its bound.
    coll = Collector(procs, tmp_path, f'data_dir = "{tmp_path / "data"}"\n' if durable else "")
    before = coll.rss_mb()
    payload = [pb.Sample(name="x", labels={"pad": "p" * 4000}, value=i, series_ref=i + 1) for i in range(250)]
    small, big = 2000, 300     # enough acks (each echoes the boot id) to fill what the client takes unread...
    total = small + big        # ...then ~1 MB batches
    boot = "b" * 200

    def msgs():
        yield hello("deaf", boot)
        for seq in range(1, total + 1):
            yield batch("deaf", boot, seq, payload if seq > small else ())

    # Replies never read; and no BDP probing, which would open the client's window far wider.
    deaf = grpc.insecure_channel(coll.addr, options=[("grpc.http2.bdp_probe", 0)])
    call = pb_grpc.IngestStub(deaf).Stream(msgs(), timeout=300)
    try:
        if durable:
            wait_until(lambda: coll.counters().get("limits.max_stream_pending_bytes", 0)
                       + coll.counters().get("limits.max_stream_pending_batches", 0) > 0, timeout_s=120,
                       what="the stream to reach its bound")
        # Held back: what the collector takes stops moving (gRPC flow control), and so does its RSS.
        last, peak = [0, time.monotonic()], [coll.rss_mb()]

        def quiet() -> bool:
            peak[0] = max(peak[0], coll.rss_mb())
            taken = coll.node("deaf").stored_up_to
            if taken != last[0]:
                last[:] = [taken, time.monotonic()]
            return time.monotonic() - last[1] > 3.0
        wait_until(quiet, timeout_s=120, what="the client to be held back")
    finally:
        call.cancel()
        deaf.close()
    offered_mb = round(big * batch("deaf", boot, 1, payload).ByteSize() / MB)
    record("client never reads its acks", offered_batches=total, offered_mb=offered_mb, batches_taken=last[0],
           rss_before_mb=before, rss_peak_mb=peak[0])
    assert last[0] < total, "the collector read every batch of a client that reads no acks"
    assert peak[0] < before + 150, f"RSS grew from {before} to {peak[0]} MB"


def test_series_without_references_are_bounded_and_the_fleet_interface_still_reads(procs, tmp_path):
    limit = 50_000
    coll = Collector(procs, tmp_path, f"[limits]\nmax_series_per_node = {limit}\n")
    start_agent(procs, tmp_path, coll.addr, "bystander")
    wait_until(lambda: (n := coll.node("bystander")) and n.stored_up_to >= 2, what="the bystander stored")
    before = coll.rss_mb()
    pad = "p" * 150
    seq, refused = 0, None
    while refused is None and seq < 30:
        seq += 1
        samples = [pb.Sample(name="flood", labels={"i": f"{seq}-{i}", "pad": pad}, value=i, series_ref=0)
                   for i in range(5000)]
        _, refused = coll.stream([hello("flood", "b"), batch("flood", "b", seq, samples)])
    assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits.max_series_per_node" in refused.details()
    after = coll.rss_mb()
    flood = coll.query.ListNodes(pb.ListNodesRequest(node_id="flood"), timeout=30).nodes[0]   # a first page
    assert flood.series_total == limit and flood.stored_up_to == seq - 1

    # A default gRPC client (4 MiB replies at most) gets a page, and where to go on.
    page = pb_grpc.QueryStub(grpc.insecure_channel(coll.addr)).ListNodes(pb.ListNodesRequest(), timeout=30)
    assert page.next_page_token and page.ByteSize() <= 4_000_000
    # `nodes` reads every page: the whole fleet, the bystander included.
    out = subprocess.run([str(BIN / "xpusense-collector"), "nodes", "--collector", coll.addr, "--format", "json",
                          "--timeout-s", "30"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    nodes = {n["node_id"]: n for n in json.loads(out.stdout)["nodes"]}
    assert set(nodes) == {"bystander", "flood"} and len(nodes["flood"]["series"]) == limit
    assert nodes["bystander"]["series"] and nodes["bystander"]["connected"]
    record("series_ref=0 flood", max_series_per_node=limit, series_offered=seq * 5000, series_held=flood.series_total,
           list_nodes_mb=round(len(out.stdout) / MB, 1), rss_before_mb=before, rss_after_mb=after)
