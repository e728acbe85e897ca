"""The example configs are valid, and say the defaults."""

from __future__ import annotations

from helpers import ROOT

from xpusense.agent.config import load_agent
from xpusense.collector.config import load_collector


def test_example_agent_config_is_the_defaults():
    assert vars(load_agent(str(ROOT / "examples/agent.toml"), env={})) == vars(load_agent(None, env={}))


def test_example_collector_config_is_the_defaults():
    assert load_collector(str(ROOT / "examples/collector.toml"), env={}) == load_collector(None, env={})
