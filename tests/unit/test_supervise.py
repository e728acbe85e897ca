"""common/supervise.py: background work that fails is logged with its traceback, counted and started
again (or ends the process, for work that cannot be); and the snapshot file's abort, the error path
that killed the collector's snapshot task, never raises."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading

import pytest
from helpers import wait_until

from xpusense.collector.store.snapshot_file import TMP_PREFIX, SnapshotFile
from xpusense.common.supervise import EXIT_FATAL, Supervisor


def test_a_failing_task_is_logged_counted_and_restarted(caplog):
    sup = Supervisor(initial_s=0.01, max_s=0.02)
    runs = []

    async def work():
        runs.append(1)
        if len(runs) < 3:
            raise OSError(28, "No space left on device")

    async def main():
        await sup.task("snapshots", work)
    with caplog.at_level(logging.ERROR, logger="xpusense.supervise"):
        asyncio.run(main())
    assert len(runs) == 3 and sup.restarts["snapshots"] == 2 and sup.total() == 2
    failed = [r for r in caplog.records if "background task snapshots failed" in r.getMessage()]
    assert len(failed) == 2 and failed[0].exc_info is not None and "No space left" in failed[0].getMessage()


def test_a_task_ends_with_its_stop_and_with_cancellation():
    sup = Supervisor(initial_s=5.0, max_s=5.0)

    async def broken():
        raise RuntimeError("a bug")

    async def forever():
        await asyncio.Event().wait()

    async def main():
        stop = asyncio.Event()
        t = sup.task("broken", broken, stop)
        await asyncio.sleep(0.05)      # failed once; now in its 5 s backoff
        stop.set()
        await asyncio.wait_for(t, 2)   # the backoff ends with the stop
        f = sup.task("forever", forever)
        await asyncio.sleep(0)
        f.cancel()
        with pytest.raises(asyncio.CancelledError):
            await f
    asyncio.run(main())
    assert sup.counts() == {"broken": 1}


def test_a_failing_thread_is_restarted_until_it_returns():
    sup = Supervisor(initial_s=0.01, max_s=0.02)
    runs = []

    def work():
        runs.append(1)
        if len(runs) < 4:
            raise ValueError("bad record")
    t = sup.thread("spool-flush", work)
    t.start()
    t.join(10)
    assert not t.is_alive() and len(runs) == 4 and sup.restarts["spool-flush"] == 3


def test_a_failing_thread_stops_retrying_once_stopped():
    sup = Supervisor(initial_s=0.01, max_s=0.01)
    stop = threading.Event()

    def work():
        raise ValueError("always")
    t = sup.thread("loop", work, stop)
    t.start()
    wait_until(lambda: sup.restarts["loop"] >= 2, what="restarts")
    stop.set()
    t.join(10)
    assert not t.is_alive()


@pytest.mark.parametrize("kind", ["task", "thread"])
def test_fatal_work_ends_the_process_non_zero(kind):
    """Work that cannot be restarted: logged, then the process exits for its service manager."""
    code = f"""
import asyncio, logging, time
from xpusense.common.supervise import Supervisor
logging.basicConfig()
sup = Supervisor()
def boom():
    raise RuntimeError("cannot go on")
async def aboom():
    boom()
if {kind!r} == "task":
    async def main():
        sup.task("lease", aboom, fatal=True)
        await asyncio.sleep(30)
    asyncio.run(main())
else:
    sup.thread("lease", boom, fatal=True).start()
    time.sleep(30)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_FATAL, r.stderr
    assert "background task lease failed" in r.stderr and "RuntimeError: cannot go on" in r.stderr


def test_a_snapshot_given_up_on_a_full_disk_never_raises_and_leaves_no_file(tmp_path):
    """The disk fills while a snapshot is written: the close's flush fails with ENOSPC again in the
    error path; abort says nothing and removes the temporary file (nothing left to be read)."""
    f = SnapshotFile(str(tmp_path), (1, 0))
    f.f.close()
    f.f = open("/dev/full", "wb")   # noqa: SIM115 -- every write of it: ENOSPC
    f.add(["f", {}])                # buffered: fails only when flushed
    with pytest.raises(OSError, match="No space left"):
        f.finish()
    f.abort()
    assert f.f.closed and not [n for n in tmp_path.iterdir() if n.name.startswith(TMP_PREFIX) or n.suffix == ".snap"]
