"""Every metric name the agent and the collector share (common/metric_names.py) is documented."""

import pathlib

import pytest

from xpusense.common import metric_names

DOC = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text(encoding="utf-8")
NAMES = {k: v for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)}


def documented_names(doc: str) -> set[str]:
    """First cells of the tables; `a.b.c / d` and `a.b.1m / .5m` name siblings of the first."""
    out = set()
    for line in doc.splitlines():
        if not line.startswith("| ") or line.startswith("| ---"):
            continue
        first, *others = line.split("|")[1].strip().split(" / ")
        out.add(first)
        stem = first.rsplit(".", 1)[0]
        out.update(stem + (o if o.startswith(".") else "." + o) for o in others)
    return out


DOCUMENTED = documented_names(DOC)


def test_the_module_holds_the_contract_names():
    assert NAMES["HBM_BANDWIDTH_UTILIZATION"] == "xpusense.accelerator.hbm.bandwidth.utilization"
    assert len(NAMES) >= 20


def test_sibling_rows_are_expanded():
    assert documented_names("| a.b.load.1m / .5m | x |\n| a.remap_pending / remap_failed | y |") == {
        "a.b.load.1m", "a.b.load.5m", "a.remap_pending", "a.remap_failed"}


@pytest.mark.parametrize("name", sorted(NAMES.values()))
def test_documented_in_docs_metrics(name):
    assert name in DOCUMENTED, f"{name} is not a row of docs/metrics.md"
