"""BPF maps read and written through the bpf(2) syscall alone: no bcc, no LLVM in the agent's memory.

The loader process hands over each map's fd with its layout (type, key and value sizes, bcc's JSON
description of the key and value C types); `ctype_of` turns a description into a ctypes type as bcc's
`_decode_table_type` does. A whole map is read with one BPF_MAP_LOOKUP_BATCH call (Linux 5.6+), key
by key where the kernel refuses it, as bcc does.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from collections.abc import Iterator
from typing import Any

# The bpf syscall's number per machine (no libc wrapper exists for it).
BPF_SYSCALL_NR = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}
BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_MAP_DELETE_ELEM, BPF_MAP_GET_NEXT_KEY = 1, 2, 3, 4
BPF_OBJ_GET_INFO_BY_FD, BPF_MAP_LOOKUP_BATCH = 15, 24
BPF_ANY = 0
ENOTSUPP = 524          # the kernel's internal "not supported", as bpf(2) returns it for a missing op

# bpf_map_type values (include/uapi/linux/bpf.h)
HASH, ARRAY, PERCPU_HASH, PERCPU_ARRAY, LRU_HASH, LRU_PERCPU_HASH = 1, 2, 5, 6, 9, 10
PERCPU_TYPES = {PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH}
BATCH_TYPES = {HASH, ARRAY, PERCPU_HASH, PERCPU_ARRAY, LRU_HASH, LRU_PERCPU_HASH}

_ELEM = struct.Struct("=IIQQQ")          # map_fd, pad, key, value|next_key, flags
_BATCH = struct.Struct("=QQQQIIQQ")      # in_batch, out_batch, keys, values, count, map_fd, elem_flags, flags

# PyDLL: the GIL is held through the call. A bpf(2) call takes microseconds; letting the GIL go for it
# would hand it to another thread and back (two context switches) for every map read of every round.
_libc = ctypes.PyDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint]
_NR = BPF_SYSCALL_NR.get(platform.machine())     # asked once: every round makes dozens of calls


def bpf(cmd: int, attr: ctypes.Array) -> int:
    """bpf(cmd, attr, sizeof attr); raises OSError with the kernel's errno on failure."""
    if _NR is None:
        raise OSError(errno.ENOSYS, f"no bpf syscall number known for {platform.machine()}")
    ret = _syscall(_NR, cmd, attr, len(attr))
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e) if e != ENOTSUPP else "operation not supported")
    return int(ret)


def possible_cpus(sysfs: str = "/sys") -> int:
    """How many per-CPU slots a per-CPU map value has: the kernel's possible CPUs (0-3,5 -> 6)."""
    try:
        with open(f"{sysfs}/devices/system/cpu/possible") as f:
            text = f.read().strip()
    except OSError:
        return os.cpu_count() or 1
    return parse_cpu_list(text)


def parse_cpu_list(text: str) -> int:
    """'0-3,5' -> 6 (the highest CPU number + 1, as the kernel sizes per-CPU values)."""
    top = -1
    for part in text.split(","):
        if part.strip():
            top = max(top, int(part.split("-")[-1]))
    return top + 1


_INFO = struct.Struct("=IIQ")           # bpf_fd, info_len, info
PROG_INFO_LEN = 208                     # struct bpf_prog_info up to run_cnt (Linux 5.1+)
_PROG_ID_AT, _RUN_TIME_AT, _RUN_CNT_AT = 4, 192, 200
_PROG_ID, _RUN = struct.Struct("=I"), struct.Struct("=QQ")     # prog id; run_time_ns, run_cnt


class ProgStats:
    """bpf_stats of programs by fd, with one BPF_OBJ_GET_INFO_BY_FD call each (no /proc file to parse):
    (prog_id, run_cnt, run_time_ns). Buffers are reused: this runs every round."""

    def __init__(self) -> None:
        self._info = ctypes.create_string_buffer(PROG_INFO_LEN)
        self._attr = ctypes.create_string_buffer(_INFO.size)

    def read(self, fd: int) -> tuple[int, int, int]:
        ctypes.memset(self._info, 0, PROG_INFO_LEN)
        _INFO.pack_into(self._attr, 0, fd, PROG_INFO_LEN, ctypes.addressof(self._info))
        bpf(BPF_OBJ_GET_INFO_BY_FD, self._attr)
        run_time_ns, run_cnt = _RUN.unpack_from(self._info, _RUN_TIME_AT)
        return _PROG_ID.unpack_from(self._info, _PROG_ID_AT)[0], run_cnt, run_time_ns


# ------------------------------------------------------------------------------------------ C types

SCALARS: dict[str, Any] = {
    "_Bool": ctypes.c_bool, "char": ctypes.c_char, "signed char": ctypes.c_byte, "unsigned char": ctypes.c_ubyte,
    "short": ctypes.c_short, "unsigned short": ctypes.c_ushort, "int": ctypes.c_int,
    "unsigned int": ctypes.c_uint, "long": ctypes.c_long, "unsigned long": ctypes.c_ulong,
    "long long": ctypes.c_longlong, "unsigned long long": ctypes.c_ulonglong, "float": ctypes.c_float,
    "double": ctypes.c_double, "__int128": ctypes.c_int64 * 2, "unsigned __int128": ctypes.c_uint64 * 2,
}


def ctype_of(desc: Any) -> Any:
    """bcc's JSON description of a map key or value type -> a ctypes type.

    A scalar is its C name ("unsigned long long"); a struct is [name, fields, "struct" | "union" |
    "struct_packed"], each field [name, type], [name, type, [length]] (an array), [name, type, bits]
    or a nested struct or union [name, fields, kind].
    """
    if isinstance(desc, str):
        try:
            return SCALARS[desc]
        except KeyError:
            raise ValueError(f"unknown C type {desc!r} in a map description") from None
    name, members = desc[0], desc[1]
    kind = desc[2] if len(desc) > 2 else "struct"
    fields: list[tuple] = []
    anon: list[str] = []
    for m in members:
        if len(m) == 2:
            fields.append((m[0], ctype_of(m[1])))
        elif len(m) == 3 and isinstance(m[2], list):
            fields.append((m[0], ctype_of(m[1]) * m[2][0]))
        elif len(m) == 3 and isinstance(m[2], int):
            fields.append((m[0], ctype_of(m[1]), m[2]))
        elif len(m) == 3 and m[2] in ("struct", "union", "struct_packed"):
            field = m[0] or f"__anon{len(anon)}"
            if not m[0]:
                anon.append(field)
            fields.append((field, ctype_of(m)))
        else:
            raise ValueError(f"cannot decode map type member {m!r}")
    base = ctypes.Union if kind == "union" else ctypes.Structure
    body: dict[str, Any] = {"_fields_": fields, "_anonymous_": anon}
    if kind == "struct_packed":
        body["_pack_"] = 1
    return type(str(name) or "anon", (base,), body)


# ------------------------------------------------------------------------------------------ maps

class BpfMap:
    """One map, by fd: items() (one batch call), __getitem__, __setitem__, __delitem__, Key and Leaf.

    Values of per-CPU maps come back as a list of per-CPU values; the reader sums them. `fd` is owned:
    close() closes it. `BpfMap.generation` moves at every write or delete from user space, to any
    map: a reader that keeps what it read while the programs have not run (source.py) starts again.
    """

    generation = 0      # writes and deletes of all maps so far (a lost update under a race still moves it)

    def __init__(self, name: str, fd: int, map_type: int, key_size: int, value_size: int, max_entries: int,
                 key_desc: Any, leaf_desc: Any, ncpus: int = 0):
        self.name, self.fd, self.map_type = name, fd, map_type
        self.key_size, self.value_size, self.max_entries = key_size, value_size, max_entries
        self.Key = ctype_of(key_desc)
        self.Leaf = ctype_of(leaf_desc)
        self.percpu = map_type in PERCPU_TYPES
        self.ncpus = (ncpus or possible_cpus()) if self.percpu else 1
        self.stride = (value_size + 7) // 8 * 8 if self.percpu else value_size   # per-CPU values are 8-aligned
        self.batch_ok = map_type in BATCH_TYPES
        self.batch_calls = 0
        self._bufs: tuple[Any, Any, Any, Any] | None = None     # keys, values, token, attr: on first read
        self._closed = False

    @classmethod
    def from_manifest(cls, fd: int, m: dict, ncpus: int = 0) -> BpfMap:
        return cls(m["name"], fd, m["type"], m["key_size"], m["value_size"], m["max_entries"], m["key_desc"],
                   m["leaf_desc"], ncpus)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)

    # -- decoding
    def _value(self, raw: bytes, offset: int) -> Any:
        if not self.percpu:
            return self.Leaf.from_buffer_copy(raw, offset)
        return [self.Leaf.from_buffer_copy(raw, offset + c * self.stride) for c in range(self.ncpus)]

    # -- reading
    def raw_items(self, batch: bool = True) -> tuple[int, bytes, bytes]:
        """(count, keys, values) of every entry, as the kernel laid them out; one syscall where it can
        (batch=False: key by key, without a buffer sized for a full map)."""
        if batch and self.batch_ok:
            try:
                return self._batch()
            except OSError as e:
                if e.errno not in (errno.EINVAL, ENOTSUPP, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                self.batch_ok = False       # an older kernel: key by key from now on
        return self._walk()

    def _batch(self) -> tuple[int, bytes, bytes]:
        if self._bufs is None:      # sized for a full map, allocated once: a map is read every round
            self._bufs = (ctypes.create_string_buffer(max(1, self.max_entries) * self.key_size),
                          ctypes.create_string_buffer(max(1, self.max_entries) * self.stride * self.ncpus),
                          ctypes.create_string_buffer(8), ctypes.create_string_buffer(_BATCH.size))
        keys, values, token, attr = self._bufs
        total = 0
        in_batch = 0
        vsize = self.stride * self.ncpus
        while True:
            want = self.max_entries - total
            if want <= 0:
                break
            _BATCH.pack_into(attr, 0, in_batch, ctypes.addressof(token),
                             ctypes.addressof(keys) + total * self.key_size, ctypes.addressof(values) + total * vsize,
                             want, self.fd, 0, 0)
            done = False
            try:
                bpf(BPF_MAP_LOOKUP_BATCH, attr)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
                done = True             # ENOENT: the last entries (maybe none) are in
            self.batch_calls += 1
            got = _BATCH.unpack_from(attr, 0)[4]
            total += got
            if done:
                break
            in_batch = ctypes.addressof(token)
        # only what was filled (.raw would copy the whole buffer, sized for a full map)
        return (total, ctypes.string_at(ctypes.addressof(keys), total * self.key_size),
                ctypes.string_at(ctypes.addressof(values), total * vsize))

    def _walk(self) -> tuple[int, bytes, bytes]:
        keys, values = bytearray(), bytearray()
        key = ctypes.create_string_buffer(self.key_size)
        nxt = ctypes.create_string_buffer(self.key_size)
        val = ctypes.create_string_buffer(self.stride * self.ncpus)
        attr = ctypes.create_string_buffer(_ELEM.size)
        first = True
        count = 0
        while count < self.max_entries:
            _ELEM.pack_into(attr, 0, self.fd, 0, 0 if first else ctypes.addressof(key), ctypes.addressof(nxt), 0)
            try:
                bpf(BPF_MAP_GET_NEXT_KEY, attr)
            except OSError as e:
                if e.errno == errno.ENOENT:
                    break
                raise
            first = False
            ctypes.memmove(key, nxt, self.key_size)
            _ELEM.pack_into(attr, 0, self.fd, 0, ctypes.addressof(key), ctypes.addressof(val), 0)
            try:
                bpf(BPF_MAP_LOOKUP_ELEM, attr)
            except OSError as e:
                if e.errno == errno.ENOENT:     # deleted between the two calls
                    continue
                raise
            keys += key.raw
            values += val.raw
            count += 1
        return count, bytes(keys), bytes(values)

    def items(self, batch: bool = True) -> Iterator[tuple[Any, Any]]:
        count, keys, values = self.raw_items(batch)
        vsize = self.stride * self.ncpus
        for i in range(count):
            yield self.Key.from_buffer_copy(keys, i * self.key_size), self._value(values, i * vsize)

    def __getitem__(self, key: Any) -> Any:
        kb = bytes(key)
        val = ctypes.create_string_buffer(self.stride * self.ncpus)
        attr = ctypes.create_string_buffer(_ELEM.size)
        kbuf = ctypes.create_string_buffer(kb, len(kb))
        _ELEM.pack_into(attr, 0, self.fd, 0, ctypes.addressof(kbuf), ctypes.addressof(val), 0)
        try:
            bpf(BPF_MAP_LOOKUP_ELEM, attr)
        except OSError as e:
            if e.errno == errno.ENOENT:
                raise KeyError(key) from None
            raise
        return self._value(val.raw, 0)

    def __setitem__(self, key: Any, value: Any) -> None:
        BpfMap.generation += 1
        kb, vb = bytes(key), bytes(value)
        if len(kb) != self.key_size or len(vb) != self.value_size:
            raise ValueError(f"map {self.name}: key/value of {len(kb)}/{len(vb)} bytes, "
                             f"the map has {self.key_size}/{self.value_size}")
        if self.percpu:
            raise ValueError(f"map {self.name}: writing per-CPU maps is not supported")
        kbuf = ctypes.create_string_buffer(kb, len(kb))
        vbuf = ctypes.create_string_buffer(vb, len(vb))
        attr = ctypes.create_string_buffer(_ELEM.size)
        _ELEM.pack_into(attr, 0, self.fd, 0, ctypes.addressof(kbuf), ctypes.addressof(vbuf), BPF_ANY)
        bpf(BPF_MAP_UPDATE_ELEM, attr)

    def zero(self, key: Any) -> None:
        """Set the value of `key` to zeros (on every CPU, for per-CPU maps)."""
        BpfMap.generation += 1
        kb = bytes(key)
        kbuf = ctypes.create_string_buffer(kb, len(kb))
        vbuf = ctypes.create_string_buffer(self.stride * self.ncpus)
        attr = ctypes.create_string_buffer(_ELEM.size)
        _ELEM.pack_into(attr, 0, self.fd, 0, ctypes.addressof(kbuf), ctypes.addressof(vbuf), BPF_ANY)
        bpf(BPF_MAP_UPDATE_ELEM, attr)

    def push(self, value: Any) -> None:
        """Add `value` to a queue or stack map."""
        BpfMap.generation += 1
        vb = bytes(value)
        vbuf = ctypes.create_string_buffer(vb, len(vb))
        attr = ctypes.create_string_buffer(_ELEM.size)
        _ELEM.pack_into(attr, 0, self.fd, 0, 0, ctypes.addressof(vbuf), BPF_ANY)
        bpf(BPF_MAP_UPDATE_ELEM, attr)

    def __delitem__(self, key: Any) -> None:
        BpfMap.generation += 1
        kb = bytes(key)
        kbuf = ctypes.create_string_buffer(kb, len(kb))
        attr = ctypes.create_string_buffer(_ELEM.size)
        _ELEM.pack_into(attr, 0, self.fd, 0, ctypes.addressof(kbuf), 0, 0)
        try:
            bpf(BPF_MAP_DELETE_ELEM, attr)
        except OSError as e:
            if e.errno == errno.ENOENT:
                raise KeyError(key) from None
            raise
