"""The generated code in proto/ is what scripts/gen-proto.sh makes from the .proto files now."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT


def test_generated_code_is_not_stale(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts/gen-proto.sh"), str(tmp_path)], check=True,
                   env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert made, "gen-proto.sh produced nothing"
    for rel in made:
        committed = ROOT / "proto" / rel
        assert committed.exists(), f"{rel} is not committed: run scripts/gen-proto.sh"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), \
            f"proto/{rel} is stale: run scripts/gen-proto.sh and commit the result"
