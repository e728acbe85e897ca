#!/usr/bin/env bash
# Set up everything (scripts/setup.sh), start a local collector and this host's agent, and show
# the live fleet view (`xpusense-collector top`). Ctrl-C stops all three.
# Env: XPUSENSE_LISTEN (default 127.0.0.1:7470), extra arguments go to `xpusense-agent run`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/setup.sh
addr=${XPUSENSE_LISTEN:-127.0.0.1:7470}
logs=$(mktemp -d /tmp/xpusense-demo.XXXXXX)
.venv/bin/xpusense-collector serve --listen "$addr" --data-dir "$logs/collector-data" >"$logs/collector.log" 2>&1 &
cpid=$!
.venv/bin/xpusense-agent run --collector "$addr" "$@" >"$logs/agent.log" 2>&1 &
apid=$!
trap 'kill $apid $cpid 2>/dev/null; wait $apid $cpid 2>/dev/null; echo "logs: $logs"' EXIT
# Wait for the collector to answer (a condition with a deadline, not a fixed sleep).
for _ in $(seq 50); do
    .venv/bin/xpusense-collector nodes --collector "$addr" --timeout-s 0.2 >/dev/null 2>&1 && break
    kill -0 $cpid 2>/dev/null || { cat "$logs/collector.log" >&2; exit 1; }
    sleep 0.1
done
.venv/bin/xpusense-collector top --collector "$addr"
