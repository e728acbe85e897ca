"""No shell anywhere: every external command is an argv list (hostile input).

Parses every Python file under agent/, collector/, probes/ and client/ and fails on `shell=True`
(or any non-literal-False `shell=`), on os.system/os.popen/subprocess.getoutput/getstatusoutput/
asyncio.create_subprocess_shell, and on subprocess calls whose command is a string."""

from __future__ import annotations

import ast

from helpers import ROOT

DIRS = ("agent", "collector", "probes", "client")
SHELL_CALLS = {("os", "system"), ("os", "popen"), ("subprocess", "getoutput"), ("subprocess", "getstatusoutput"),
               ("asyncio", "create_subprocess_shell")}
SUBPROCESS = {"run", "Popen", "call", "check_call", "check_output"}


def _dotted(node: ast.AST) -> tuple[str, ...]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return tuple(reversed(parts))


def _is_string(node: ast.AST) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, str)) or isinstance(node, ast.JoinedStr) \
        or (isinstance(node, ast.BinOp) and (_is_string(node.left) or _is_string(node.right)))


def shell_uses(source: str, filename: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        where = f"{filename}:{node.lineno}"
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                found.append(f"{where}: shell={ast.unparse(kw.value)}")
        if name[-2:] in SHELL_CALLS:
            found.append(f"{where}: {'.'.join(name)}() runs a shell")
        if len(name) >= 1 and name[-1] in SUBPROCESS and (len(name) == 1 or name[-2] == "subprocess"):
            if node.args and _is_string(node.args[0]):
                found.append(f"{where}: {'.'.join(name)}() with a command string, not an argv list")
    return found


def test_the_checker_catches_what_it_should():
    bad = ("import subprocess, os\nsubprocess.run('ls', shell=True)\nsubprocess.Popen(f'x {y}')\n"
           "os.system('ls')\nsubprocess.check_output(cmd, shell=flag)\n")
    assert len(shell_uses(bad, "bad.py")) == 5
    good = "import subprocess\nsubprocess.run(['ls', '-l'], shell=False)\nsubprocess.Popen([exe, *args])\n"
    assert shell_uses(good, "good.py") == []


def test_no_shell_in_the_project():
    files = [p for d in DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 10
    found = [hit for p in files for hit in shell_uses(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "commands must run with an argv list, never through a shell:\n" + "\n".join(found)
