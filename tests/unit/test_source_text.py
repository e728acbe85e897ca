"""Prose in the source stays reference: module docstrings of a few lines, and no tracker numbers of
this project's own work in code, tests, scripts or docs (the history of the work is in git)."""

from __future__ import annotations

import ast
import re

from helpers import ROOT

DOCSTRING_DIRS = ("agent", "collector", "common", "client", "probes", "bench")
MAX_DOCSTRING_LINES = 10

TEXT_DIRS = ("agent", "collector", "common", "client", "probes", "bench", "tests", "scripts", "docs",
             "examples", "deploy", "systemd", "proto")
TEXT_FILES = ("README.md", "CONTRIBUTING.md", "Dockerfile", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".pyi", ".c", ".h", ".sh", ".md", ".proto", ".toml", ".yaml", ".service", ".conf"}
SKIP_PARTS = {"__pycache__", "build", "results"}   # build outputs; bench/results holds measured data
# Other projects' trackers may be cited by number: "DCGM issue 310", "nvitop issues 75 and 88".
OTHER_PROJECTS = ("DCGM", "nvitop")
TRACKER_NUMBER = re.compile(r"\bissues?\s+#?\d", re.IGNORECASE)
CITED_PROJECT = re.compile(r"\b(?:" + "|".join(OTHER_PROJECTS) + r")\s+$", re.IGNORECASE)


def _python_modules():
    for folder in DOCSTRING_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "_pb2" not in path.name and not SKIP_PARTS.intersection(path.parts):
                yield path


def _text_files():
    for name in TEXT_FILES:
        if (ROOT / name).is_file():
            yield ROOT / name
    for folder in TEXT_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in TEXT_SUFFIXES and path.is_file() and "_pb2" not in path.name \
                    and not SKIP_PARTS.intersection(path.relative_to(ROOT).parts):
                yield path


def tracker_numbers(text: str) -> list[str]:
    """Each `issue N` in `text` not cited as another project's (OTHER_PROJECTS), as its line."""
    found = []
    for m in TRACKER_NUMBER.finditer(text):
        if not CITED_PROJECT.search(text[max(0, m.start() - 40):m.start()]):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{line}: {text.splitlines()[line - 1].strip()[:120]}")
    return found


def test_module_docstrings_are_a_few_lines():
    long = []
    for path in _python_modules():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if doc and len(doc.splitlines()) > MAX_DOCSTRING_LINES:
            long.append(f"{path.relative_to(ROOT)}: {len(doc.splitlines())} lines")
    assert not long, f"module docstrings over {MAX_DOCSTRING_LINES} lines (detail belongs in docs/ or " \
                     "beside the code):\n" + "\n".join(long)


def test_no_tracker_numbers_of_this_project():
    found = []
    for path in _text_files():
        found += [f"{path.relative_to(ROOT)}:{hit}" for hit in tracker_numbers(path.read_text(encoding="utf-8"))]
    assert not found, "this project's issue numbers (history of the work belongs in git):\n" + "\n".join(found)


def test_tracker_numbers_of_other_projects_are_allowed():
    assert tracker_numbers("as DCGM issue 310 says; nvitop issues 75 and 88") == []
    n = 16   # written as a field, so that this file passes its own scan
    assert tracker_numbers(f"Fixed in issue {n} item 6.\nsee Issues #{n}") == [f"1: Fixed in issue {n} item 6.",
                                                                               f"2: see Issues #{n}"]
