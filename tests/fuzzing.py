"""Mutations of valid encodings for the fuzz tests: byte-level ones (bit flips, truncations, splices,
random bytes) and protobuf-aware ones on a parsed field tree (lengths off, overlong varints, fields
repeated, dropped, moved, renumbered or given another wire type), all drawn from one seeded Random."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

_EXTREMES = (0, 1, 127, 128, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1)


def varint(n: int, width: int = 0) -> bytes:
    """`n` (taken modulo 2**64) as a varint, padded with continuation bytes to `width` bytes
    (an overlong form: protobuf reads up to 10 bytes; an 11th makes it malformed)."""
    n &= 2**64 - 1
    out = bytearray()
    while True:
        out.append(n & 0x7F)
        n >>= 7
        if not n:
            break
        out[-1] |= 0x80
    while len(out) < width:
        out[-1] |= 0x80
        out.append(0)
    return bytes(out)


@dataclass
class Field:
    """One field of a message as it was on the wire: a varint value, fixed bytes, or a length-
    delimited payload (`children` when the payload itself parses as a message)."""
    number: int
    wire_type: int
    value: int | bytes
    children: list[Field] | None = None
    tag_width: int = 0     # > 0: the tag written overlong to this many bytes
    len_width: int = 0     # > 0: the length varint written overlong
    len_delta: int = 0     # a length off by this much (the payload unchanged)
    val_width: int = 0     # > 0: a varint value written overlong


def _read_varint(data: bytes, p: int) -> tuple[int, int]:
    v = 0
    for i in range(10):
        if p >= len(data):
            raise ValueError("short varint")
        b = data[p]
        p += 1
        v |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            return v & (2**64 - 1), p
    raise ValueError("varint over 10 bytes")


def parse(data: bytes, depth: int = 0) -> list[Field]:
    """The fields of `data` (nested messages parsed too, to a depth of 4); ValueError when `data`
    is not a sequence of well-formed fields."""
    fields, p = [], 0
    while p < len(data):
        tag, p = _read_varint(data, p)
        number, wt = tag >> 3, tag & 7
        if number == 0:
            raise ValueError("field number 0")
        if wt == 0:
            v, p = _read_varint(data, p)
            fields.append(Field(number, wt, v))
        elif wt in (1, 5):
            n = 8 if wt == 1 else 4
            if p + n > len(data):
                raise ValueError("short fixed field")
            fields.append(Field(number, wt, data[p:p + n]))
            p += n
        elif wt == 2:
            n, p = _read_varint(data, p)
            if p + n > len(data):
                raise ValueError("length past the end")
            payload = data[p:p + n]
            p += n
            children = None
            if depth < 4 and payload:
                try:
                    children = parse(payload, depth + 1)
                except ValueError:
                    pass
            fields.append(Field(number, wt, payload, children))
        else:
            raise ValueError(f"wire type {wt}")
    return fields


def serialize(fields: list[Field]) -> bytes:
    out = bytearray()
    for f in fields:
        out += varint(f.number << 3 | f.wire_type, f.tag_width)
        if f.wire_type == 2:
            payload = serialize(f.children) if f.children is not None else bytes(f.value)  # type: ignore[arg-type]
            out += varint(max(0, len(payload) + f.len_delta), f.len_width) + payload
        elif f.wire_type == 0:
            out += varint(f.value if isinstance(f.value, int) else 0, f.val_width)
        elif isinstance(f.value, bytes):
            out += f.value
        else:
            out += (f.value & (2**64 - 1)).to_bytes(8, "little")
    return bytes(out)


@dataclass
class Mutator:
    """Mutated copies of the inputs in `corpus`, reproducibly from `seed`."""
    corpus: list[bytes]
    seed: int
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def __call__(self) -> bytes:
        data = self.rng.choice(self.corpus)
        for _ in range(self.rng.choice((1, 1, 1, 2, 3))):
            data = self.mutate(data)
        return data

    def mutate(self, data: bytes) -> bytes:
        r = self.rng
        try:
            tree = parse(data)
        except ValueError:
            tree = []
        if tree and r.random() < 0.6:
            return self._structured(tree)
        how = r.randrange(6)
        if how == 0 and data:        # bit flips
            b = bytearray(data)
            for _ in range(r.randint(1, 8)):
                b[r.randrange(len(b))] ^= 1 << r.randrange(8)
            return bytes(b)
        if how == 1 and data:        # truncation, at the end or a slice out of the middle
            i = r.randrange(len(data))
            return data[:i] if r.random() < 0.5 else data[:i] + data[r.randint(i, len(data)):]
        if how == 2:                 # a splice of two inputs
            other = r.choice(self.corpus)
            return data[:r.randint(0, len(data))] + other[r.randint(0, len(other)):]
        if how == 3:                 # random bytes inserted
            i = r.randint(0, len(data))
            return data[:i] + r.randbytes(r.randint(1, 16)) + data[i:]
        if how == 4 and data:        # a byte set to a boundary value
            b = bytearray(data)
            b[r.randrange(len(b))] = r.choice((0x00, 0x01, 0x7F, 0x80, 0xFF, 0x08, 0x0A, 0x22))
            return bytes(b)
        return r.randbytes(r.randint(0, 64))   # random bytes

    def _all(self, fields: list[Field]) -> list[tuple[list[Field], int]]:
        """(the list holding it, its index) of every field at every depth."""
        out = []
        for i, f in enumerate(fields):
            out.append((fields, i))
            if f.children is not None:
                out += self._all(f.children)
        return out

    def _structured(self, tree: list[Field]) -> bytes:
        r = self.rng
        where = self._all(tree)
        holder, i = r.choice(where)
        f = holder[i]
        how = r.randrange(11)
        if how == 0:
            f.tag_width = r.randint(2, 11)
        elif how == 1 and f.wire_type == 2:
            f.len_width = r.randint(2, 11)
        elif how == 2 and f.wire_type == 2:
            f.len_delta = r.choice((-1, 1, -2, 2, 7, -100, 2**31, 2**63, -len(bytes(f.value) if isinstance(f.value, bytes) else b"")))
        elif how == 3 and f.wire_type == 0:
            f.val_width = r.randint(2, 11)
        elif how == 4 and f.wire_type == 0:
            f.value = r.choice(_EXTREMES)
        elif how == 5:               # the field given twice (the last one wins in protobuf)
            other = copy.deepcopy(f)
            holder.insert(r.randint(0, len(holder)), other)
        elif how == 6:
            del holder[i]
        elif how == 7:               # moved elsewhere, maybe into another message
            del holder[i]
            to, _ = r.choice(self._all(tree) or [(tree, 0)])
            to.insert(r.randint(0, len(to)), f)
        elif how == 8:
            f.number = r.choice((0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 99, 2**29 - 1))
        elif how == 9:               # another wire type, the payload kept
            f.wire_type = r.choice((0, 1, 2, 3, 4, 5, 6, 7))
            if f.wire_type == 2 and not isinstance(f.value, bytes):
                f.value = varint(f.value)
            if f.wire_type in (1, 5) and isinstance(f.value, int):
                f.value = f.value.to_bytes(16, "little")[:8 if f.wire_type == 1 else 4]
        elif f.wire_type == 2:       # another payload: text, invalid UTF-8, random bytes
            f.children = None
            f.value = r.choice(("ü€𝄞", "\x00", "", "x" * r.randint(1, 40))).encode() if r.random() < 0.5 else \
                r.choice((b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xff", b"a\xe2\x82")) + r.randbytes(r.randint(0, 6))
        return serialize(tree)
