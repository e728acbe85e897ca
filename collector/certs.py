"""Credentials for a fleet: a CA, the collector's server certificate, one client certificate per node
(its id as subject CN and SAN URI `xpusense://node/<id>`, what collector/auth.py checks), and
per-node bearer tokens where certificates are not deployed. The CA in DIR is reused when it exists,
so running `certs` again for new nodes extends the fleet; keys and tokens are written 0600.

    xpusense-collector certs  --out DIR --nodes n1,n2 [--collector-host HOST ...] [--days N]
    xpusense-collector tokens --out DIR --nodes n1,n2"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import os
import re
import secrets
from pathlib import Path

NODE_URI_PREFIX = "xpusense://node/"
# Node ids become file names and certificate names: keep them to a safe alphabet.
NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
DEFAULT_COLLECTOR_HOSTS = ("localhost", "127.0.0.1", "::1")
CA_DAYS = 3650


class CertError(Exception):
    """Bad input to `certs`/`tokens`; the message says what to change."""


def check_node_ids(nodes: list[str]) -> list[str]:
    out = []
    for n in nodes:
        n = n.strip()
        if not n:
            continue
        if not NODE_ID_RE.match(n):
            raise CertError(f"node id {n!r} is not usable in a certificate or file name: use letters, "
                            f"digits, '.', '_' and '-' (starting with a letter or digit)")
        if n not in out:
            out.append(n)
    if not out:
        raise CertError("--nodes: give at least one node id (comma-separated)")
    return out


def write_private(path: Path, data: bytes) -> None:
    """Write `data` readable by the owner only (0600), also when the file already exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)


def write_public(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, data)
    finally:
        os.close(fd)


def _out_dir(out: str) -> Path:
    d = Path(out)
    if not d.exists():
        d.mkdir(parents=True, mode=0o700)
    elif not d.is_dir():
        raise CertError(f"--out {out}: exists and is not a directory")
    return d


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return cert.public_bytes(serialization.Encoding.PEM)


def _load_or_make_ca(d: Path, days: int):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID
    cert_path, key_path = d / "ca.pem", d / "ca.key"
    if cert_path.exists() and key_path.exists():
        ca_cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        ca_key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        return ca_cert, ca_key, False
    if cert_path.exists() or key_path.exists():
        raise CertError(f"{d}: has only one of ca.pem and ca.key; remove it or restore the other")
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "xpusense"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"xpusense fleet CA {secrets.token_hex(4)}")])
    now = dt.datetime.now(dt.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=max(days, CA_DAYS)))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256()))
    write_private(key_path, _key_pem(key))
    write_public(cert_path, _cert_pem(cert))
    return cert, key, True


def _leaf(ca_cert, ca_key, cn: str, sans: list, server: bool, days: int, client_too: bool = False,
          unit: str = ""):
    """A certificate signed by the CA: a server's (`server`; `client_too`: also a client's, as a
    NATS server is on its routes) or a client's."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    key = _new_key()
    now = dt.datetime.now(dt.UTC)
    ekus = [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
    if server and client_too:
        ekus.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "xpusense"),
                                     *([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit)] if unit else []),
                                     x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(ekus), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def _host_san(host: str):
    from cryptography import x509
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def make_certs(out: str, nodes: list[str], collector_hosts: list[str] | None = None, days: int = 365) -> dict:
    """Write the CA (unless DIR has one), the collector's cert and one cert per node; return the paths."""
    from cryptography import x509
    if days <= 0:
        raise CertError("--days must be greater than 0")
    nodes = check_node_ids(nodes)
    hosts = [h for h in (collector_hosts or DEFAULT_COLLECTOR_HOSTS) if h]
    d = _out_dir(out)
    ca_cert, ca_key, made_ca = _load_or_make_ca(d, days)
    server, skey = _leaf(ca_cert, ca_key, hosts[0], [_host_san(h) for h in dict.fromkeys(hosts)], True, days)
    write_private(d / "collector.key", _key_pem(skey))
    write_public(d / "collector.pem", _cert_pem(server))
    paths = {"ca": str(d / "ca.pem"), "ca_key": str(d / "ca.key"), "ca_created": made_ca,
             "collector": {"cert": str(d / "collector.pem"), "key": str(d / "collector.key"), "hosts": hosts},
             "nodes": {}}
    for n in nodes:
        cert, key = _leaf(ca_cert, ca_key, n, [x509.UniformResourceIdentifier(NODE_URI_PREFIX + n)], False, days)
        write_private(d / f"{n}.key", _key_pem(key))
        write_public(d / f"{n}.pem", _cert_pem(cert))
        paths["nodes"][n] = {"cert": str(d / f"{n}.pem"), "key": str(d / f"{n}.key")}
    return paths


def make_nats_certs(out: str, hosts: list[str] | None = None, days: int = 365) -> dict:
    """Cluster mode's NATS (collector/cluster/nats_auth.py): the CA (unless DIR has one), the servers'
    certificate (for clients and routes: SANs `hosts`) and one client certificate per role, whose
    subject is the user the servers map it to. Returns the paths."""
    from cryptography import x509

    from .cluster.nats_auth import ROLES, SERVER_CN, UNIT, role_cn
    if days <= 0:
        raise CertError("--days must be greater than 0")
    hosts = list(dict.fromkeys(h.strip() for h in (hosts or DEFAULT_COLLECTOR_HOSTS) if h.strip()))
    if not hosts:
        raise CertError("--nats-host: give at least one name or address of the NATS servers")
    d = _out_dir(out)
    ca_cert, ca_key, made_ca = _load_or_make_ca(d, days)
    server, skey = _leaf(ca_cert, ca_key, SERVER_CN, [_host_san(h) for h in hosts], True, days, client_too=True,
                         unit=UNIT)
    write_private(d / "server.key", _key_pem(skey))
    write_public(d / "server.pem", _cert_pem(server))
    paths: dict = {"ca": str(d / "ca.pem"), "ca_key": str(d / "ca.key"), "ca_created": made_ca,
                   "server": {"cert": str(d / "server.pem"), "key": str(d / "server.key"), "hosts": hosts}, "roles": {}}
    for role in ROLES:
        cert, key = _leaf(ca_cert, ca_key, role_cn(role), [x509.UniformResourceIdentifier(f"xpusense://nats/{role}")],
                          False, days, unit=UNIT)
        write_private(d / f"{role}.key", _key_pem(key))
        write_public(d / f"{role}.pem", _cert_pem(cert))
        paths["roles"][role] = {"cert": str(d / f"{role}.pem"), "key": str(d / f"{role}.key")}
    return paths


# ------------------------------------------------------------------------------------------ tokens

def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def parse_tokens(text: str, where: str = "tokens file") -> dict[str, str]:
    """`NODE_ID SHA256_HEX` per line ('#' comments) -> {node id: hex digest}; ValueError names the line."""
    out: dict[str, str] = {}
    for i, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not re.fullmatch(r"[0-9a-fA-F]{64}", parts[1]):
            raise ValueError(f"{where} line {i}: expected 'NODE_ID SHA256_HEX_OF_TOKEN' "
                             f"(`xpusense-collector tokens` writes it)")
        if parts[0] in out:
            raise ValueError(f"{where} line {i}: node {parts[0]!r} listed twice")
        out[parts[0]] = parts[1].lower()
    return out


def make_tokens(out: str, nodes: list[str]) -> dict:
    """A new random token per node in DIR/<node>.token (0600), its SHA-256 in DIR/tokens (0600).

    Lines of other nodes already in DIR/tokens are kept, so the command can add nodes later."""
    nodes = check_node_ids(nodes)
    d = _out_dir(out)
    table_path = d / "tokens"
    table = parse_tokens(table_path.read_text(), str(table_path)) if table_path.exists() else {}
    node_paths: dict[str, str] = {}
    paths = {"tokens_file": str(table_path), "nodes": node_paths}
    for n in nodes:
        tok = secrets.token_urlsafe(32)
        write_private(d / f"{n}.token", (tok + "\n").encode())
        table[n] = token_hash(tok)
        node_paths[n] = str(d / f"{n}.token")
    body = "# node id, SHA-256 of its token (xpusense-collector tokens); the collector's tokens_file\n"
    body += "".join(f"{n} {h}\n" for n, h in sorted(table.items()))
    write_private(table_path, body.encode())
    return paths
