"""Whether each reading of each device is answered, and when to ask again after it was not.

A reading is supported until an answer says otherwise: `unsupported` (NotSupported, FunctionNotFound,
NoPermission...) stops the asking until the device is discovered again, with the reason kept for
`describe()`; `transient` (Unknown, Timeout, NotReady, InUse, ResetRequired...) skips it and asks again
after a back-off that doubles from the next round up to a minute, so one bad answer never disables a
reading for the rest of the run and a sick GPU is not hammered every second.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from .library import TRANSIENT, UNSUPPORTED

log = logging.getLogger("xpusense.agent.nvml")

MAX_BACKOFF_S = 60.0
SLACK_S = 0.1   # a round stamped a little early still counts as due


@dataclasses.dataclass
class State:
    kind: str                 # TRANSIENT or UNSUPPORTED
    why: str
    failures: int = 0
    retry_at: float = 0.0     # time.monotonic() from which a transient reading is asked again


def backoff_s(failures: int) -> float:
    """0 after the first failure (the next round asks again), then 1, 2, 4 ... 60 s."""
    return 0.0 if failures <= 1 else min(MAX_BACKOFF_S, 2.0 ** (failures - 2))


class ReadingStates:
    def __init__(self) -> None:
        self._s: dict[tuple[str, str], State] = {}
        self._lock = threading.Lock()   # the event thread reports too

    def due(self, dev: str, what: str, now: float) -> bool:
        st = self._s.get((dev, what))
        return st is None or (st.kind == TRANSIENT and now + SLACK_S >= st.retry_at)

    def unsupported(self, dev: str, what: str) -> str | None:
        """Why the reading is not supported on the device, or None."""
        st = self._s.get((dev, what))
        return st.why if st is not None and st.kind == UNSUPPORTED else None

    def failed(self, dev: str, what: str, kind: str, why: str, now: float) -> None:
        with self._lock:
            st = self._s.get((dev, what))
            if kind == UNSUPPORTED:
                if st is None or st.kind != UNSUPPORTED:
                    log.info("%s: %s unavailable: %s", dev, what, why)
                self._s[(dev, what)] = State(UNSUPPORTED, why)
                return
            if st is None or st.kind != TRANSIENT:
                st = self._s[(dev, what)] = State(TRANSIENT, why)
            st.failures += 1
            st.why = why
            st.retry_at = now + backoff_s(st.failures)
            if st.failures in (1, 10, 100) or st.failures % 1000 == 0:
                log.warning("%s: %s failed (%s), %d time(s) in a row; asking again in %.0f s",
                            dev, what, why, st.failures, backoff_s(st.failures))

    def succeeded(self, dev: str, what: str) -> None:
        st = self._s.get((dev, what))
        if st is not None and st.kind == TRANSIENT:
            with self._lock:
                self._s.pop((dev, what), None)
            log.info("%s: %s answers again after %d failure(s)", dev, what, st.failures)

    def mark_unsupported(self, dev: str, what: str, why: str) -> None:
        """Not asked at all (switched off in config, absent on this model): said once."""
        self.failed(dev, what, UNSUPPORTED, why, 0.0)

    def forget(self, dev: str) -> None:
        """The device was discovered again (MIG change, reset): every reading gets a new chance."""
        with self._lock:
            for key in [k for k in self._s if k[0] == dev or k[0].startswith(dev + "/")]:
                del self._s[key]

    def describe(self) -> tuple[dict[str, str], dict[str, str]]:
        """(unsupported: 'dev/what' -> why, retrying: 'dev/what' -> why and how often it failed)."""
        with self._lock:
            items = sorted(self._s.items())
        unsupported = {f"{d}/{w}": st.why for (d, w), st in items if st.kind == UNSUPPORTED}
        retrying = {f"{d}/{w}": f"{st.why} ({st.failures} failure(s) in a row)"
                    for (d, w), st in items if st.kind == TRANSIENT}
        return unsupported, retrying
