"""Who may report to the collector, with real processes: mTLS with certificates from
`xpusense-collector certs`, per-node tokens from `xpusense-collector tokens`, and the plaintext rules.

A good agent streams; an agent whose certificate is from another CA, or who has none, is refused
in the TLS handshake; an agent whose certificate names node A but who claims node B is refused by
the collector, which logs the peer and the claimed id. Tokens: the right one is accepted, a wrong
one or another node's is refused and logged. Plaintext on a non-loopback listen address stops the
collector at start unless allowed (then it warns).
"""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers import BIN, FAST_HOST_ONLY, free_port, wait_until

FAST = FAST_HOST_ONLY


def run_cli(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "xpusense-collector"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def toml_table(keys: dict) -> str:
    return "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())


def start_collector(procs, tmp_path, top: dict, tls: dict | None = None, name="collector"):
    port = free_port()
    addr = f"127.0.0.1:{port}"
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(f'listen = "{addr}"\n' + toml_table(top) + (f"[tls]\n{toml_table(tls)}" if tls else ""))
    p = procs([str(BIN / "xpusense-collector"), "serve", "--config", str(cfg)], name)
    wait_until(lambda: p.p.poll() is None and "collector listening on" in p.output(), what="collector to listen")
    return addr, p


def start_agent(procs, tmp_path, addr, node_id, collector_keys: dict, name):
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(FAST + "[collector]\n" + toml_table(collector_keys))
    return procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--collector", addr,
                  "--node-id", node_id], name, env={"XPUSENSE_SPOOL_DIR": str(tmp_path / f"spool-{name}")})


def query(addr, *flags) -> dict:
    out = run_cli("nodes", "--collector", addr, "--format", "json", "--timeout-s", "3", *flags, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip())
    return {n["node_id"]: n for n in json.loads(out.stdout)["nodes"]}


def stored(addr, node_id, *flags) -> int:
    n = query(addr, *flags).get(node_id)
    return n["stored_up_to"] if n else 0


def keeps_storing(addr, node_id, *flags, rounds=3) -> None:
    """stored_up_to of `node_id` grows, `rounds` times in a row (waits on it, no fixed sleeps)."""
    last = wait_until(lambda: stored(addr, node_id, *flags), what=f"{node_id} to store batches")
    for _ in range(rounds):
        last = wait_until(lambda last=last: (v := stored(addr, node_id, *flags)) > last and v,
                          what=f"{node_id} to keep storing")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The fleet's certificates (made by the CLI) and a second CA's, for an impostor."""
    d = tmp_path_factory.mktemp("pki")
    fleet, other = d / "fleet", d / "other"
    made = run_cli("certs", "--out", fleet, "--nodes", "node-a,node-b", "--collector-host", "localhost",
                   "--collector-host", "127.0.0.1")
    assert made.returncode == 0, made.stderr
    assert "tls_cert" in made.stdout
    assert run_cli("certs", "--out", other, "--nodes", "node-c").returncode == 0
    for key in ("ca.key", "collector.key", "node-a.key", "node-b.key"):
        assert (fleet / key).stat().st_mode & 0o777 == 0o600
    return fleet, other


def node_keys(pki_dir, node):
    return {"tls_ca": str(pki_dir / "ca.pem"), "tls_cert": str(pki_dir / f"{node}.pem"),
            "tls_key": str(pki_dir / f"{node}.key")}


def test_mtls_good_agent_streams_impostors_are_refused_and_logged(procs, tmp_path, pki):
    fleet, other = pki
    addr, coll = start_collector(procs, tmp_path, {}, {"ca": str(fleet / "ca.pem"), "cert": str(fleet / "collector.pem"),
                                                       "key": str(fleet / "collector.key")})
    as_a = ("--tls-ca", fleet / "ca.pem", "--tls-cert", fleet / "node-a.pem", "--tls-key", fleet / "node-a.key")
    good = start_agent(procs, tmp_path, addr, "node-a", node_keys(fleet, "node-a"), "good")
    keeps_storing(addr, "node-a", *as_a)
    assert "mTLS" in coll.output()

    # node-a's certificate, claiming node-b: the collector refuses the stream and says so.
    liar = start_agent(procs, tmp_path, addr, "node-b", node_keys(fleet, "node-a"), "liar")
    wait_until(lambda: "PERMISSION_DENIED" in liar.output(), what="the liar to be refused")
    wait_until(lambda: "claiming node 'node-b'" in coll.output(), what="the refusal in the collector's log")
    line = next(x for x in coll.output().splitlines() if "claiming node 'node-b'" in x)
    assert "refused stream from ipv4:127.0.0.1:" in line and "certificate is for node 'node-a'" in line

    # A certificate from another CA, and no certificate at all: refused in the TLS handshake.
    foreign = start_agent(procs, tmp_path, addr, "node-c", node_keys(other, "node-c") | {"tls_ca": str(fleet / "ca.pem")},
                          "foreign")
    nocert = start_agent(procs, tmp_path, addr, "node-d", {"tls_ca": str(fleet / "ca.pem")}, "nocert")
    plain = start_agent(procs, tmp_path, addr, "node-e", {}, "plain")
    for p in (foreign, nocert, plain):
        wait_until(lambda p=p: "unreachable (UNAVAILABLE" in p.output(), what=f"{p.log_path.name} to be refused")
    # gRPC core logs each refused handshake with its reason on the collector's stderr (no hook in
    # grpcio lets the collector's own code see a handshake that never became a call).
    for reason in ("CERTIFICATE_VERIFY_FAILED", "PEER_DID_NOT_RETURN_A_CERTIFICATE"):
        wait_until(lambda reason=reason: any("Handshake failed" in x and reason in x for x in coll.output().splitlines()),
                   what=f"the refused handshake ({reason}) in the collector's log")
    # The query API needs a fleet certificate too.
    with pytest.raises(RuntimeError, match="UNAVAILABLE"):
        query(addr, "--tls-ca", fleet / "ca.pem")

    keeps_storing(addr, "node-a", *as_a)
    nodes = query(addr, *as_a)
    assert set(nodes) == {"node-a"}, f"an impostor got in: {sorted(nodes)}"
    assert good.p.poll() is None and coll.p.poll() is None


@pytest.mark.parametrize("transport", ["tls", "plaintext-loopback"])
def test_tokens_right_one_accepted_wrong_or_other_nodes_refused(procs, tmp_path, pki, transport):
    fleet, _ = pki
    toks = tmp_path / "tokens"
    made = run_cli("tokens", "--out", toks, "--nodes", "node-a,node-b")
    assert made.returncode == 0, made.stderr
    assert (toks / "node-a.token").stat().st_mode & 0o777 == 0o600
    tls = {"cert": str(fleet / "collector.pem"), "key": str(fleet / "collector.key")} if transport == "tls" else None
    addr, coll = start_collector(procs, tmp_path, {"tokens_file": str(toks / "tokens")}, tls)
    ca = {"tls_ca": str(fleet / "ca.pem")} if tls else {}
    flags = (("--tls-ca", fleet / "ca.pem") if tls else ()) + ("--token-file", toks / "node-a.token")

    start_agent(procs, tmp_path, addr, "node-a", ca | {"token_file": str(toks / "node-a.token")}, "good")
    keeps_storing(addr, "node-a", *flags)

    bad = tmp_path / "bad.token"
    bad.write_text("not-the-token\n")
    wrong = start_agent(procs, tmp_path, addr, "node-x", ca | {"token_file": str(bad)}, "wrong")
    other = start_agent(procs, tmp_path, addr, "node-a", ca | {"token_file": str(toks / "node-b.token")}, "other")
    wait_until(lambda: "UNAUTHENTICATED" in wrong.output(), what="the wrong token to be refused")
    wait_until(lambda: "PERMISSION_DENIED" in other.output(), what="node-b's token claiming node-a to be refused")
    log = wait_until(lambda: (o := coll.output()) and "claiming node 'node-x': invalid token" in o and o,
                     what="the refusals in the collector's log")
    assert "claiming node 'node-a': the token is not the one of node 'node-a'" in log

    # The query API wants a token of the fleet.
    with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
        query(addr, *(("--tls-ca", fleet / "ca.pem") if tls else ()))
    keeps_storing(addr, "node-a", *flags)
    assert set(query(addr, *flags)) == {"node-a"}


def test_plaintext_on_a_non_loopback_address_needs_allow_insecure(procs, tmp_path):
    port = free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'listen = "0.0.0.0:{port}"\n')
    out = subprocess.run([str(BIN / "xpusense-collector"), "serve", "--config", str(cfg)], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 2
    err = out.stderr.strip()
    assert len(err.splitlines()) == 1 and "allow_insecure" in err and "[tls]" in err and "0.0.0.0" in err

    cfg.write_text(f'listen = "0.0.0.0:{port}"\nallow_insecure = true\n')
    p = procs([str(BIN / "xpusense-collector"), "serve", "--config", str(cfg)], "collector")
    wait_until(lambda: "collector listening on" in p.output(), what="the collector to start")
    assert p.output().count("PLAINTEXT on non-loopback address") == 1

    # The agent has the same rule for where it sends (it exits before connecting).
    acfg = tmp_path / "a.toml"
    acfg.write_text(FAST)
    out = subprocess.run([str(BIN / "xpusense-agent"), "run", "--config", str(acfg), "--collector",
                          "192.0.2.1:7470", "--once"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "collector.insecure" in out.stderr and "collector.tls_ca" in out.stderr


def test_bad_security_config_names_the_key(tmp_path, pki):
    fleet, _ = pki
    cases = [
        ('[tls]\ncert = "%s"\n' % (fleet / "collector.pem"), "tls.key"),
        ('[tls]\nca = "%s"\n' % (fleet / "ca.pem"), "tls.cert"),
        ('[tls]\ncert = "/nonexistent.pem"\nkey = "/nonexistent.key"\n', "tls.cert"),
        ('tokens_file = "%s"\n' % (fleet / "ca.pem"), "tokens_file"),
    ]
    for body, key in cases:
        cfg = tmp_path / "c.toml"
        cfg.write_text(f'listen = "127.0.0.1:{free_port()}"\n' + body)
        out = subprocess.run([str(BIN / "xpusense-collector"), "serve", "--config", str(cfg)], capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 2 and key in out.stderr, (body, out.stderr)
