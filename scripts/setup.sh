#!/usr/bin/env bash
# All set-up on a fresh Debian machine, as root; idempotent and quick when already done.
#   Debian packages (compiler for the test fakes and the C reader's sanitizer build: gcc brings
#   libasan and libubsan; libnghttp2-dev for the benches' C load
#   generator, iproute2 for network namespaces, prometheus and systemd for the export and unit
#   tests, bcc and kernel headers via setup-ebpf.sh), the virtualenv in .venv with xpusense and
#   its test tools, and bcc linked into that virtualenv.
# Env: PYTHON (default python3), XPUSENSE_SKIP_EBPF=1 to leave out the eBPF set-up.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export DEBIAN_FRONTEND=noninteractive
log() { echo "setup: $*"; }

need=()
# prometheus: the Prometheus e2e test's real server; systemd: `systemd-analyze verify` of the units;
# systemd-container + debootstrap: the units under a live systemd (tests/privileged/test_systemd_units.py).
for p in python3-venv python3-dev gcc libc6-dev libnghttp2-dev zlib1g-dev iproute2 procps prometheus systemd systemd-container debootstrap; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || need+=("$p")
done
# prometheus-node-exporter and bpftrace: the peers bench/footprint.py measures the agent against (it
# starts its own node_exporter on a loopback port; on a host booted with systemd the package's own
# service starts too, on :9100).
for p in prometheus-node-exporter bpftrace; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "setup: missing Debian packages ${need[*]}; run this script as root" >&2; exit 1
    fi
    log "apt-get install ${need[*]}"
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

if [ "${XPUSENSE_SKIP_EBPF:-0}" != 1 ] && [ "$(id -u)" = 0 ]; then
    scripts/setup-ebpf.sh
fi

py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    log "creating .venv with $($py --version 2>&1)"
    "$py" -m venv .venv
fi
stamp=.venv/.xpusense-installed
# Installed again when pyproject.toml or the C reader changes, or the reader was not built here (a
# fresh checkout beside an existing .venv: the editable install builds them into collector/ and common/).
want=$(cat pyproject.toml collector/_wire_rows.c common/_compact.c | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c 'import xpusense.collector._wire_rows, xpusense.common._compact' 2>/dev/null; then
    log "installing xpusense and its test tools into .venv"
    .venv/bin/pip install -q --disable-pip-version-check -e '.[dev]'
    echo "$want" > "$stamp"
fi

# bcc is not on PyPI (the PyPI "bcc" is another project): link Debian's pure-Python module in,
# and only it, so no other Debian package leaks into the virtualenv.
if [ -d /usr/lib/python3/dist-packages/bcc ]; then
    sp=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    ln -sfn /usr/lib/python3/dist-packages/bcc "$sp/bcc"
fi
.venv/bin/python -c 'import xpusense.collector._wire_rows' 2>/dev/null \
    || log "warning: the collector's C reader of batches (collector/_wire_rows.c) was not built (no C compiler?): ingest reads them through protobuf, slower"
.venv/bin/python -c 'import xpusense.common._compact' 2>/dev/null \
    || log "warning: the compact encoding's C reader (common/_compact.c) was not built (no C compiler or zlib1g-dev?): columns are read in Python, slower"
log "ready: $(.venv/bin/python --version), xpusense $(.venv/bin/python -c 'import xpusense; print(xpusense.__version__)')"
