"""The extender's parts: a pod made a Place request, the per-node verdicts against Place's own answer
over random fleets, the 0-10 scores, and the HTTP endpoint's TLS, tokens and bounds (in-process,
the endpoint's thread and the core's loop real)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import socket
import ssl
import threading
import urllib.error
import urllib.request
from collections import Counter

import pytest
from helpers import free_port
from sched_sim import GiB, event, inventory, readings

from xpusense.collector.certs import make_certs, make_tokens
from xpusense.collector.config import load_collector
from xpusense.collector.extender_http import ExtenderServer, check_section
from xpusense.collector.scheduler.core import Scheduler
from xpusense.collector.scheduler.extender import (
    ExtenderError,
    filter_reply,
    filter_result,
    place_request,
    priorities,
    priorities_reply,
)
from xpusense.collector.scheduler.extender_replies import UNRESOLVABLE, fleet_ids
from xpusense.collector.scheduler.verdict_cache import VerdictCache
from xpusense.collector.state import FleetState
from xpusense.common.config import ConfigError
from xpusense.v1 import scheduler_pb2 as spb
from xpusense.v1 import telemetry_pb2 as pb


def pod(resources=None, annotations=None, init=None) -> dict:
    c = {"name": "main", "image": "x"}
    if resources:
        c["resources"] = {"limits": resources, "requests": resources}
    spec = {"containers": [c, {"name": "side", "image": "y", "resources": {"requests": {"cpu": "1"}}}]}
    if init:
        spec["initContainers"] = [{"name": "init", "image": "z", "resources": {"limits": init}}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns",
                                                            "annotations": annotations or {}}, "spec": spec}


def test_a_pod_becomes_a_place_request():
    assert place_request(pod({"cpu": "4", "memory": "1Gi"})) is None   # no accelerator: untouched
    r = place_request(pod({"nvidia.com/gpu": "4"}, {
        "xpusense.io/memory-per-device": "40GB", "xpusense.io/regions": "cn-beijing, cn-shanghai",
        "xpusense.io/data-region": "cn-beijing", "xpusense.io/same-domain": "true",
        "xpusense.io/replica-zones": "bj-a,sh-b", "xpusense.io/residency": "region",
        "xpusense.io/require-encryption": "yes", "other.io/x": "ignored"}))
    assert r == spb.PlaceRequest(accelerator=spb.ACCELERATOR_GPU, count=4, memory_bytes=40 * GiB, same_domain=True,
                                 allowed_regions=["cn-beijing", "cn-shanghai"], data_region="cn-beijing",
                                 replica_zones=["bj-a", "sh-b"], residency=spb.RESIDENCY_REGION,
                                 require_encryption=True)
    for name in ("huawei.com/Ascend910", "huawei.com/Ascend910B", "huawei.com/Ascend310P"):
        assert place_request(pod({name: "2"})) == spb.PlaceRequest(accelerator=spb.ACCELERATOR_NPU, count=2)
    # an init container runs alone: the larger of it and the containers' sum counts
    assert place_request(pod({"nvidia.com/gpu": "1"}, init={"nvidia.com/gpu": "2"})).count == 2


@pytest.mark.parametrize("p, words", [
    (pod({"nvidia.com/gpu": "1"}, {"xpusense.io/memory": "40GB"}), "unknown annotation xpusense.io/memory"),
    (pod({"nvidia.com/gpu": "1"}, {"xpusense.io/memory-per-device": "lots"}), "xpusense.io/memory-per-device: 'lots'"),
    (pod({"nvidia.com/gpu": "1"}, {"xpusense.io/same-domain": "maybe"}), "'maybe' is not true or false"),
    (pod({"nvidia.com/gpu": "1"}, {"xpusense.io/residency": "city"}), "'city' is not none, region or province"),
    (pod({"nvidia.com/gpu": "1.5"}), "nvidia.com/gpu = '1.5' is not a whole number"),
    (pod({"nvidia.com/gpu": "1", "huawei.com/Ascend910": "1"}), "both GPUs and NPUs"),
    ("a pod", "must be a v1 Pod"),
])
def test_a_pod_the_extender_cannot_read_is_named(p, words):
    with pytest.raises(ExtenderError) as e:
        place_request(p)
    assert words in str(e.value)


def random_fleet(rng: random.Random, clock: list[int] | None = None) -> tuple[Scheduler, list[str], set[str]]:
    """60 nodes of GPUs, NPUs or neither, some busy, some with no readings since their Hello: stale.
    `clock`: [now in ns], the fleet's clock (moved on by the caller)."""
    clock = clock or [10**18]
    st = FleetState(clock=lambda: clock[0])
    core = Scheduler(st, load_collector(None, env={}).scheduler, 10.0)
    ids = []
    for i in range(60):
        kind = rng.choice(["a100", "910b", "910b4", "a100pcie"])
        nid = f"n{i:02d}"
        labels = {"region": rng.choice(["r1", "r2"]), "price": rng.choice(["1", "3"])}
        if rng.random() < 0.3:
            labels["encryption"] = "tdx"
        inv = inventory(kind, rng.choice((4, 8)), **labels) if rng.random() > 0.05 else pb.Inventory(hostname="cpu")
        st.hello(pb.Hello(node_id=nid, boot_id="b", inventory=inv))
        ids.append(nid)
    clock[0] += 12 * 10**9   # past stale_s: the nodes that send nothing now are stale
    quiet = set()
    for nid in ids:
        inv = st.nodes[nid].inventory
        if rng.random() < 0.1:
            quiet.add(nid)
        else:
            devices = sum(1 for r in inv.resources if r.type in ("GPU", "NPU"))
            kind = {"A100-SXM4-80GB": "a100", "A100-PCIE-40GB": "a100pcie", "Ascend-910B": "910b"}.get(
                inv.resources[0].model if devices else "", "910b4")
            st.ingest(pb.Batch(node_id=nid, boot_id="b", seq=1, samples=readings(
                kind, devices, util={d: rng.random() for d in range(devices)},
                used_gib={d: rng.choice((1, 30, 60)) for d in range(devices)}, t_ns=clock[0])))
    return core, ids, quiet


def test_verdicts_are_places_own_answer_node_by_node():
    """Over random fleets and requests: a node the extender passes is one of Place's candidates with
    the same score; one it fails is one Place leaves out, with Place's reason (or `type`, which Place
    counts and does not list, or `stale` for such a node that is silent)."""
    rng = random.Random(3)
    for _ in range(4):
        core, ids, quiet = random_fleet(rng)
        for _ in range(20):
            req = spb.PlaceRequest(accelerator=rng.choice([spb.ACCELERATOR_ANY, spb.ACCELERATOR_GPU, spb.ACCELERATOR_NPU]),
                                   count=rng.choice((1, 2, 4, 8)), memory_bytes=rng.choice((0, 20, 40, 70)) * GiB,
                                   same_domain=rng.random() < 0.3, require_encryption=rng.random() < 0.2,
                                   limit=1000, max_excluded=1000)
            reply = core.place(req, scan=True)
            cands = {c.node_id: c.score for c in reply.candidates}
            excluded = {e.node_id: e.reason for e in reply.excluded}
            asked = ids + ["not-in-fleet"]
            for v in core.judge(req, asked):
                if v.fits:
                    assert v.score == pytest.approx(cands.pop(v.node_id), abs=1e-12), (req, v)
                elif v.node_id == "not-in-fleet":
                    assert v.reason == "unknown"
                elif v.node_id in excluded:
                    assert v.reason == excluded[v.node_id], (req, v)
                else:   # counted by Place as without the type: the extender says stale first
                    assert v.reason == ("stale" if v.node_id in quiet else "type"), (req, v)
            assert cands == {}   # every candidate was passed


def test_filter_and_prioritize_answer_in_the_extenders_json():
    core, ids, _ = random_fleet(random.Random(5))
    p = pod({"nvidia.com/gpu": "2"}, {"xpusense.io/memory-per-device": "20GB"})
    names = ids[:30]
    r = filter_result(core, {"Pod": p, "NodeNames": names})
    assert set(r) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert r["Nodes"] is None and r["Error"] == ""
    assert sorted(r["NodeNames"] + list(r["FailedNodes"]) + list(r["FailedAndUnresolvableNodes"])) == sorted(names)
    assert all(m.startswith("xpusense ") for m in {**r["FailedNodes"], **r["FailedAndUnresolvableNodes"]}.values())
    # Go's encoding/json reads field names in any case: so does the extender; the full Nodes form
    nodes = {"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": [{"metadata": {"name": n}} for n in names]}
    r2 = filter_result(core, {"pod": p, "nodes": nodes})
    assert r2["NodeNames"] is None and [n["metadata"]["name"] for n in r2["Nodes"]["items"]] == r["NodeNames"]
    prios = priorities(core, {"Pod": p, "NodeNames": names})
    cache = VerdictCache()   # the kept verdicts: the same answers
    assert filter_result(core, {"Pod": p, "NodeNames": names}, cache) == r
    assert priorities(core, {"Pod": p, "NodeNames": r["NodeNames"]}, cache) == [
        h for h in prios if h["Host"] in r["NodeNames"]] and cache.full == 1
    assert [h["Host"] for h in prios] == names and all(0 <= h["Score"] <= 10 for h in prios)
    assert max(h["Score"] for h in prios) == 10
    assert {h["Host"] for h in prios if h["Score"] > 0} <= set(r["NodeNames"])
    assert filter_result(core, {"Pod": p})["Error"] == "ExtenderArgs has neither Nodes nor NodeNames"


def test_kept_verdicts_are_judges_own_as_the_index_changes():
    """The verdicts kept per request shape are judge()'s at every ask while the fleet changes under
    them (GPUs filling up and freed, nodes going silent and back, an XID, a new node, a node moved
    to another region), judging again only the nodes changed; the least recently asked shape is
    dropped past `keep`, counted. The replies kept per list of names, patched with the verdicts
    judged again, are those made anew from judge() at every step, byte for byte."""
    clock = [10**18]
    core, ids, quiet = random_fleet(random.Random(11), clock)
    st, seq = core.state, itertools.count(2)
    counters: Counter = Counter()
    cache = VerdictCache(keep=3, counters=counters)
    reqs = [spb.PlaceRequest(accelerator=spb.ACCELERATOR_GPU, count=2, memory_bytes=20 * GiB,
                             allowed_regions=["r1", "r2"]),
            spb.PlaceRequest(accelerator=spb.ACCELERATOR_ANY, count=4, memory_bytes=40 * GiB, same_domain=True),
            spb.PlaceRequest(accelerator=spb.ACCELERATOR_NPU, count=1)]
    asked = ids + ["n-new", "not-in-fleet", "k8s-new"] + ids   # each node twice, as its k8s_node label and id would be

    def send(nid, used_gib=0.0, events=()):
        st.ingest(pb.Batch(node_id=nid, boot_id="b", seq=next(seq), events=list(events),
                           samples=readings("a100", 8, used_gib=used_gib, t_ns=clock[0])))

    lists = [asked, asked[::-1], asked[: len(asked) // 2]]

    def same(where, lists_asked=2):   # every shape asked with each list; the first shape's verdicts by node
        first = {}
        for req in reqs:
            for names in lists[:lists_asked]:   # two lists kept per shape
                kept, anew = core.replies(req, names, cache), core.replies(req, names)
                assert kept.verdicts == anew.verdicts == core.judge(req, fleet_ids(core.view.k8s_nodes, names)), where
                assert kept.filter_sections() == anew.filter_sections(), where
                assert kept.priorities() == anew.priorities(), where
                first = first or {v.node_id: v for v in kept.verdicts}
        return first

    same("first asks")
    assert cache.full == 3 and counters["kubernetes.extender.name_lists"] == 0
    gpu = [n for n in ids if n not in quiet and st.nodes[n].inventory.resources
           and st.nodes[n].inventory.resources[0].model == "A100-SXM4-80GB"]
    a, b = gpu[0], gpu[1]
    send(a)   # idle
    judged = cache.judged
    same("idle", lists_asked=1)
    # again per shape: only the node changed, and the stale nodes (their detail says for how long)
    assert 0 < cache.judged - judged <= 3 * (1 + len(core.view.stale_known)) < len(ids)
    assert same("idle, both lists")[a].fits
    patched = core.replies(reqs[0], asked, cache)
    send(a, used_gib=79.0)   # its GPUs fill up: the next ask says so
    v = same("full")[a]
    assert not v.fits and v.reason == "memory"
    assert core.replies(reqs[0], asked, cache) is patched   # kept and patched, not made anew
    send(a, events=[event("xid", "gpu0", t_ns=clock[0], xid="79")])
    same("xid")
    clock[0] += 6 * 10**9
    for n in gpu[2:]:
        send(n, used_gib=1.0)
    clock[0] += 5 * 10**9   # b and the others not sent to: stale now
    kept = same("stale")
    assert kept[b].reason == "stale"
    clock[0] += 3 * 10**9   # their detail says for how long
    same("stale, later")
    send(b)
    assert same("back")[b].reason != "stale"
    st.hello(pb.Hello(node_id="n-new", boot_id="b", inventory=inventory("a100", 8, region="r1")))
    send("n-new")
    assert same("new node")["n-new"].reason != "unknown"
    st.hello(pb.Hello(node_id="n-new", boot_id="b", inventory=inventory("a100", 8, region="r1", k8s_node="k8s-new")))
    send("n-new")   # now also known by its label: the kept lists are made anew
    same("labelled")
    assert core.replies(reqs[0], asked, cache).verdicts[asked.index("k8s-new")].node_id == "n-new"
    st.hello(pb.Hello(node_id=gpu[2], boot_id="b", inventory=inventory("a100", 8, region="r9")))
    send(gpu[2])
    assert same("moved")[gpu[2]].reason == "region"
    assert counters["kubernetes.extender.verdict_shapes"] == 0
    kept = core.replies(reqs[2], lists[0], cache)
    assert core.replies(reqs[2], lists[2], cache) is not kept   # a third list: the least recently asked dropped
    assert counters["kubernetes.extender.name_lists"] == 1 and core.replies(reqs[2], lists[0], cache) is kept
    full = cache.full
    core.replies(spb.PlaceRequest(accelerator=spb.ACCELERATOR_GPU, count=8), asked, cache)
    assert counters["kubernetes.extender.verdict_shapes"] == 1 and len(cache.shapes) == 3
    assert cache.full == full + 1
    same("the first shape again, after it was dropped")


class Endpoint:
    """ExtenderServer over a small fleet, its core's loop on a thread of its own."""

    def __init__(self, tmp_path, extra: str = "", top: str = ""):
        self.port = free_port()
        (tmp_path / "c.toml").write_text(f'{top}[kubernetes.extender]\nenabled = true\nlisten = "127.0.0.1:{self.port}"\n'
                                         f'max_request_bytes = 4096\n{extra}')
        cfg = load_collector(str(tmp_path / "c.toml"), env={})
        st = FleetState()
        st.hello(pb.Hello(node_id="g1", boot_id="b", inventory=inventory("a100", 8)))
        st.ingest(pb.Batch(node_id="g1", boot_id="b", seq=1, samples=readings("a100")))
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        from xpusense.collector.auth import Security
        self.security = Security.from_config(cfg)
        self.ext = ExtenderServer(Scheduler(st, cfg.scheduler, cfg.stale_s), cfg, self.security)
        asyncio.run_coroutine_threadsafe(self.ext.start(), self.loop).result(10)

    def post(self, body: bytes, headers=None, context=None, scheme="http"):
        req = urllib.request.Request(f"{scheme}://localhost:{self.port}/filter", data=body, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10, context=context) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def close(self):
        asyncio.run_coroutine_threadsafe(self.ext.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


BODY = json.dumps({"Pod": pod({"nvidia.com/gpu": "1"}), "NodeNames": ["g1", "g2"]}).encode()


def test_endpoint_bounds_and_tokens(tmp_path):
    toks = make_tokens(str(tmp_path / "t"), ["kube-scheduler"])
    e = Endpoint(tmp_path, top=f'tokens_file = "{toks["tokens_file"]}"\n')
    try:
        token = open(toks["nodes"]["kube-scheduler"]).read().strip()
        status, why = e.post(BODY)
        assert status == 401 and "bearer token" in why
        status, r = e.post(BODY, {"Authorization": f"Bearer {token}"})
        assert status == 200 and r["NodeNames"] == ["g1"] and "unknown" in r["FailedAndUnresolvableNodes"]["g2"]
        status, why = e.post(b"{" * 5000, {"Authorization": f"Bearer {token}"})
        assert status == 413 and "max_request_bytes = 4096" in why
        assert e.ext.counters["kubernetes.extender.max_request_bytes"] == 1
        status, why = e.post(b"{not json", {"Authorization": f"Bearer {token}"})
        assert status == 400 and "not JSON" in why
    finally:
        e.close()


def test_endpoint_serves_mtls_with_the_fleets_ca(tmp_path):
    certs = make_certs(str(tmp_path / "pki"), ["kube-scheduler"])
    e = Endpoint(tmp_path, f'[tls]\nca = "{certs["ca"]}"\ncert = "{certs["collector"]["cert"]}"\n'
                           f'key = "{certs["collector"]["key"]}"\n')
    try:
        ctx = ssl.create_default_context(cafile=certs["ca"])
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            e.post(BODY, context=ctx, scheme="https")   # no client certificate
        me = certs["nodes"]["kube-scheduler"]
        ctx.load_cert_chain(me["cert"], me["key"])
        status, r = e.post(BODY, context=ctx, scheme="https")
        assert status == 200 and r["NodeNames"] == ["g1"]
    finally:
        e.close()


def test_plaintext_extender_off_loopback_is_refused(tmp_path):
    (tmp_path / "c.toml").write_text('[kubernetes.extender]\nenabled = true\nlisten = "0.0.0.0:9471"\n')
    with pytest.raises(ConfigError, match="'kubernetes.extender.listen' = '0.0.0.0:9471' is not a loopback"):
        check_section(load_collector(str(tmp_path / "c.toml"), env={}), "c.toml")


def test_endpoint_answers_in_the_loop_turn_its_request_arrives(tmp_path):
    """A request whose bytes are in is answered in the loop turn that reads them: it does not wait
    further turns behind the other callbacks (the ingest's) on the loop that owns the fleet state.
    Requests on one keep-alive connection, the loop's turns counted by a callback of its own."""
    port = free_port()
    (tmp_path / "c.toml").write_text(f'[kubernetes.extender]\nenabled = true\nlisten = "127.0.0.1:{port}"\n')
    cfg = load_collector(str(tmp_path / "c.toml"), env={})
    st = FleetState()
    st.hello(pb.Hello(node_id="g1", boot_id="b", inventory=inventory("a100", 8)))
    st.ingest(pb.Batch(node_id="g1", boot_id="b", seq=1, samples=readings("a100")))
    request = (f"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: {len(BODY)}\r\n\r\n").encode() + BODY

    async def main():
        ext = ExtenderServer(Scheduler(st, cfg.scheduler, cfg.stale_s), cfg)
        await ext.start()
        loop, turns, seen = asyncio.get_running_loop(), [0], []
        c = socket.create_connection(("127.0.0.1", port))
        c.setblocking(False)

        def tick():   # once a turn, before the turn's socket callbacks: is an answer in?
            turns[0] += 1
            try:
                if c.recv(1, socket.MSG_PEEK):
                    seen.append(turns[0])
                    return
            except BlockingIOError:
                pass
            loop.call_soon(tick)

        try:
            answers = []
            for _ in range(3):   # the first on a new connection: its reads start a turn later
                seen.clear()
                c.send(request)   # on loopback: in the server's socket when send returns
                sent = turns[0]
                loop.call_soon(tick)
                async with asyncio.timeout(30):
                    while not seen:
                        await asyncio.sleep(0)
                    data = b""
                    while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + int(
                            data.split(b"Content-Length: ")[1].split(b"\r\n")[0]):
                        data += await loop.sock_recv(c, 65536)
                answers.append((seen[0] - sent, data))
            return answers
        finally:
            c.close()
            await ext.stop()

    for turns_taken, data in asyncio.run(main())[1:]:
        assert data.startswith(b"HTTP/1.1 200 OK\r\n") and b"Connection: close" not in data
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["NodeNames"] == ["g1"]
        # turn 1: the bytes read and answered; turn 2: the tick sees the answer
        assert turns_taken <= 2, f"answered {turns_taken - 1} turns after its bytes were read"


def test_replies_are_the_json_of_each_verdict_joined_from_kept_pieces():
    """filter and prioritize answer with exactly the JSON the verdicts encode (json.dumps' own text,
    names and reasons escaped as it escapes them), joined from pieces: each failing node's entry is
    encoded once, when its verdict is made. A node known by its `k8s_node` label and names that
    need escaping included; the NodeNames and Nodes forms, judged anew and from kept verdicts."""
    core, ids, _ = random_fleet(random.Random(7))
    st = core.state
    for nid, labels in (('n-"odd"\\é', {}), ("n-labelled", {"k8s_node": "k8s-ü-1"})):
        st.hello(pb.Hello(node_id=nid, boot_id="b", inventory=inventory("a100", 8, region="r1", **labels)))
        st.ingest(pb.Batch(node_id=nid, boot_id="b", seq=1, samples=readings("a100", used_gib={0: 79})))
    names = ids + ['n-"odd"\\é', "k8s-ü-1", "not-in-fleet-\u2603"]
    nodes = {"apiVersion": "v1", "kind": "NodeList", "metadata": {"resourceVersion": "7"},
             "items": [{"metadata": {"name": n, "labels": {"x": "ü"}}} for n in names]}
    cache = VerdictCache()
    for p in (pod({"nvidia.com/gpu": "8"}), pod({"nvidia.com/gpu": "2"}, {"xpusense.io/memory-per-device": "20GB"}),
              pod({"huawei.com/Ascend910": "1"}, {"xpusense.io/regions": "r2"}), pod({"cpu": "1"})):
        req = place_request(p)
        verdicts = core.judge(req, fleet_ids(core.view.k8s_nodes, names)) if req else [None] * len(names)
        ok = [n for n, v in zip(names, verdicts) if v is None or v.fits]
        why = {n: (v.reason, f"xpusense {v.reason}: {v.detail}") for n, v in zip(names, verdicts) if v and not v.fits}
        want = {"Nodes": None, "NodeNames": ok,
                "FailedNodes": {n: m for n, (r, m) in why.items() if r not in UNRESOLVABLE},
                "FailedAndUnresolvableNodes": {n: m for n, (r, m) in why.items() if r in UNRESOLVABLE}, "Error": ""}
        if req:
            assert want["FailedNodes"] and want["FailedAndUnresolvableNodes"] and ok
        for v in verdicts:
            if v and not v.fits:   # the entry made with the verdict
                assert v.entry == ":" + json.dumps(f"xpusense {v.reason}: {v.detail}")
        for c in (None, cache, cache):
            assert filter_reply(core, {"Pod": p, "NodeNames": names}, c) == json.dumps(want, separators=(",", ":"))
            got = json.loads(filter_reply(core, {"Pod": p, "Nodes": nodes}, c))
            assert got == {**want, "NodeNames": None, "Nodes": {**nodes, "items": [
                i for i in nodes["items"] if i["metadata"]["name"] in ok]}}
            best = max((v.score for v in verdicts if v and v.fits), default=0.0)
            prios = [{"Host": n, "Score": round(10 * v.score / best) if v and v.fits and best > 0 else 0}
                     for n, v in zip(names, verdicts)]
            assert priorities_reply(core, {"Pod": p, "NodeNames": names}, c) == json.dumps(prios, separators=(",", ":"))
    bad = json.loads(filter_reply(core, {"Pod": pod({"nvidia.com/gpu": "x"}), "NodeNames": names}))
    assert "is not a whole number" in bad["Error"] and bad["NodeNames"] is None and bad["FailedNodes"] == {}
