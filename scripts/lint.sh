#!/usr/bin/env bash
# Lint and type-check: ruff (pyflakes, pycodestyle, import order, bugbear, complexity, pyupgrade) and
# mypy, as configured in pyproject.toml, with the versions pinned in its `dev` extra. Needs no
# Debian package: it uses .venv when scripts/setup.sh made one, else makes .venv-lint with pip.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ -x .venv/bin/ruff ] && [ -x .venv/bin/mypy ]; then
    bin=.venv/bin
else
    [ -x .venv-lint/bin/python ] || "${PYTHON:-python3}" -m venv .venv-lint
    .venv-lint/bin/pip install -q --disable-pip-version-check -e '.[dev]'
    bin=.venv-lint/bin
fi
echo "lint: ruff $($bin/ruff --version | cut -d' ' -f2)"
$bin/ruff check .
echo "lint: mypy $($bin/mypy --version | cut -d' ' -f2)"
$bin/mypy
