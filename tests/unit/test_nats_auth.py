"""Cluster mode's NATS identities (collector/cluster/nats_auth.py, `xpusense-collector certs --nats`,
[nats] tls_cert/tls_key): one certificate per role whose subject is the user the servers map it to,
allow lists that give each role only its part, and config errors that name the key."""

from __future__ import annotations

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from xpusense.collector.cli import main as collector_main
from xpusense.collector.cluster.cli import load_config
from xpusense.collector.cluster.config import role_files
from xpusense.collector.cluster.nats_auth import ROLES, SERVER_CN, authorization_conf, identity, permissions, role_cn
from xpusense.common.config import ConfigError


def _cfg(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text('[nats]\nurls = ["tls://127.0.0.1:4222"]\n' + text)
    return load_config(str(path), {}, env={})


def test_certs_nats_makes_one_mapped_identity_per_role(tmp_path, capsys):
    d = tmp_path / "nats"
    assert collector_main(["certs", "--nats", str(d), "--nats-host", "nats.example", "--nats-host", "10.0.0.7"]) == 0
    out = capsys.readouterr().out
    for role in ROLES:
        cert = x509.load_pem_x509_certificate((d / f"{role}.pem").read_bytes())
        # nats-server maps a certificate with no matching SAN by its subject, RFC 2253
        assert cert.subject.rfc4514_string() == identity(role_cn(role))
        assert (d / f"{role}.key").stat().st_mode & 0o777 == 0o600
        assert f'{role}: [nats] tls_ca = "{d}/ca.pem", tls_cert = "{d}/{role}.pem"' in out
    server = x509.load_pem_x509_certificate((d / "server.pem").read_bytes())
    assert server.subject.rfc4514_string() == identity(SERVER_CN)
    ekus = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(ekus) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}   # routes dial out too
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["nats.example"]
    assert [str(a) for a in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    ca = (d / "ca.pem").read_bytes()
    assert collector_main(["certs", "--nats", str(d)]) == 0   # again: the CA is reused
    assert (d / "ca.pem").read_bytes() == ca and "reused" in capsys.readouterr().out


def test_certs_wants_out_and_nodes_or_nats(capsys, tmp_path):
    assert collector_main(["certs"]) == 2
    assert collector_main(["certs", "--out", str(tmp_path)]) == 2
    assert "--nats DIR" in capsys.readouterr().err


def test_tls_cert_and_key_come_together_and_missing_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"'nats.tls_cert' is set but 'nats.tls_key' is not"):
        _cfg(tmp_path, 'tls_cert = "/x/gw.pem"\n')
    with pytest.raises(ConfigError, match=r"'nats.tls_key' is set but 'nats.tls_cert' is not"):
        _cfg(tmp_path, 'tls_key = "/x/gw.key"\n')
    (tmp_path / "worker.pem").write_text("x")
    (tmp_path / "worker.key").write_text("x")
    cfg = _cfg(tmp_path, f'tls_cert = "{tmp_path}/{{role}}.pem"\ntls_key = "{tmp_path}/{{role}}.key"\n')
    files = role_files(cfg.nats, "worker")
    assert files["tls_cert"] == f"{tmp_path}/worker.pem" and files["tls_key"] == f"{tmp_path}/worker.key"
    with pytest.raises(ConfigError, match=rf"'nats.tls_cert' = '{tmp_path}/gateway.pem': no such file"):
        role_files(cfg.nats, "gateway")


def test_each_role_is_allowed_only_its_part(tmp_path):
    n = _cfg(tmp_path, "").nats
    perms = permissions(n)
    pub = {r: set(p["publish"]["allow"]) for r, p in perms.items()}
    assert "xpusense.*.*.*" in pub["gateway"] and not any(s.startswith("xpusense.") for r in ROLES if r != "gateway"
                                                          for s in pub[r])
    writes = {r: {s for s in pub[r] if s.startswith("$KV.")} for r in ROLES}
    assert writes == {"gateway": {"$KV.marks.>", "$KV.series.>"}, "worker": {"$KV.fleet.>", "$KV.leases.>"}, "scheduler": set(),
                      "exporter": set()}
    creators = {r for r in ROLES if any(".STREAM.CREATE." in s or ".STREAM.UPDATE." in s for s in pub[r])}
    assert creators == {"gateway"}
    assert not any(op in s for r in ROLES for s in pub[r] for op in (".DELETE.", ".PURGE.", ".STREAM.MSG.DELETE"))
    assert not any(s in (">", "$JS.API.>", "$KV.>") for r in ROLES for s in pub[r])
    for r in ROLES:   # replies only on its own inbox
        assert perms[r]["subscribe"]["allow"] == [f"_INBOX.{r}.>"]
    # a worker's durable consumers are denied to everyone else, who may otherwise make ephemerals
    assert "$JS.API.CONSUMER.MSG.NEXT.XPUSENSE_0.w-p0" in perms["scheduler"]["publish"]["deny"]
    assert "$JS.API.CONSUMER.MSG.NEXT.XPUSENSE_0.w-p0" not in perms["worker"]["publish"]["deny"]
    text = authorization_conf(n)
    assert "no_auth_user" not in text and text.count("{user: ") == len(ROLES)


def test_the_print_command_renders_a_configs_table(tmp_path, capsys):
    from xpusense.collector.cluster.nats_auth import main
    cfg = _cfg(tmp_path, "partitions = 30\nstreams = 5\n")
    assert main(["--config", str(tmp_path / "c.toml")]) == 0
    out = capsys.readouterr().out
    assert out == authorization_conf(cfg.nats) and "XPUSENSE_4.w-p29" in out
    (tmp_path / "bad.toml").write_text("[nats]\npartitions = 0\n")
    assert main(["--config", str(tmp_path / "bad.toml")]) == 2
    assert "nats.partitions" in capsys.readouterr().err
