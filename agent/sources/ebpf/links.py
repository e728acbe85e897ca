"""The interfaces of a network namespace, asked of the kernel over a raw rtnetlink socket.

tc_traffic's plan needs each link's name, index, kind (veth, bridge...; none for a physical device)
and whether it is a loopback: one RTM_GETLINK dump. pyroute2 answers the same, but importing it takes
about a tenth of a second of the agent's start, ahead of the loader process's request; the loader
process, which adds the filters, still uses it. A socket in another namespace is opened by a thread
that enters the namespace (setns is per thread) and ends; the socket stays in that namespace.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading

NETLINK_ROUTE = 0
RTM_GETLINK, RTM_NEWLINK, NLMSG_ERROR, NLMSG_DONE = 18, 16, 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
IFLA_IFNAME, IFLA_LINKINFO, IFLA_INFO_KIND = 3, 18, 1
IFF_LOOPBACK = 0x8
CLONE_NEWNET = 0x40000000
MAX_LINKS = 65536           # a dump longer than this is cut (and said): no namespace has that many
RECV_BYTES = 65536
_NLMSG = struct.Struct("=IHHII")        # len, type, flags, seq, pid
_IFINFO = struct.Struct("=BxHiII")      # family, type, index, flags, change
_RTA = struct.Struct("=HH")             # len, type


class LinksError(OSError):
    """The dump could not be made or read; the message says why."""


def netns_path(netns: str) -> str:
    """A namespace's name under /run/netns, or a path as it is."""
    return netns if "/" in netns else os.path.join("/run/netns", netns)


def _socket_in(netns: str) -> socket.socket:
    if not netns:
        return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
    got: dict[str, object] = {}

    def enter() -> None:
        try:
            fd = os.open(netns_path(netns), os.O_RDONLY | os.O_CLOEXEC)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    e = ctypes.get_errno()
                    raise OSError(e, f"setns into {netns_path(netns)}: {os.strerror(e)}")
            finally:
                os.close(fd)
            got["sock"] = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        except OSError as e:
            got["error"] = e

    t = threading.Thread(target=enter, name="netns-enter", daemon=True)    # leaves with its namespace
    t.start()
    t.join()
    if "error" in got:
        raise LinksError(str(got["error"]))
    sock = got["sock"]
    assert isinstance(sock, socket.socket)
    return sock


def _attrs(buf: bytes, start: int, end: int) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    pos = start
    while pos + _RTA.size <= end:
        length, kind = _RTA.unpack_from(buf, pos)
        if length < _RTA.size or pos + length > end:
            break
        out.setdefault(kind & 0x3FFF, buf[pos + _RTA.size:pos + length])     # without NLA_F_NESTED and friends
        pos += (length + 3) & ~3
    return out


def parse_link(buf: bytes, start: int, end: int) -> dict:
    """One RTM_NEWLINK message's body -> {"ifname", "index", "kind", "loopback"}."""
    _family, _type, index, flags, _change = _IFINFO.unpack_from(buf, start)
    attrs = _attrs(buf, start + _IFINFO.size, end)
    kind = None
    if IFLA_LINKINFO in attrs:
        info = attrs[IFLA_LINKINFO]
        raw = _attrs(info, 0, len(info)).get(IFLA_INFO_KIND)
        kind = raw.split(b"\0", 1)[0].decode(errors="replace") if raw else None
    name = attrs.get(IFLA_IFNAME, b"").split(b"\0", 1)[0].decode(errors="replace")
    return {"ifname": name, "index": index, "kind": kind, "loopback": bool(flags & IFF_LOOPBACK)}


def list_links(netns: str = "", timeout_s: float = 5.0) -> list[dict]:
    """Every link of `netns` ("" for the agent's own), as parse_link gives them; LinksError."""
    try:
        sock = _socket_in(netns)
    except OSError as e:
        raise LinksError(str(e)) from e
    links: list[dict] = []
    with sock:
        try:
            sock.settimeout(timeout_s)
            sock.bind((0, 0))
            seq = 1
            req = _NLMSG.pack(_NLMSG.size + _IFINFO.size, RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + \
                _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
            sock.sendall(req)
            while True:
                buf = sock.recv(RECV_BYTES)
                if not buf:
                    raise LinksError("rtnetlink closed the link dump before its end")
                pos = 0
                while pos + _NLMSG.size <= len(buf):
                    length, kind, _flags, got_seq, _pid = _NLMSG.unpack_from(buf, pos)
                    if length < _NLMSG.size or pos + length > len(buf):
                        raise LinksError(f"rtnetlink sent a malformed message ({length} bytes)")
                    if got_seq == seq:
                        if kind == NLMSG_DONE:
                            return links
                        if kind == NLMSG_ERROR:
                            err = -struct.unpack_from("=i", buf, pos + _NLMSG.size)[0]
                            raise LinksError(f"rtnetlink refused the link dump: {os.strerror(err)}")
                        if kind == RTM_NEWLINK:
                            if len(links) >= MAX_LINKS:
                                raise LinksError(f"more than {MAX_LINKS} links in the namespace")
                            links.append(parse_link(buf, pos + _NLMSG.size, pos + length))
                    pos += (length + 3) & ~3
        except TimeoutError as e:
            raise LinksError(f"rtnetlink did not answer the link dump within {timeout_s:.0f} s") from e
        except LinksError:
            raise
        except OSError as e:
            raise LinksError(str(e)) from e
