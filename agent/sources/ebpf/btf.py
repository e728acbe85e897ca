"""The running kernel's own type information (BTF, /sys/kernel/btf/vmlinux): struct member offsets,
functions and tracepoint prototypes, read at planning time instead of from header files.

Probes that read a kernel struct get its member offsets from here as -D defines (the installed
headers may be generic ones of another layout); feature tests ask whether a BPF helper's function
or a raw tracepoint's prototype exists. Format: Documentation/bpf/btf.rst.
"""

from __future__ import annotations

import array
import struct
from typing import Any

VMLINUX = "/sys/kernel/btf/vmlinux"
MAGIC = 0xEB9F
# BTF kinds
INT, PTR, ARRAY, STRUCT, UNION, ENUM, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT = range(1, 12)
FUNC, FUNC_PROTO, VAR, DATASEC, FLOAT, DECL_TAG, TYPE_TAG, ENUM64 = range(12, 20)
# bytes after the 12-byte common header: fixed, and per vlen item
_EXTRA = {INT: (4, 0), ARRAY: (12, 0), STRUCT: (0, 12), UNION: (0, 12), ENUM: (0, 8), FUNC_PROTO: (0, 8),
          VAR: (4, 0), DATASEC: (0, 12), DECL_TAG: (4, 0), ENUM64: (0, 12)}
_MODIFIERS = (TYPEDEF, VOLATILE, CONST, RESTRICT, TYPE_TAG)


class BtfError(Exception):
    """No BTF here, or it does not have what was asked for; the message says which."""


class Btf:
    """One BTF blob, walked once: type id -> (kind, name offset, size/type, vlen, where its items start)."""

    def __init__(self, path: str = VMLINUX):
        self.path = path
        try:
            with open(path, "rb") as f:       # sysfs's binary file cannot be mmap'ed: a few MB, read once
                self._data: Any = f.read()
        except FileNotFoundError as e:
            raise BtfError(f"no kernel BTF at {path}: the kernel was built without CONFIG_DEBUG_INFO_BTF") from e
        except OSError as e:
            raise BtfError(f"cannot read the kernel's BTF at {path} ({e})") from e
        d = self._data
        magic, _ver, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", d, 0)
        if magic != MAGIC:
            raise BtfError(f"{path} is not BTF (magic {magic:#x})")
        self._types = hdr_len + type_off
        self._types_end = self._types + type_len
        self._strs = hdr_len + str_off
        self._strs_end = self._strs + str_len
        # Walked as far as a question needs (a plan asks a few names: most are found long before the
        # end of ~130k types), resumed from where it stopped: type id -> byte offset of its record
        # (id 0 is void), and type id -> name offset << 5 | kind.
        self._index = array.array("I", [0])
        self._named = array.array("Q", [0])
        self._pos = self._types                     # where the walk goes on

    def close(self) -> None:
        self._data = b""
        self._index = array.array("I", [0])
        self._named = array.array("Q", [0])
        self._pos = self._types_end = self._types

    def __enter__(self) -> Btf:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- strings and records
    def name(self, off: int) -> str:
        start = self._strs + off
        end = self._data.find(b"\0", start, self._strs_end)
        return bytes(self._data[start:end]).decode(errors="replace")

    def _name_offsets(self, name: str) -> set[int]:
        """Every offset in the string section where exactly `name` is stored (usually one)."""
        out, needle = set(), b"\0" + name.encode() + b"\0"
        pos = self._data.find(needle, self._strs, self._strs_end)
        while pos >= 0:
            out.add(pos + 1 - self._strs)
            pos = self._data.find(needle, pos + 1, self._strs_end)
        if self._data[self._strs:self._strs + len(name) + 1] == name.encode() + b"\0":
            out.add(0)
        return out

    def _walk(self, until_id: int | None = None, until_named: set[int] | None = None) -> int | None:
        """The pass over the types, from where it last stopped: where each record is (index[id]),
        and its name and kind (named[id] = name offset << 5 | kind) for find(). It stops once type id
        `until_id` is walked, or at the first type whose named entry is in `until_named` (that id is
        returned), else at the end (None). Compact arrays, not Python ints: ~130k types in a
        distribution kernel, and the agent's memory should not keep their trace."""
        d, pos, end = self._data, self._pos, self._types_end
        index, named = self._index, self._named
        unpack = struct.Struct("<II").unpack_from
        extra = _EXTRA
        want = until_named or ()
        found = None
        while pos < end and (until_id is None or len(index) <= until_id):
            index.append(pos)
            name_off, info = unpack(d, pos)
            kind = (info >> 24) & 0x1F
            key = name_off << 5 | kind
            named.append(key)
            fixed, per = extra.get(kind, (0, 0))
            pos += 12 + fixed + per * (info & 0xFFFF)
            if key in want:
                found = len(named) - 1
                break
        self._pos = pos
        return found

    def _record(self, tid: int) -> tuple[int, int, int, int, int]:
        """(kind, name_off, size_or_type, vlen, offset of its items) of type id `tid`."""
        if tid >= len(self._index):
            self._walk(until_id=tid)
            if tid >= len(self._index):
                raise BtfError(f"type id {tid} is beyond the kernel's BTF ({len(self._index) - 1} types)")
        pos = self._index[tid]
        name_off, info, size_type = struct.unpack_from("<III", self._data, pos)
        kind = (info >> 24) & 0x1F
        return kind, name_off, size_type, info & 0xFFFF, pos + 12 + _EXTRA.get(kind, (0, 0))[0]

    def find(self, kind: int, name: str) -> int:
        """The id of the first type of `kind` named `name`; BtfError when there is none."""
        keys = {off << 5 | kind for off in self._name_offsets(name)}
        found = []
        for key in keys:        # among the types walked so far
            try:
                found.append(self._named.index(key))     # a linear search, in C
            except ValueError:
                pass
        if found:
            return min(found)
        got = self._walk(until_named=keys) if keys else None     # a name not in the strings: no type has it
        if got is not None:
            return got
        raise BtfError(f"the kernel's BTF has no {_KIND_NAMES.get(kind, kind)} {name}")

    def has(self, kind: int, name: str) -> bool:
        try:
            self.find(kind, name)
            return True
        except BtfError:
            return False

    def _resolve(self, tid: int) -> int:
        """Through typedefs, const, volatile, restrict and type tags to the type itself."""
        for _ in range(64):
            kind, _n, size_type, _v, _p = self._record(tid)
            if kind not in _MODIFIERS:
                return tid
            tid = size_type
        raise BtfError(f"type {tid}: modifier chain too long")

    def member_offset(self, struct_name: str, path: str) -> int:
        """Byte offset of `path` ("sched_info.run_delay") within struct `struct_name`, following
        nested (anonymous too) structs and unions; BtfError naming what is missing."""
        tid = self.find(STRUCT, struct_name)
        offset = 0
        where = f"struct {struct_name}"
        for part in path.split("."):
            found = self._member(tid, part)
            if found is None:
                raise BtfError(f"the kernel's {where} has no member {part}")
            bits, tid = found
            if bits % 8:
                raise BtfError(f"{where}.{part} is a bitfield")
            offset += bits // 8
            where = f"{where}.{part}"
        return offset

    def _member(self, tid: int, name: str) -> tuple[int, int] | None:
        """(bit offset, type id) of member `name` of struct/union `tid`, searching anonymous members."""
        kind, _n, _s, vlen, items = self._record(self._resolve(tid))
        if kind not in (STRUCT, UNION):
            return None
        kflag = struct.unpack_from("<I", self._data, self._index[self._resolve(tid)] + 4)[0] >> 31
        for i in range(vlen):
            m_name, m_type, m_off = struct.unpack_from("<III", self._data, items + 12 * i)
            bits = m_off & 0xFFFFFF if kflag else m_off
            if m_name == 0:                      # anonymous struct/union: look inside
                inner = self._member(m_type, name)
                if inner is not None:
                    return bits + inner[0], inner[1]
            elif self.name(m_name) == name:
                return bits, m_type
        return None

    def func_params(self, typedef_name: str) -> int:
        """Parameters of the function pointer typedef `typedef_name` (btf_trace_<tp> for raw
        tracepoints: the first is the context, the others the tracepoint's arguments)."""
        tid = self.find(TYPEDEF, typedef_name)
        kind, _n, target, _v, _p = self._record(tid)
        kind, _n, target, _v, _p = self._record(self._resolve(target))
        if kind != PTR:
            raise BtfError(f"{typedef_name} is not a function pointer")
        kind, _n, _ret, vlen, _p = self._record(self._resolve(target))
        if kind != FUNC_PROTO:
            raise BtfError(f"{typedef_name} is not a function pointer")
        return vlen


_KIND_NAMES = {STRUCT: "struct", UNION: "union", FUNC: "function", TYPEDEF: "typedef", ENUM: "enum"}
