"""Bad config, a port in use, an address that does not resolve: one line that says what to fix."""

from __future__ import annotations

import socket
import subprocess

import pytest
from helpers import BIN, free_port


def run(*args, timeout=30):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)


def one_line_error(p, rc):
    assert p.returncode == rc, (p.returncode, p.stdout, p.stderr)
    err = p.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("text,key", [
    ("[tiers]\nrealtime = 1\n", "tiers.realtime"),
    ("[tiers]\nrealtime_s = -1\n", "tiers.realtime_s"),
    ("[tiers]\nnearline_s = true\n", "tiers.nearline_s"),
    ("[collector]\naddress = \"nohostport\"\n", "collector.address"),
    ("[sources.host]\nenabled = \"yes\"\n", "sources.host.enabled"),
    ("colector = 1\n", "colector"),
])
def test_agent_bad_config_key_exits_2_naming_key_and_file(tmp_path, text, key):
    cfg = tmp_path / "agent.toml"
    cfg.write_text(text)
    err = one_line_error(run(BIN / "xpusense-agent", "run", "--config", cfg), 2)
    assert f"'{key}'" in err and str(cfg) in err


def test_agent_config_not_toml(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text("[tiers\n")
    err = one_line_error(run(BIN / "xpusense-agent", "sources", "--config", cfg), 2)
    assert "not valid TOML" in err and str(cfg) in err


def test_collector_bad_config_key(tmp_path):
    cfg = tmp_path / "collector.toml"
    cfg.write_text("history_s = \"long\"\n")
    err = one_line_error(run(BIN / "xpusense-collector", "serve", "--config", cfg), 2)
    assert "'history_s'" in err and str(cfg) in err


def test_collector_port_in_use_exits_1():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = one_line_error(run(BIN / "xpusense-collector", "serve", "--listen", f"127.0.0.1:{port}"), 1)
    assert f"127.0.0.1:{port}" in err and "--listen" in err


def test_agent_collector_address_does_not_resolve_exits_2():
    err = one_line_error(run(BIN / "xpusense-agent", "run", "--collector", "no-such-host.invalid:7470"), 2)
    assert "no-such-host.invalid" in err and "does not resolve" in err


def test_nodes_with_no_collector_exits_1():
    err = one_line_error(run(BIN / "xpusense-collector", "nodes", "--collector", f"127.0.0.1:{free_port()}",
                             "--timeout-s", "1"), 1)
    assert "cannot reach the collector" in err


def test_env_override_is_checked_too(tmp_path):
    p = subprocess.run([str(BIN / "xpusense-agent"), "run", "--once"], capture_output=True, text=True, timeout=30,
                       env={"PATH": "/usr/bin:/bin", "XPUSENSE_COLLECTOR": "bad"})
    err = one_line_error(p, 2)
    assert "XPUSENSE_COLLECTOR" in err and "'collector.address'" in err
