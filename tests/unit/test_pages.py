"""The pages a newcomer reads: README.md within 16 kB, no line over 400 characters, every relative
link resolving inside the repository (a #anchor to a heading), docs/figures.md as generated."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
MAX_README_BYTES = 16_000
MAX_LINE = 400

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = CODE.sub("", FENCE.sub("", page.read_text()))
    return [m.group(1) for m in LINK.finditer(text)]


def test_readme_within_16_kb():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes, over {MAX_README_BYTES}"


@pytest.mark.parametrize("page", PAGES, ids=ids(PAGES))
def test_no_line_over_400_characters(page):
    long = [(n, len(line)) for n, line in enumerate(page.read_text().splitlines(), 1) if len(line) > MAX_LINE]
    assert not long, f"{page.relative_to(ROOT)}: lines over {MAX_LINE} characters (line, length): {long[:10]}"


@pytest.mark.parametrize("page", PAGES, ids=ids(PAGES))
def test_relative_links_resolve_inside_the_repository(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):   # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(ROOT) or not dest.exists():
            broken.append(f"{target} (no such file in the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_slug_matches_github():
    assert slug("eBPF tcp_rtt against ss -ti") == "ebpf-tcp_rtt-against-ss--ti"
    assert slug("Collector, 2,000 agents at 1 s") == "collector-2000-agents-at-1-s"
    assert slug("`xpusense-agent` and [the docs](docs/x.md)") == "xpusense-agent-and-the-docs"


def test_figures_page_is_what_the_generator_writes():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "figures.py"), "--check"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr or r.stdout


def test_readme_layout_names_every_module():
    """README's Layout block lists each package folder's modules by name: none missing, none gone."""
    block = re.search(r"^## Layout\n.*?^```\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    assert block, "README.md has no Layout code block"
    listed: dict[str, set[str]] = {}
    folder = ""
    for line in block.group(1).splitlines():
        m = re.match(r"(\S+/)\s+(.*)", line)
        if m:
            folder = m.group(1)
            words = m.group(2).rpartition(": ")[2]   # "what the folder is: module module ..."
        elif line.startswith(" ") and folder:
            words = line
        else:
            continue
        listed.setdefault(folder, set()).update(words.split())
    wrong = []
    for folder in ("agent/", "agent/spool/", "client/", "collector/", "collector/store/", "collector/scheduler/",
                   "collector/cluster/"):
        have = {p.stem for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"}
        assert folder in listed, f"README Layout has no row for {folder}"
        missing = have - listed[folder]
        if missing:
            wrong.append(f"{folder}: not listed {sorted(missing)}")
        gone = {w for w in listed[folder] if w not in have and not w.endswith(".c")}
        if gone:
            wrong.append(f"{folder}: listed but no such module {sorted(gone)}")
    assert not wrong, "; ".join(wrong)
