"""Limits on what one agent may send: samples and events per batch, labels per sample, name and label
lengths, histogram buckets, and batches per second per node (a token bucket with a burst).

`Limits.check(node_id, batch)` runs on the collector's event loop for every batch before it is stored
and returns a `Violation` (a gRPC status code and a message naming the limit) or None; the Ingest
servicer aborts that stream with it, and the collector and every other stream carry on. The size of
one message is bounded before any of this by gRPC itself (`max_message_bytes`, RESOURCE_EXHAUSTED).

Reading a sample's labels from Python is the costly part of ingest, so names and labels are checked
once per series reference (`series_ref`) of a node's boot, which is also all the fleet state reads
for a known reference: a later sample with the same reference is not read again, here or there.
References enter the checked set only when their whole batch passed.

Codes: INVALID_ARGUMENT for a batch that would never pass (too many samples, a label too long: fix
the agent or raise the limit), RESOURCE_EXHAUSTED for the rate (the agent backs off and resends).

`Limits.interceptors()` adds one more guard for every method on the port: a message that does not
parse (bad wire format, bad UTF-8) ends its call with INVALID_ARGUMENT, instead of escaping the
servicer as an exception (UNKNOWN, and a traceback in the log for every such message); so does a
Hello whose node or boot id is empty, over 253 characters, or holds spaces or control characters
(ids go into log lines: a newline in one would forge a line).
Violations and malformed messages are logged at most `log_per_s` a second.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from xpusense.common.ids import bad_id
from xpusense.v1 import telemetry_pb2 as pb

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


@dataclasses.dataclass(frozen=True)
class Violation:
    code: grpc.StatusCode
    message: str


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

    def __init__(self, clock: Callable[[], float] = time.monotonic, **limits):
        unknown = set(limits) - set(DEFAULTS)
        if unknown:
            raise TypeError(f"unknown limits {sorted(unknown)}")
        for k, v in {**DEFAULTS, **limits}.items():
            setattr(self, k, v)
        self.clock = clock
        self._buckets: dict[str, list[float]] = {}        # node -> [tokens, last refill time]
        self._checked: collections.OrderedDict[tuple[str, str], set[int]] = collections.OrderedDict()
        self.violations: collections.Counter[str] = collections.Counter()
        self.log = RateLimitedLog(log)

    @classmethod
    def from_config(cls, limits_cfg, **kw) -> Limits:
        return cls(**{k: getattr(limits_cfg, k) for k in DEFAULTS}, **kw)

    # -- the check
    def check(self, node_id: str, batch: pb.Batch) -> Violation | None:
        v = self._check(node_id, batch)
        if v is not None:
            self.violations[v.code.name] += 1
            self.log.warning("node %r: %s", node_id[:128], v.message)
        return v

    def interceptors(self) -> list:
        return [_MalformedInput(self.log)]

    def _bad(self, what: str, key: str, limit) -> Violation:
        return Violation(grpc.StatusCode.INVALID_ARGUMENT,
                         f"batch rejected: {what}, more than the collector's limits.{key} = {limit}")

    def _check(self, node_id: str, batch: pb.Batch) -> Violation | None:
        n = len(batch.samples)
        if n > self.max_samples_per_batch:
            return self._bad(f"{n} samples", "max_samples_per_batch", self.max_samples_per_batch)
        if len(batch.events) > self.max_events_per_batch:
            return self._bad(f"{len(batch.events)} events", "max_events_per_batch", self.max_events_per_batch)
        if (v := self._rate(node_id)) is not None:
            return v
        for e in batch.events:
            if (v := self._check_event(e)) is not None:
                return v
        return self._check_samples(node_id, batch)

    def _check_samples(self, node_id: str, batch: pb.Batch) -> Violation | None:
        """Each series of this boot is checked once (by its series_ref); a new one counts against
        max_series_per_boot."""
        key = (node_id, batch.boot_id)
        checked = self._checked.get(key)
        if checked is None:
            checked = set()
        else:
            self._checked.move_to_end(key)
        samples = batch.samples
        refs = [s.series_ref for s in samples]
        if checked and checked.issuperset(refs):   # the usual batch: every series known (0 never is)
            return None
        new: list[int] = []
        max_buckets = self.max_histogram_buckets
        for s, ref in zip(samples, refs):
            if ref and ref in checked:
                continue
            if (v := self._check_series(s)) is not None:
                return v
            if s.kind == HISTOGRAM and len(s.histogram.bounds) > max_buckets:
                return self._bad(f"histogram {s.name!r} with {len(s.histogram.bounds)} buckets",
                                 "max_histogram_buckets", max_buckets)
            if ref:
                new.append(ref)
        if new:
            if len(checked) + len(new) > self.max_series_per_boot:
                checked.update(new)
                if len(checked) > self.max_series_per_boot:
                    checked.difference_update(new)
                    return Violation(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"batch rejected: boot {batch.boot_id[:64]!r} of node {node_id[:128]!r} would have "
                                     f"more than limits.max_series_per_boot = {self.max_series_per_boot} series")
            checked.update(new)
            if key not in self._checked:
                self._checked[key] = checked
                while len(self._checked) > self.MAX_TRACKED_BOOTS:
                    self._checked.popitem(last=False)
        return None

    def _check_series(self, s: pb.Sample) -> Violation | None:
        if len(s.name) > self.max_name_len:
            return self._bad(f"a metric name of {len(s.name)} characters", "max_name_len", self.max_name_len)
        if len(s.unit) > self.max_name_len:
            return self._bad(f"a unit of {len(s.unit)} characters", "max_name_len", self.max_name_len)
        return self._check_map(s.labels, f"sample {s.name[:64]!r}")

    def _check_map(self, labels, what: str) -> Violation | None:
        if len(labels) > self.max_labels_per_sample:
            return self._bad(f"{what} with {len(labels)} labels", "max_labels_per_sample", self.max_labels_per_sample)
        for k, val in labels.items():
            if len(k) > self.max_label_key_len:
                return self._bad(f"{what}: a label key of {len(k)} characters", "max_label_key_len",
                                 self.max_label_key_len)
            if len(val) > self.max_label_value_len:
                return self._bad(f"{what}: label {k[:64]!r} with a value of {len(val)} characters",
                                 "max_label_value_len", self.max_label_value_len)
        return None

    def _check_event(self, e: pb.Event) -> Violation | None:
        for field in (e.id, e.type, e.severity, e.device):
            if len(field) > self.max_name_len:
                return self._bad(f"an event field of {len(field)} characters", "max_name_len", self.max_name_len)
        if len(e.message) > self.max_text_len:
            return self._bad(f"an event message of {len(e.message)} characters", "max_text_len", self.max_text_len)
        return self._check_map(e.attributes, f"event {e.type[:64]!r}")

    def _rate(self, node_id: str) -> Violation | None:
        now = self.clock()
        b = self._buckets.get(node_id)
        if b is None:
            if len(self._buckets) >= self.MAX_BUCKETS:
                self._forget_full(now)
            b = self._buckets[node_id] = [float(self.burst_batches), now]
        else:
            b[0] = min(float(self.burst_batches), b[0] + (now - b[1]) * self.batches_per_s)
            b[1] = now
        if b[0] < 1.0:
            return Violation(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"node {node_id[:128]!r} sends more than limits.batches_per_s = {self.batches_per_s:g} "
                             f"batches/s (burst limits.burst_batches = {self.burst_batches}); back off and resend")
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


class _Malformed:
    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why


def _lenient(deserializer):
    def parse(raw: bytes):
        try:
            return deserializer(raw)
        except (DecodeError, ValueError, UnicodeDecodeError) as e:
            return _Malformed(f"{type(e).__name__}: {e}")
    return parse


class _MalformedInput(grpc.aio.ServerInterceptor):
    """A message that does not parse -> INVALID_ARGUMENT for its call (see the module docstring)."""

    def __init__(self, log_: RateLimitedLog):
        self.log = log_

    async def _abort(self, context, why: str):
        self.log.warning("malformed message from %s: %s", context.peer(), why)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed message: {why}")

    async def intercept_service(self, continuation, details):
        h = await continuation(details)
        if h is None or h.request_deserializer is None:
            return h
        fn = h.stream_stream or h.stream_unary or h.unary_stream or h.unary_unary
        if not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
            return h   # a synchronous handler: left as it is
        guard = self

        async def requests(it, context):
            async for m in it:
                if isinstance(m, _Malformed):
                    await guard._abort(context, m.why)
                if type(m) is pb.AgentMessage and m.HasField("hello") and (why := check_hello(m.hello)):
                    await guard._abort(context, why)
                yield m

        return _guarded_handler(h, requests, guard)


def _guarded_handler(h, requests, guard: _MalformedInput):
    """The same kind of handler as `h`, reading its requests through `requests` (which aborts the
    call on a malformed message)."""
    behavior: Callable[..., Any]   # an async generator function (streamed replies) or a coroutine function
    if h.stream_stream:
        async def stream_stream(it, context):
            async for out in h.stream_stream(requests(it, context), context):
                yield out
        behavior, make = stream_stream, grpc.stream_stream_rpc_method_handler
    elif h.stream_unary:
        async def stream_unary(it, context):
            return await h.stream_unary(requests(it, context), context)
        behavior, make = stream_unary, grpc.stream_unary_rpc_method_handler
    elif h.unary_stream:
        async def unary_stream(req, context):
            if isinstance(req, _Malformed):
                await guard._abort(context, req.why)
            async for out in h.unary_stream(req, context):
                yield out
        behavior, make = unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        async def unary_unary(req, context):
            if isinstance(req, _Malformed):
                await guard._abort(context, req.why)
            return await h.unary_unary(req, context)
        behavior, make = unary_unary, grpc.unary_unary_rpc_method_handler
    return make(behavior, request_deserializer=_lenient(h.request_deserializer),
                response_serializer=h.response_serializer)
