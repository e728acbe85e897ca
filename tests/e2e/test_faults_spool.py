"""The agent's spool under damaged bytes and a full disk, with real processes:
damaged records are skipped, counted and kept aside while every other batch is delivered; a full
disk is a state the agent reports and leaves by itself, with every batch delivered or counted as
dropped, memory within its budget, and the systemd watchdog still fed while delivery goes on."""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import threading

import psutil
import pytest
from helpers import BIN, wait_until
from helpers import record_figure as record
from test_faults import FAST, Rig, check_exactly_once, spooled

from xpusense.agent.spool import records
from xpusense.collector.store import stored_batches


def value(node, name):
    found = [s for s in node["series"] if s["name"] == name]
    return found[0]["value"] if found else None


def damage(spool_dir, seqs_and_kinds):
    """Damage the records of the given seqs in place: 'protobuf' re-frames the record around bytes
    that are no Batch (framing and checksum right), 'framing' flips a byte of its length field,
    'payload' flips a byte in the middle of its payload."""
    for seg in sorted(spool_dir.glob("*.seg")):
        data = seg.read_bytes()
        fd = os.open(seg, os.O_RDONLY)
        try:
            found = [r for r in records.scan(fd) if isinstance(r, records.Good)]
        finally:
            os.close(fd)
        for r in reversed(found):          # from the end: offsets before it stay right
            kind = seqs_and_kinds.get(r.seq)
            if kind == "protobuf":
                new = records.encode(r.boot, r.seq, r.samples, b"\xff\xfe not a protobuf Batch " * 8)
                data = data[:r.offset] + new + data[r.offset + r.length:]
            elif kind == "framing":
                data = data[:r.offset + 5] + bytes([data[r.offset + 5] ^ 0x40]) + data[r.offset + 6:]
            elif kind == "payload":
                at = r.offset + records.HEADER.size + (r.length - records.HEADER.size) // 2
                data = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]
        seg.write_bytes(data)


def test_damaged_spool_records_are_skipped_counted_kept_aside_and_the_rest_delivered(procs, tmp_path):
    """Before: one undecodable record was resent forever (226 tracebacks in 25 s) and nothing of the
    new boot was delivered; one bad framing byte dropped the 13 records after it, uncounted."""
    rig = Rig(procs, tmp_path, node="damaged-node")
    rig.start_collector()
    rig.start_agent()
    wait_until(lambda: (n := rig.view()) and n["stored_up_to"] >= 3, what="first batches stored")
    rig.collector.kill(signal.SIGKILL)
    wait_until(lambda: len(spooled(rig.spool)) >= 25, what="batches piling up in the spool")
    rig.agent.kill(signal.SIGKILL)
    left = spooled(rig.spool)
    boot1 = left[0][0]
    seqs = [s for _, s in left]
    bad = {seqs[4]: "protobuf", seqs[10]: "framing", seqs[16]: "payload"}
    damage(rig.spool, bad)

    rig.start_collector()
    rig.start_agent()
    want = {(boot1, s) for s in seqs if s not in bad}
    n = wait_until(lambda: want <= {(b, s) for b, s, _ in rig.stored()} and (n := rig.view())
                   and n["boot_id"] != boot1 and n["stored_up_to"] >= 5 and value(n, "xpusense.agent.spool.damaged")
                   and n, timeout_s=90, what="the other spooled batches stored, the new boot streaming")
    rig.agent.kill(signal.SIGTERM)
    stored = rig.stored()
    per_boot, missing = check_exactly_once(stored, {boot1: 3})
    assert missing[boot1] == sorted(bad), "exactly the damaged records are missing"
    assert value(n, "xpusense.agent.spool.damaged") == 3
    assert value(n, "xpusense.agent.stream.dropped_batches") >= 3
    assert value(n, "xpusense.agent.stream.reconnects") == 1, "no resend loop: one connection"
    out = rig.agent.output()
    second_run = out[out.rindex("streaming to"):] if out.count("streaming to") > 1 else out
    assert "Traceback" not in out
    lines = [ln for ln in out.splitlines() if "damaged record at byte" in ln]
    assert len(lines) == 3 and all(".seg" in ln for ln in lines), lines
    assert "not a Batch" in "\n".join(lines) and "checksum mismatch" in "\n".join(lines)
    kept = list((rig.spool / "damaged").iterdir())
    assert len(kept) == 3
    record("spool damaged records", spooled_at_kill=len(left), damaged=len(bad), skipped_counted=3,
           batches_lost_beyond_damaged=len(missing[boot1]) - len(bad), tracebacks=second_run.count("Traceback"),
           new_boot_stored=len(per_boot[n["boot_id"]]), reconnects=int(value(n, "xpusense.agent.stream.reconnects")))


# -- a full disk -------------------------------------------------------------------------------------

def mount_tmpfs(path, size="2m"):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (mount -t tmpfs -o size=2m)")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


def fill(path, keep_free):
    """Fill the filesystem at `path` but for about `keep_free` bytes; the filler's path."""
    spare = path / "spare"
    spare.write_bytes(b"\0" * keep_free)
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        pass
    finally:
        os.close(fd)
    spare.unlink()
    return filler


class NotifySocket:
    """A datagram socket standing in for systemd's: what the agent sends to $NOTIFY_SOCKET."""

    def __init__(self, path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.got: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self):
        while not self._stop.is_set():
            try:
                self.got.append(self.sock.recv(4096).decode())
            except TimeoutError:
                pass

    def close(self):
        self._stop.set()
        self._t.join()
        self.sock.close()


def test_full_disk_is_a_state_delivery_goes_on_and_every_batch_is_delivered_or_counted(procs, tmp_path):
    """Before: on a full 2 MB tmpfs the batcher and spool-flush threads died while the process and its
    watchdog stayed 'healthy'; delivery stopped; 473 ExtraData tracebacks when space came back."""
    mnt = tmp_path / "spoolfs"
    mount_tmpfs(mnt)
    sd = None
    try:
        rig = Rig(procs, tmp_path, node="full-disk-node")
        rig.spool_base, rig.spool = mnt, mnt / rig.node
        rig.cfg.write_text(FAST.replace("[stream]\n", "[stream]\nqueue_batches = 20\n"))
        sd = NotifySocket(tmp_path / "notify")
        rig.start_collector()
        rig.agent = procs([str(BIN / "xpusense-agent"), "run", "--config", str(rig.cfg), "--collector", rig.addr,
                           "--node-id", rig.node], "agent",
                          env={"XPUSENSE_SPOOL_DIR": str(mnt), "NOTIFY_SOCKET": sd.path, "WATCHDOG_USEC": "1000000"})
        first = wait_until(lambda: (n := rig.view()) and n["stored_up_to"] >= 3 and n, what="first batches stored")
        boot = first["boot_id"]
        rig.collector.kill(signal.SIGKILL)
        filler = fill(mnt, keep_free=32 * 1024)       # the spool fills the rest by itself (compact batches: ~1 kB)
        wait_until(lambda: "cannot write" in rig.agent.output(), timeout_s=90, what="the spool to hit the full disk")
        wait_until(lambda: "in-memory queue full" in rig.agent.output(), what="the memory budget to be reached")
        proc = psutil.Process(rig.agent.p.pid)
        rss = [proc.memory_info().rss]
        pings = sd.got.count("WATCHDOG=1")
        # Batches keep coming while nothing can be kept but the newest 20: memory stays flat.
        wait_until(lambda: rss.append(proc.memory_info().rss) or "100 batches, " in rig.agent.output()
                   or " 200 batches, " in rig.agent.output(), timeout_s=120, what="100 batches dropped and counted")
        assert sd.got.count("WATCHDOG=1") > pings, "delivery runs (from memory): the watchdog is fed"
        assert any("spool cannot write" in m for m in sd.got if m.startswith("STATUS=")), sd.got[-5:]

        rig.start_collector()                        # what waited in memory is delivered
        wait_until(lambda: (n := rig.view()) and n["connected"] and n["boot_id"] == boot, what="the agent back")
        filler.unlink()
        wait_until(lambda: "writable again" in rig.agent.output(), what="the spool to write again")
        drops = {}

        def settled():
            nd = rig.view()
            stored = rig.stored()
            seqs = {s for b, s, _ in stored if b == boot}
            missing = set(range(1, max(seqs) + 1)) - seqs
            drops.update(node=nd, stored=stored, missing=missing)
            return (nd and value(nd, "xpusense.agent.spool.writable") == 1 and len(spooled(rig.spool)) < 5
                    and value(nd, "xpusense.agent.stream.dropped_batches") == len(missing) > 0)
        try:
            wait_until(settled, timeout_s=90, what="everything delivered, and every missing batch counted as dropped")
        except AssertionError as e:   # say which part did not hold
            nd = drops.get("node")
            raise AssertionError(f"{e}: writable={nd and value(nd, 'xpusense.agent.spool.writable')}, "
                                 f"spooled={len(spooled(rig.spool))}, "
                                 f"dropped_batches={nd and value(nd, 'xpusense.agent.stream.dropped_batches')}, "
                                 f"missing={len(drops.get('missing', ()))} {sorted(drops.get('missing', ()))[:20]}; "
                                 f"agent log tail: {rig.agent.output()[-3000:]}") from None
        nd = drops["node"]
        rig.agent.kill(signal.SIGTERM)
        out = rig.agent.output()
        check_exactly_once(drops["stored"], {boot: len(drops["missing"])})
        # The agent said so itself: its spool.writable series went 0 while the disk was full, then 1.
        writable = [s.value for b in stored_batches(str(rig.data)) if b.node_id == rig.node
                    for s in b.samples if s.name == "xpusense.agent.spool.writable"]
        assert 0.0 in writable and writable[-1] == 1.0, writable
        assert "Traceback" not in out and "ExtraData" not in out, out[max(0, out.find("Traceback") - 1500):][:5000]
        failures = value(nd, "xpusense.agent.spool.write_failures")
        spool_log = [ln for ln in out.splitlines() if "xpusense.agent.spool:" in ln]
        state_lines = sum("cannot write" in ln for ln in spool_log)
        back_lines = sum("writable again" in ln for ln in spool_log)
        # One line per change of state (the disk fills again as the batches held in memory are written):
        # never one per failed write, as the 473 tracebacks were.
        assert back_lines >= 1 and state_lines in (back_lines, back_lines + 1), (state_lines, back_lines)
        assert failures >= 10 * state_lines, (failures, state_lines)
        per_boot = collections.Counter(b for b, _, _ in drops["stored"])
        record("spool full disk (2 MB tmpfs)", stored=per_boot[boot], write_failures=int(failures),
               dropped_counted=len(drops["missing"]), lost_uncounted=0, cannot_write_log_lines=state_lines,
               tracebacks=out.count("Traceback"), rss_mb_min=round(min(rss) / 2**20, 1),
               rss_mb_max=round(max(rss) / 2**20, 1), rss_samples=len(rss))
    finally:
        if sd is not None:
            sd.close()
        subprocess.run(["umount", "-l", str(mnt)], check=False)
