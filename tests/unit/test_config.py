from __future__ import annotations

import pytest

from xpusense.agent.config import ConfigError, load_agent
from xpusense.collector.config import load_collector


def write(tmp_path, text, name="agent.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_defaults_stream_to_loopback_default_port():
    cfg = load_agent(None, env={})
    assert cfg.collector.address == "127.0.0.1:7470"
    assert (cfg.tiers.realtime_s, cfg.tiers.nearline_s, cfg.tiers.offline_s) == (1.0, 15.0, 300.0)
    assert cfg.node_id  # the host name


def test_file_then_env_then_flags(tmp_path):
    path = write(tmp_path, 'node_id = "from-file"\n[collector]\naddress = "file:1"\n[tiers]\nrealtime_s = 0.5\n')
    cfg = load_agent(path, env={})
    assert (cfg.node_id, cfg.collector.address, cfg.tiers.realtime_s, cfg.tiers.nearline_s) == ("from-file", "file:1", 0.5, 15.0)
    cfg = load_agent(path, env={"XPUSENSE_COLLECTOR": "env:2"})
    assert cfg.collector.address == "env:2"
    cfg = load_agent(path, {"collector.address": "flag:3", "node_id": None}, env={"XPUSENSE_COLLECTOR": "env:2"})
    assert (cfg.collector.address, cfg.node_id) == ("flag:3", "from-file")


def test_labels_are_a_free_table(tmp_path):
    cfg = load_agent(write(tmp_path, '[labels]\ncloud = "aws"\nprice = 2.5\n'), env={})
    assert cfg.labels == {"cloud": "aws", "price": "2.5"}


@pytest.mark.parametrize("text,needle", [
    ("[tiers]\nrealtim_s = 1\n", "unknown key 'tiers.realtim_s'"),
    ("[tiers]\nrealtime_s = 0\n", "'tiers.realtime_s' must be between 0.1 and 86400"),
    ("[tiers]\nrealtime_s = 1e-300\n", "'tiers.realtime_s' must be between 0.1 and 86400"),
    ("[tiers]\nnearline_s = inf\n", "'tiers.nearline_s' must be a finite number"),
    ("[tiers]\noffline_s = nan\n", "'tiers.offline_s' must be a finite number"),
    ("[tiers]\noffline_s = 1e26\n", "'tiers.offline_s' must be between 0.1 and 86400"),
    ("[stream]\nflush_s = inf\n", "'stream.flush_s' must be a finite number"),
    ('node_id = "a\\nb"\n', "'node_id' node id 'a\\nb' has spaces or control characters"),
    ('node_id = "has space"\n', "'node_id' node id 'has space' has spaces"),
    ("x = " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    ("[tiers]\nrealtime_s = false\n", "'tiers.realtime_s' must be int or float"),
    ("[stream]\nqueue_batches = 1.5\n", "'stream.queue_batches' must be int"),
    ("tiers = 3\n", "'tiers' must be a table"),
    ("[labels]\nzone = [1]\n", "'labels' must be a table of strings"),
    ("log_level = \"loud\"\n", "'log_level' must be debug, info, warning or error"),
    ("[collector]\naddress = \"host:99999\"\n", "'collector.address'"),
])
def test_bad_keys_name_the_key_and_the_file(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_agent(path, env={})
    assert needle in str(e.value) and path in str(e.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_agent(str(tmp_path / "nope.toml"), env={})


def test_collector_schema(tmp_path):
    cfg = load_collector(write(tmp_path, 'history_s = 60\nlisten = "0.0.0.0:9000"\n', "c.toml"), env={})
    assert (cfg.history_s, cfg.listen, cfg.stale_s) == (60, "0.0.0.0:9000", 10.0)
    with pytest.raises(ConfigError, match="unknown key 'history'"):
        load_collector(write(tmp_path, "history = 1\n", "d.toml"), env={})


def test_hbm_watch_rules_per_vendor(tmp_path):
    from xpusense.agent.daemon import watch_rules
    cfg = load_agent(write(tmp_path, "[hbm_watch]\nwindow_s = 3\n[hbm_watch.vendor.nvidia]\nthreshold = 0.8\n"), env={})
    rules = watch_rules(cfg.hbm_watch)
    assert (rules["nvidia"].threshold, rules["nvidia"].window_s, rules["nvidia"].low_mark) == (0.8, 3, 0.75)
    assert (rules["huawei"].threshold, rules["default"].threshold) == (0.85, 0.85)


@pytest.mark.parametrize("text,needle", [
    ("[hbm_watch]\nactions = [\"signal\", \"email\"]\n", "'hbm_watch.actions' must be signal, file, event (not 'email')"),
    ("[hbm_watch]\nsignal = \"USR1\"\n", "'hbm_watch.signal' must be a signal name"),
    ("[hbm_watch]\nthreshold = 85\n", "'hbm_watch.threshold' must be between 0 and 1"),
    ("[hbm_watch.vendor.huawei]\nlow_mark = 0.9\n", "'hbm_watch.vendor.huawei.low_mark' (0.9) must not be above the threshold"),
])
def test_hbm_watch_bad_values(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_agent(path, env={})
    assert needle in str(e.value) and path in str(e.value)
