"""kube-scheduler's extender (k8s.io/kube-scheduler/extender/v1) over the scheduler core: a pod made
a Place request (accelerators from its containers' resources, the rest from `xpusense.io/`
annotations), Kubernetes nodes matched to fleet nodes (inventory label `k8s_node`, else node id),
and the filter and prioritize answers in the extender's JSON, joined from each verdict's encoded
entry. docs/kubernetes.md is the user's side."""

from __future__ import annotations

from itertools import compress
from json import dumps, loads
from json.encoder import encode_basestring_ascii as _json
from typing import Any

from xpusense.v1 import scheduler_pb2 as spb

from .core import Scheduler
from .extender_replies import priorities_piece
from .inventory import parse_memory
from .verdict_cache import VerdictCache

GPU_RESOURCES = ("nvidia.com/gpu",)
NPU_PREFIX = "huawei.com/ascend"   # huawei.com/Ascend910, Ascend910B, Ascend310P ... (the Ascend device plugin)
PREFIX = "xpusense.io/"
TRUE, FALSE = ("true", "yes", "1"), ("false", "no", "0", "")
SEP = (",", ":")
NO_ERROR = '"Error":""}'   # how a filter reply without Error ends


class ExtenderError(ValueError):
    """A request the extender cannot answer: the message names what was wrong."""


def _flag(name: str, v: str) -> bool:
    if v.strip().lower() in TRUE:
        return True
    if v.strip().lower() in FALSE:
        return False
    raise ExtenderError(f"annotation {name}: {v!r} is not true or false")


def _list(v: str) -> list[str]:
    return [x.strip() for x in v.split(",") if x.strip()]


def _set_memory(r: spb.PlaceRequest, name: str, v: str) -> None:
    try:
        r.memory_bytes = parse_memory(v)
    except ValueError as e:
        raise ExtenderError(f"annotation {name}: {e}") from None


def _set_residency(r: spb.PlaceRequest, name: str, v: str) -> None:
    r.residency = {"none": spb.RESIDENCY_NONE, "region": spb.RESIDENCY_REGION,
                   "province": spb.RESIDENCY_PROVINCE}.get(v.strip().lower(), -1)
    if r.residency < 0:
        raise ExtenderError(f"annotation {name}: {v!r} is not none, region or province")


ANNOTATIONS = {   # name under xpusense.io/ -> how it sets the request (the table in docs/kubernetes.md)
    "memory-per-device": _set_memory,
    "regions": lambda r, n, v: r.allowed_regions.extend(_list(v)),
    "data-region": lambda r, n, v: setattr(r, "data_region", v.strip()),
    "same-domain": lambda r, n, v: setattr(r, "same_domain", _flag(n, v)),
    "replica-zones": lambda r, n, v: r.replica_zones.extend(_list(v)),
    "residency": _set_residency,
    "data-province": lambda r, n, v: setattr(r, "data_province", v.strip()),
    "require-encryption": lambda r, n, v: setattr(r, "require_encryption", _flag(n, v)),
    "require-attestation": lambda r, n, v: setattr(r, "require_attestation", _flag(n, v)),
}


def _devices(name: str, quantity: Any, where: str) -> int:
    text = str(quantity).strip()
    if not text.isdigit():
        raise ExtenderError(f"{where}: resource {name} = {quantity!r} is not a whole number of devices")
    return int(text)


def _asked(container: dict, where: str) -> dict[str, int]:
    """Devices per kind ("gpu", "npu") a container asks for (limits, else requests)."""
    res = container.get("resources") or {}
    amounts = {**(res.get("requests") or {}), **(res.get("limits") or {})}
    out: dict[str, int] = {}
    for name, q in amounts.items():
        kind = "gpu" if name in GPU_RESOURCES else "npu" if name.lower().startswith(NPU_PREFIX) else None
        if kind is not None:
            out[kind] = out.get(kind, 0) + _devices(name, q, where)
    return out


def place_request(pod: Any) -> spb.PlaceRequest | None:
    """The Place request of a v1 Pod (as the API server serialises it); None when it asks for no
    accelerator (it passes every node untouched). ExtenderError names what was wrong."""
    if not isinstance(pod, dict):
        raise ExtenderError("ExtenderArgs.Pod must be a v1 Pod object")
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    name = f"pod {meta.get('namespace', 'default')}/{meta.get('name', '?')}"
    total: dict[str, int] = {}
    for c in spec.get("containers") or []:
        for k, n in _asked(c, f"{name} container {c.get('name', '?')}").items():
            total[k] = total.get(k, 0) + n
    for c in spec.get("initContainers") or []:   # run one at a time: the largest counts (as kube-scheduler does)
        for k, n in _asked(c, f"{name} init container {c.get('name', '?')}").items():
            total[k] = max(total.get(k, 0), n)
    total = {k: n for k, n in total.items() if n > 0}
    if len(total) > 1:
        raise ExtenderError(f"{name} asks for both GPUs and NPUs; one pod is placed on one kind of accelerator")
    if not total:
        return None
    kind, count = next(iter(total.items()))
    req = spb.PlaceRequest(accelerator=spb.ACCELERATOR_GPU if kind == "gpu" else spb.ACCELERATOR_NPU, count=count)
    for key, value in sorted((meta.get("annotations") or {}).items()):
        if not key.startswith(PREFIX):
            continue
        setter = ANNOTATIONS.get(key[len(PREFIX):])
        if setter is None:
            raise ExtenderError(f"{name}: unknown annotation {key} (known: "
                                f"{', '.join(PREFIX + k for k in ANNOTATIONS)})")
        setter(req, key, str(value))
    return req


def _field(obj: dict, name: str) -> Any:
    """A field of a Go struct as encoding/json reads it: the exact name, else any case."""
    if name in obj:
        return obj[name]
    low = name.lower()
    return next((v for k, v in obj.items() if k.lower() == low), None)


def parse_args(doc: Any) -> tuple[Any, list[str], list[dict] | None, dict | None]:
    """ExtenderArgs -> (pod, node names, the Node objects or None, the NodeList or None)."""
    if not isinstance(doc, dict):
        raise ExtenderError("the body must be an ExtenderArgs object {Pod, Nodes | NodeNames}")
    pod = _field(doc, "Pod")
    if pod is None:
        raise ExtenderError("ExtenderArgs has no Pod")
    names, node_list = _field(doc, "NodeNames"), _field(doc, "Nodes")
    if names is not None:
        try:
            if isinstance(names, list):
                "".join(names)   # a TypeError unless every item is a str (checked at C speed)
                return pod, names, None, None
        except TypeError:
            pass
        raise ExtenderError("ExtenderArgs.NodeNames must be a list of node names")
    if node_list is None:
        raise ExtenderError("ExtenderArgs has neither Nodes nor NodeNames")
    items = node_list.get("items") if isinstance(node_list, dict) else None
    if not isinstance(items, list):
        raise ExtenderError("ExtenderArgs.Nodes must be a v1 NodeList with items")
    try:
        names = [n["metadata"]["name"] for n in items]
    except (KeyError, TypeError):
        raise ExtenderError("ExtenderArgs.Nodes: every item needs metadata.name") from None
    return pod, [str(n) for n in names], items, node_list


def filter_reply(core: Scheduler, doc: Any, cache: VerdictCache | None = None) -> str:
    """ExtenderFilterResult's JSON for an ExtenderArgs document, joined from pieces: each failing
    node's entry as its verdict encoded it when it was made, the passing names encoded as they are
    (extender_replies.py). A request it cannot read answers with Error set (kube-scheduler then
    reports it on the pod)."""
    try:
        pod, names, items, node_list = parse_args(doc)
        req = place_request(pod)
        replies = None if req is None else core.replies(req, names, cache)
    except ValueError as e:   # ExtenderError, or the core's PlaceError
        return dumps({"Nodes": None, "NodeNames": None, "FailedNodes": {}, "FailedAndUnresolvableNodes": {},
                      "Error": str(e)}, separators=SEP)
    if replies is None:   # every node passes
        ok, failed, unresolvable = ",".join(map(_json, names)), "", ""
    else:
        ok, failed, unresolvable = replies.filter_sections()
    if items is not None:
        kept = items if replies is None else list(compress(items, replies.fits()))
        nodes = {**{k: v for k, v in (node_list or {}).items() if k != "items"}, "items": kept}
        passing = '{"Nodes":' + dumps(nodes, separators=SEP) + ',"NodeNames":null'
    else:
        passing = '{"Nodes":null,"NodeNames":[' + ok + "]"
    return (passing + ',"FailedNodes":{' + failed + '},"FailedAndUnresolvableNodes":{'
            + unresolvable + "}," + NO_ERROR)


def filter_result(core: Scheduler, doc: Any, cache: VerdictCache | None = None) -> dict:
    """filter_reply() as the object it encodes."""
    return loads(filter_reply(core, doc, cache))


def priorities_reply(core: Scheduler, doc: Any, cache: VerdictCache | None = None) -> str:
    """HostPriorityList's JSON: Place's score of each node that can take the pod, 0-10 relative to
    the best of them (10); 0 for the others, and for every node when the pod asks for no accelerator.
    ExtenderError / PlaceError when the request cannot be read. `cache`: the verdicts and replies
    kept per request shape (verdict_cache.py), else judged anew."""
    pod, names, _, _ = parse_args(doc)
    req = place_request(pod)
    if req is None:
        return "[" + priorities_piece(names, [], 0.0) + "]"
    return core.replies(req, names, cache).priorities()


def priorities(core: Scheduler, doc: Any, cache: VerdictCache | None = None) -> list[dict]:
    """priorities_reply() as the list it encodes."""
    return loads(priorities_reply(core, doc, cache))
