#!/usr/bin/env bash
# Set up everything (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/setup.sh
exec .venv/bin/python -m pytest -ra "$@"
