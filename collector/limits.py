"""Limits on what one agent may send, checked for every batch before it is kept: sizes (samples,
events, labels, names, histogram buckets), batches per second per node boot, and, with what is
stored at hand, series per node and how far ahead a sequence number may be. A refusal is a
`Violation` (a gRPC status code and a message naming the limit), counted by its config key in
`hits`; its stream ends, and the collector and every other stream carry on. `interceptors()` ends
a call whose message does not parse with INVALID_ARGUMENT.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from xpusense.common.ids import bad_id
from xpusense.v1 import telemetry_pb2 as pb

from .idle import RefGenerations

HISTOGRAM = pb.HISTOGRAM
log = logging.getLogger("xpusense.collector.limits")


class RateLimitedLog:
    """Warnings at most `per_s` a second (burst `burst`); the rest are counted and the count is
    added to the next line that gets through, so a flood cannot fill the disk with logs."""

    def __init__(self, logger: logging.Logger, per_s: float = 10.0, burst: int = 20):
        self.logger, self.per_s, self.burst = logger, per_s, burst
        self.tokens, self.t = float(burst), time.monotonic()
        self.suppressed = 0

    def warning(self, msg: str, *args) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.per_s)
        self.t = now
        if self.tokens < 1:
            self.suppressed += 1
            return
        self.tokens -= 1
        if self.suppressed:
            msg += f" ({self.suppressed} more not logged)"
            self.suppressed = 0
        self.logger.warning(msg, *args)


# Codes: INVALID_ARGUMENT for a batch that would never pass (too many samples, a label too long: fix
# the agent or raise the limit), RESOURCE_EXHAUSTED for the rate and the series of a node (the agent
# backs off and resends), FAILED_PRECONDITION for a sequence number too far ahead.
@dataclasses.dataclass(frozen=True)
class Violation:
    code: grpc.StatusCode
    message: str
    key: str = ""      # the limit's config key (counted in Limits.hits)


def short_boot(boot_id: str) -> str:
    """A boot id as logs and refusals show it: its first 8 characters. A whole boot id is what a
    process needs to speak for that boot, so it is not written where other users may read it."""
    return boot_id[:8] + ("..." if len(boot_id) > 8 else "")


class Stored(Protocol):
    """What the bounds on sequence numbers and series per node read of what is stored of a node."""

    def seq_mark(self, node_id: str, boot_id: str) -> tuple[int, float] | None:
        """The highest seq stored of the boot and the seconds since it rose; None: nothing stored."""

    def series_count(self, node_id: str) -> int:
        """The node's series (by name and labels) this bound counts."""

    def new_series(self, node_id: str, samples) -> set[tuple]:
        """The series among `samples` that are not counted yet."""

    def evict_expired(self, node_id: str, newest_ns: int = 0) -> int:
        """Let go of the node's series with no point for a while (how many went)."""

    def admit(self, node_id: str, samples) -> None:
        """`samples` of series not known by reference passed: count them from here on (if this
        keeper counts series as they pass rather than as they are stored)."""


def seq_ceiling(mark: int, since_s: float, max_jump: int, per_s: float) -> int | None:
    """The highest sequence number a batch of a boot may carry now: `max_jump` above the boot's
    mark (its highest seq stored), plus `per_s` for every second since the mark rose (an agent
    makes batches no faster). None when nothing of the boot is stored (no mark to count from)."""
    if not mark:
        return None
    return mark + max_jump + int(max(0.0, since_s) * per_s)


DEFAULTS = {
    "max_samples_per_batch": 20_000,    # the agent cuts batches at 5,000 ([stream] max_samples_per_batch)
    "max_events_per_batch": 10_000,
    "max_labels_per_sample": 64,
    "max_label_key_len": 256,
    "max_label_value_len": 4096,        # a cgroup path can be long
    "max_name_len": 256,                # metric names, units, event id/type/severity/device
    "max_text_len": 16_384,             # event messages
    "max_histogram_buckets": 1024,
    "max_series_per_boot": 200_000,     # distinct series references of one agent boot
    "batches_per_s": 100.0,             # an agent sends ~5/s; a resend after a reconnect comes in bursts
    "burst_batches": 5000,
    "max_seq_jump": 100_000,            # + batches_per_s per second since the boot's last stored batch
    "max_series_per_node": 200_000,     # distinct (name, labels) of one node, whatever the series_ref
    "max_nodes": 10_000,                # node ids in the fleet state (a new one past it is refused)
    "max_streams": 10_000,              # Ingest streams open at once
    "max_stream_pending_batches": 64,   # durable store: read from one stream, not yet acknowledged...
    "max_stream_pending_bytes": 8 * 2**20,  # ...and their size on the wire: past either, reading waits
    "max_inventory_bytes": 2**20,       # one node's inventory (Hello or Inventory message)
    "max_series_table_bytes": 64 * 2**20,   # one SeriesTable's definitions, inflated (compact encoding)
    "max_reply_bytes": 4_000_000,       # one ListNodes page (gRPC clients take 4 MiB by default)
}


class Limits:
    MAX_TRACKED_BOOTS = 20_000          # node boots whose checked series references are remembered
    MAX_BUCKETS = 100_000               # rate buckets kept before full (idle) ones are forgotten

    # The limits (set in __init__ from DEFAULTS and the keyword arguments).
    max_samples_per_batch: int
    max_events_per_batch: int
    max_labels_per_sample: int
    max_label_key_len: int
    max_label_value_len: int
    max_name_len: int
    max_text_len: int
    max_histogram_buckets: int
    max_series_per_boot: int
    batches_per_s: float
    burst_batches: int
    max_seq_jump: int
    max_series_per_node: int
    max_nodes: int
    max_streams: int
    max_stream_pending_batches: int
    max_stream_pending_bytes: int
    max_inventory_bytes: int
    max_series_table_bytes: int
    max_reply_bytes: int

    def __init__(self, clock: Callable[[], float] = time.monotonic, **limits):
        unknown = set(limits) - set(DEFAULTS)
        if unknown:
            raise TypeError(f"unknown limits {sorted(unknown)}")
        for k, v in {**DEFAULTS, **limits}.items():
            setattr(self, k, v)
        self.clock = clock
        self._buckets: dict[tuple[str, str], list[float]] = {}   # (node, boot) -> [tokens, last refill]
        # Per node boot, the series references checked: two generations, the older let go every
        # series_idle_s (collector/idle.py; set from [state] by the server or gateway).
        self._checked: collections.OrderedDict[tuple[str, str], RefGenerations[set]] = collections.OrderedDict()
        self.series_idle_s = 3600.0
        self.violations: collections.Counter[str] = collections.Counter()
        self.hits: collections.Counter[str] = collections.Counter()   # "limits.KEY" -> times hit
        self.log = RateLimitedLog(log)

    @classmethod
    def from_config(cls, limits_cfg, **kw) -> Limits:
        return cls(**{k: getattr(limits_cfg, k) for k in DEFAULTS}, **kw)

    # -- the check
    def check(self, node_id: str, batch: pb.Batch, state: Stored | None = None, refs: Sequence[int] | None = None,
              rate: bool = True) -> Violation | None:
        """None, or why the batch is refused. With `state` (what is stored, a `Stored`) also the
        bounds on sequence numbers and on series per node. `refs`: the samples' series_ref, in
        order, when the caller has read them already (batch_rows.BatchRows). `rate`: False where
        batches are read back rather than received (a worker: a backlog comes all at once)."""
        v = self._check(node_id, batch, state, refs, rate)
        if v is not None:
            self.count(v)
            self.log.warning("node %r: %s", node_id[:128], v.message)
        return v

    def count(self, v: Violation) -> None:
        self.violations[v.code.name] += 1
        if v.key:
            self.hits[f"limits.{v.key}"] += 1

    def hit(self, key: str) -> None:
        """A bound that is not a refusal (a stream made to wait, a reply cut into pages) was reached."""
        self.hits[f"limits.{key}"] += 1

    def check_inventory(self, inv: pb.Inventory) -> Violation | None:
        """Why an inventory is refused, or None (not counted here: the caller counts what it refuses)."""
        size = inv.ByteSize()
        if size <= self.max_inventory_bytes:
            return None
        return Violation(grpc.StatusCode.INVALID_ARGUMENT, f"inventory rejected: {size} bytes, more than the "
                         f"collector's limits.max_inventory_bytes = {self.max_inventory_bytes}", "max_inventory_bytes")

    def interceptors(self) -> list:
        """A guard for every method on the port: a message that does not parse (bad wire format, bad
        UTF-8) ends its call with INVALID_ARGUMENT, instead of escaping the servicer as an exception
        (UNKNOWN, and a traceback in the log for every such message); so does a Hello whose node or
        boot id is empty, over 253 characters, or holds spaces or control characters (ids go into
        log lines: a newline in one would forge a line). Logged at most `log_per_s` a second."""
        return [_MalformedInput(self.log)]

    def _bad(self, what: str, key: str, limit) -> Violation:
        return Violation(grpc.StatusCode.INVALID_ARGUMENT,
                         f"batch rejected: {what}, more than the collector's limits.{key} = {limit}", key)

    def _check(self, node_id: str, batch: pb.Batch, state, refs: Sequence[int] | None = None,
               rate: bool = True) -> Violation | None:
        n = len(refs) if refs is not None else len(batch.samples)
        if n > self.max_samples_per_batch:
            return self._bad(f"{n} samples", "max_samples_per_batch", self.max_samples_per_batch)
        if len(batch.events) > self.max_events_per_batch:
            return self._bad(f"{len(batch.events)} events", "max_events_per_batch", self.max_events_per_batch)
        if rate and (v := self._rate(node_id, batch.boot_id)) is not None:
            return v
        if state is not None and (v := self.check_seq(node_id, batch.boot_id, batch.seq, state)) is not None:
            return v
        for e in batch.events:
            if (v := self._check_event(e)) is not None:
                return v
        return self._check_samples(node_id, batch, state, refs)

    def check_seq(self, node_id: str, boot_id: str, seq: int, state: Stored) -> Violation | None:
        """The bound on sequence numbers alone (not counted here: `check` counts what it refuses).
        An agent cannot make batches faster than `batches_per_s`, so even after an outage whose
        oldest batches its spool dropped, its next batch is within reach (or is once enough time has
        passed: it is refused and resent with backoff); a forged seq of 2**64-1 is refused instead
        of making every later batch of the boot look like a resend. `seq_ceiling` is that bound,
        the one implementation: the gateway and the worker call it too."""
        mark = state.seq_mark(node_id, boot_id)
        ceiling = None if mark is None else seq_ceiling(mark[0], mark[1], self.max_seq_jump, self.batches_per_s)
        if ceiling is None or seq <= ceiling:
            return None
        return Violation(grpc.StatusCode.FAILED_PRECONDITION,
                         f"batch rejected: seq {seq} of boot {short_boot(boot_id)!r} is beyond {ceiling}, "
                         f"the most the collector's limits.max_seq_jump = {self.max_seq_jump} and "
                         f"limits.batches_per_s = {self.batches_per_s:g} allow after what it stored of that boot; "
                         f"resend later (the bound grows with time)", "max_seq_jump")

    def _check_samples(self, node_id: str, batch: pb.Batch, state=None,
                       refs: Sequence[int] | None = None) -> Violation | None:
        """Each series of this boot is checked once (by its series_ref) while it is in use (see
        _remember): reading a sample's labels from Python is the costly part of ingest, and the
        fleet state does not read them either for a known reference. With the state: the series the
        batch would add to its node (by name and labels, references or not) count against
        max_series_per_node, after the node's series idle for `history_s` are let go."""
        key = (node_id, batch.boot_id)
        gens = self._checked.get(key)
        if gens is None:
            gens = RefGenerations(set(), self.clock() + self.series_idle_s)
        else:
            self._checked.move_to_end(key)
            if (now := self.clock()) >= gens.turn_at:   # references idle a whole generation go
                if gone := gens.turn(now + self.series_idle_s):
                    self.hits["limits.series_refs.expired"] += gone
        checked = gens.cur
        if refs is None:
            refs = [s.series_ref for s in batch.samples]
        if checked and checked.issuperset(refs):   # the usual batch: every series known (0 never is)
            return None
        earlier = gens.old
        samples = batch.samples
        new: list[int] = []
        unknown: list[pb.Sample] = []     # samples whose series the node may not have yet
        max_buckets = self.max_histogram_buckets
        for i, ref in enumerate(refs):
            if ref and ref in checked:
                continue
            if ref and ref in earlier:   # checked in the generation before: in use again
                earlier.discard(ref)
                checked.add(ref)
                continue
            s = samples[i]   # read only here: a compact batch's sample is built when read
            if (v := self._check_series(s)) is not None:
                return v
            if s.kind == HISTOGRAM and len(s.histogram.bounds) > max_buckets:
                return self._bad(f"histogram {s.name!r} with {len(s.histogram.bounds)} buckets",
                                 "max_histogram_buckets", max_buckets)
            if ref:
                new.append(ref)
            unknown.append(s)
        if state is not None and unknown:
            if (v := self._room(node_id, unknown, state)) is not None:
                return v
            state.admit(node_id, unknown)
        if new:
            self._remember(node_id, key, gens, new)
        return None

    def _remember(self, node_id: str, key: tuple[str, str], gens: RefGenerations[set], new: list[int]) -> None:
        """The batch's new references into the checked ones (only once the whole batch passed), at
        most max_series_per_boot of them: past it the older generation (references idle since the
        last turn) is let go, and what still does not fit is not remembered (checked whenever it
        comes, as a sample without a reference is). A boot is never refused for its references:
        an agent that keeps streaming keeps being stored."""
        limit = self.max_series_per_boot
        if len(gens) + len(new) > limit:
            self.hits["limits.max_series_per_boot"] += 1
            self.hits["limits.series_refs.expired"] += len(gens.old)
            gens.old = set()
            room = max(0, limit - len(gens.cur))
            if room < len(new):
                self.log.warning("node %r: boot %r uses more than limits.max_series_per_boot = %d series "
                                 "references at once; %d new ones are checked each time they come, not remembered",
                                 node_id[:128], short_boot(key[1]), limit, len(new) - room)
                new = new[:room]
        gens.cur.update(new)
        if key not in self._checked:
            self._checked[key] = gens
            while len(self._checked) > self.MAX_TRACKED_BOOTS:
                self._checked.popitem(last=False)

    def _room(self, node_id: str, samples: list[pb.Sample], state) -> Violation | None:
        """Refuse the batch if the series it adds would take its node past max_series_per_node."""
        have = state.series_count(node_id)
        limit = self.max_series_per_node
        if have + len(samples) <= limit:
            return None   # room even if every one is new: not worth reading the labels
        added = len(state.new_series(node_id, samples))
        newest = max(s.time_unix_nano for s in samples)
        if added and have + added > limit and state.evict_expired(node_id, newest):
            self.forget_node(node_id)   # references of let-go series are counted again when they return
            have = state.series_count(node_id)
        if not added or have + added <= limit:
            return None
        return Violation(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"batch rejected: node {node_id[:128]!r} has {have} series and this batch adds {added}, "
                         f"more than limits.max_series_per_node = {limit}", "max_series_per_node")

    def forget_node(self, node_id: str) -> None:
        for key in [k for k in self._checked if k[0] == node_id]:
            del self._checked[key]

    def check_definition(self, s: pb.Sample) -> Violation | None:
        """A series definition (a SeriesTable's, the compact encoding) held to the bounds on a
        sample's name, unit and labels (not counted here: the caller counts what it refuses)."""
        return self._check_series(s)

    def _check_series(self, s: pb.Sample) -> Violation | None:
        if len(s.name) > self.max_name_len:
            return self._bad(f"a metric name of {len(s.name)} characters", "max_name_len", self.max_name_len)
        if len(s.unit) > self.max_name_len:
            return self._bad(f"a unit of {len(s.unit)} characters", "max_name_len", self.max_name_len)
        return self._check_map(s.labels, "sample", s.name)

    def _check_map(self, labels, kind: str, name: str) -> Violation | None:
        """The labels (or attributes) of the `kind` ("sample", "event") called `name`: the message
        naming them is made only for a refusal (this runs for every new series)."""
        if len(labels) > self.max_labels_per_sample:
            return self._bad(f"{kind} {name[:64]!r} with {len(labels)} labels", "max_labels_per_sample",
                             self.max_labels_per_sample)
        for k in labels:   # a protobuf map's own iteration (C), not items() (collections.abc's generators)
            val = labels[k]
            if len(k) > self.max_label_key_len:
                return self._bad(f"{kind} {name[:64]!r}: a label key of {len(k)} characters", "max_label_key_len",
                                 self.max_label_key_len)
            if len(val) > self.max_label_value_len:
                return self._bad(f"{kind} {name[:64]!r}: label {k[:64]!r} with a value of {len(val)} characters",
                                 "max_label_value_len", self.max_label_value_len)
        return None

    def _check_event(self, e: pb.Event) -> Violation | None:
        for field in (e.id, e.type, e.severity, e.device):
            if len(field) > self.max_name_len:
                return self._bad(f"an event field of {len(field)} characters", "max_name_len", self.max_name_len)
        if len(e.message) > self.max_text_len:
            return self._bad(f"an event message of {len(e.message)} characters", "max_text_len", self.max_text_len)
        return self._check_map(e.attributes, "event", e.type)

    def _rate(self, node_id: str, boot_id: str = "") -> Violation | None:
        """A token bucket with a burst, per boot: another process claiming the node id cannot spend
        the real agent's batches."""
        now = self.clock()
        key = (node_id, boot_id)
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= self.MAX_BUCKETS:
                self._forget_full(now)
            b = self._buckets[key] = [float(self.burst_batches), now]
        else:
            b[0] = min(float(self.burst_batches), b[0] + (now - b[1]) * self.batches_per_s)
            b[1] = now
        if b[0] < 1.0:
            return Violation(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"node {node_id[:128]!r} (boot {short_boot(boot_id)!r}) sends more than "
                             f"limits.batches_per_s = {self.batches_per_s:g} "
                             f"batches/s (burst limits.burst_batches = {self.burst_batches}); back off and resend",
                             "batches_per_s")
        b[0] -= 1.0
        return None

    def _forget_full(self, now: float) -> None:
        """Drop buckets that have refilled (they equal a new one); the oldest half if none has."""
        full = [n for n, (tok, t) in self._buckets.items()
                if tok + (now - t) * self.batches_per_s >= self.burst_batches]
        for n in full or list(self._buckets)[: len(self._buckets) // 2]:
            del self._buckets[n]


def check_hello(hello: pb.Hello) -> str | None:
    return bad_id("node_id", hello.node_id) or bad_id("boot_id", hello.boot_id)


class MalformedRequest(Exception):
    """A request that does not parse, or a Hello naming a bad id: its call ends with INVALID_ARGUMENT.
    The guarded request iterator raises it rather than aborting where it reads, since a handler may
    read its requests in a task of its own (Ingest's reader) while its own task sends replies, and a
    status sent from the reader at that moment is refused by gRPC (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS,
    an UNKNOWN for the client): such a reader hands `violation` to the handler's task, which aborts."""

    def __init__(self, why: str):
        self.violation = Violation(grpc.StatusCode.INVALID_ARGUMENT, f"malformed message: {why}")
        super().__init__(self.violation.message)


class _Malformed:
    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why


class _WireSize:
    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = 0


def _lenient(deserializer, size: _WireSize):
    def parse(raw: bytes):
        size.last = len(raw)
        try:
            return deserializer(raw)
        except (DecodeError, ValueError, UnicodeDecodeError) as e:
            return _Malformed(f"{type(e).__name__}: {e}")
    return parse


class GuardedRequests:
    """A streaming call's requests, read through the guard: a message that does not parse, or a
    Hello with a bad id, raises MalformedRequest. `wire_bytes` is the size on the wire of the
    message last returned (grpc reads and parses one message at a time, when it is asked for it),
    so the servicer can bound what it holds in bytes without serializing anything again. No
    generator of its own: nothing here holds the last message between reads, and a read costs
    one await less."""

    __slots__ = ("_next", "_context", "_guard", "_size")

    def __init__(self, it, context, guard: _MalformedInput, size: _WireSize):
        self._next = it.__aiter__().__anext__
        self._context, self._guard, self._size = context, guard, size

    def __aiter__(self):
        return self

    async def __anext__(self):
        m = await self._next()
        if type(m) is _Malformed:
            raise self._guard._refuse(self._context, m.why)
        if type(m) is pb.AgentMessage and m.HasField("hello") and (why := check_hello(m.hello)):
            raise self._guard._refuse(self._context, why)
        return m

    @property
    def wire_bytes(self) -> int:
        return self._size.last


class _MalformedInput(grpc.aio.ServerInterceptor):
    """A message that does not parse -> INVALID_ARGUMENT for its call (see the module docstring)."""

    def __init__(self, log_: RateLimitedLog):
        self.log = log_

    def _refuse(self, context, why: str) -> MalformedRequest:
        self.log.warning("malformed message from %s: %s", context.peer(), why)
        return MalformedRequest(why)

    @staticmethod
    async def _abort(context, e: MalformedRequest):
        await context.abort(e.violation.code, e.violation.message)

    async def intercept_service(self, continuation, details):
        h = await continuation(details)
        if h is None or h.request_deserializer is None:
            return h
        fn = h.stream_stream or h.stream_unary or h.unary_stream or h.unary_unary
        if not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
            return h   # a synchronous handler: left as it is
        return _guarded_handler(h, self)


def _guarded_handler(h, guard: _MalformedInput):
    """The same kind of handler as `h`, reading its requests through GuardedRequests (which raises
    MalformedRequest on a malformed message: the call is aborted here, in the handler's task)."""
    behavior: Callable[..., Any]   # an async generator function (streamed replies) or a coroutine function
    size = _WireSize()   # this handler serves one call
    if h.stream_stream:
        async def stream_stream(it, context):
            reqs = GuardedRequests(it, context, guard, size)
            try:
                async for out in h.stream_stream(reqs, context):
                    yield out
            except MalformedRequest as e:
                await guard._abort(context, e)
            finally:
                # An aborted call's exception keeps this frame alive through its traceback, in a
                # cycle only the garbage collector breaks: let go of the last message now.
                it = reqs = None
        behavior, make = stream_stream, grpc.stream_stream_rpc_method_handler
    elif h.stream_unary:
        async def stream_unary(it, context):
            try:
                return await h.stream_unary(GuardedRequests(it, context, guard, size), context)
            except MalformedRequest as e:
                await guard._abort(context, e)
        behavior, make = stream_unary, grpc.stream_unary_rpc_method_handler
    elif h.unary_stream:
        async def unary_stream(req, context):
            if isinstance(req, _Malformed):
                await guard._abort(context, guard._refuse(context, req.why))
            async for out in h.unary_stream(req, context):
                yield out
        behavior, make = unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        async def unary_unary(req, context):
            if isinstance(req, _Malformed):
                await guard._abort(context, guard._refuse(context, req.why))
            return await h.unary_unary(req, context)
        behavior, make = unary_unary, grpc.unary_unary_rpc_method_handler
    return make(behavior, request_deserializer=_lenient(h.request_deserializer, size),
                response_serializer=h.response_serializer)
