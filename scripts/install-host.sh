#!/usr/bin/env bash
# Install (or upgrade) xpusense on a host run by systemd, as README "Install on a host" says; run
# as root from a checkout (the units come from its systemd/ folder). Run again to upgrade: the
# virtualenv is upgraded in place, configs in /etc/xpusense are kept, the units are replaced and
# restarted (spool and collector store stay in /var/lib). tests/privileged/test_systemd_units.py
# runs this script, unchanged, inside a Debian container booted with systemd-nspawn.
#
#   scripts/install-host.sh [--wheel FILE] [--collector] [--no-agent] [--least-privilege]
#                           [--collector-address HOST:PORT] [--listen HOST:PORT]
#                           [--agent-set KEY=VALUE ...] [--no-start]
#
#   --wheel FILE          install this wheel (`python3 -m build` makes one in dist/); default: this
#                         checkout, built by pip
#   --collector           also install and start the collector unit (on the collector's host)
#   --no-agent            no agent unit (a collector-only host)
#   --least-privilege     the agent as system user `xpusense` with only the capabilities of
#                         docs/security.md (drop-in systemd/xpusense-agent-least-privilege.conf)
#   --collector-address   where the agent streams (agent.toml [collector] address; 127.0.0.1:7470)
#   --listen              where the collector listens (collector.toml listen; 127.0.0.1:7470)
#   --agent-set KEY=VALUE one more agent.toml key, dotted, the value in TOML (repeatable):
#                         --agent-set sources.ebpf.enabled=false --agent-set tiers.nearline_s=5.0
#   --no-start            install and enable, but start nothing
#
# Configs are written only when absent (an operator's edits are never overwritten). Needs Python
# >= 3.11 with venv (Debian: python3-venv) and pip access to PyPI (or PIP_INDEX_URL/PIP_FIND_LINKS
# for an offline host). bcc is not on PyPI: for the eBPF probes install Debian's python3-bpfcc
# and the kernel headers, then see scripts/setup.sh for the link into the virtualenv.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=/opt/xpusense          # fixed: the units' ExecStart= name /opt/xpusense/venv/bin
ETC=/etc/xpusense
UNITS=/etc/systemd/system
log() { echo "install-host: $*"; }
die() { echo "install-host: $*" >&2; exit 2; }

wheel="" collector=0 agent=1 least=0 start=1
address=127.0.0.1:7470 listen=127.0.0.1:7470
agent_set=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheel) wheel=$(realpath "${2:?--wheel needs a file}"); shift ;;
        --collector) collector=1 ;;
        --no-agent) agent=0 ;;
        --least-privilege) least=1 ;;
        --collector-address) address=${2:?--collector-address needs HOST:PORT}; shift ;;
        --listen) listen=${2:?--listen needs HOST:PORT}; shift ;;
        --agent-set) agent_set+=("${2:?--agent-set needs KEY=VALUE}"); shift ;;
        --no-start) start=0 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (--help lists them)" ;;
    esac
    shift
done

[ "$(id -u)" = 0 ] || die "run as root (it writes $PREFIX, $ETC and $UNITS)"
[ -d /run/systemd/system ] || die "systemd is not running here (no /run/systemd/system): on Kubernetes use deploy/ (docs/deploy.md)"
[ -z "$wheel" ] || [ -f "$wheel" ] || die "--wheel $wheel: no such file"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
    || die "needs python3 >= 3.11 (Debian 12: apt-get install python3 python3-venv)"
python3 -c 'import ensurepip, venv' 2>/dev/null || die "python3 has no venv module: apt-get install python3-venv"
for u in "$root"/systemd/xpusense-agent.service "$root"/systemd/xpusense-collector.service; do
    [ -f "$u" ] || die "$u missing: run this script from an xpusense checkout"
done

# 1. The virtualenv, with the wheel (or this checkout) and its dependencies from PyPI.
if [ ! -x "$PREFIX/venv/bin/python" ]; then
    log "creating $PREFIX/venv"
    mkdir -p "$PREFIX"
    python3 -m venv "$PREFIX/venv"
fi
before=$("$PREFIX/venv/bin/python" -c 'import importlib.metadata as m; print(m.version("xpusense"))' 2>/dev/null || echo none)
log "installing ${wheel:-$root} into $PREFIX/venv (xpusense $before before)"
"$PREFIX/venv/bin/pip" install --quiet --disable-pip-version-check --upgrade "${wheel:-$root}"
after=$("$PREFIX/venv/bin/python" -c 'import importlib.metadata as m; print(m.version("xpusense"))')
install -m 0644 "$root/README.md" "$PREFIX/README.md"   # the units' Documentation=
[ ! -f "$root/docs/deploy.md" ] || install -m 0644 "$root/docs/deploy.md" "$PREFIX/deploy.md"

# 2. Configs, only where absent.
mkdir -p "$ETC"
if [ "$agent" = 1 ]; then
    if [ -f "$ETC/agent.toml" ]; then
        log "keeping $ETC/agent.toml$([ ${#agent_set[@]} = 0 ] || echo ' (--agent-set ignored: edit the file)')"
    else
        {
            echo "# Written by scripts/install-host.sh; every key and its default: examples/agent.toml."
            printf '[collector]\naddress = "%s"\n' "$address"
            declare -A tables=()
            order=()
            for kv in "${agent_set[@]}"; do
                key=${kv%%=*} value=${kv#*=}
                [ "$key" != "$kv" ] && [ -n "$value" ] || die "--agent-set $kv: give KEY=VALUE"
                table=${key%.*} name=${key##*.}
                [ "$table" != "$key" ] || table=""
                [ -n "${tables[$table]+x}" ] || order+=("$table")
                tables[$table]+="$name = $value"$'\n'
            done
            for table in "${order[@]}"; do
                [ -z "$table" ] || printf '[%s]\n' "$table"
                printf '%s' "${tables[$table]}"
            done
        } > "$ETC/agent.toml.new"
        mv "$ETC/agent.toml.new" "$ETC/agent.toml"
        log "wrote $ETC/agent.toml"
    fi
fi
if [ "$collector" = 1 ]; then
    if [ -f "$ETC/collector.toml" ]; then
        log "keeping $ETC/collector.toml"
    else
        printf '# Written by scripts/install-host.sh; every key and its default: examples/collector.toml.\nlisten = "%s"\n' \
            "$listen" > "$ETC/collector.toml"
        log "wrote $ETC/collector.toml"
    fi
fi

# 3. Units (and the least-privilege drop-in), then (re)start what is installed.
units=()
if [ "$agent" = 1 ]; then
    install -m 0644 "$root/systemd/xpusense-agent.service" "$UNITS/xpusense-agent.service"
    units+=(xpusense-agent.service)
    if [ "$least" = 1 ]; then
        getent group xpusense > /dev/null || groupadd --system xpusense
        getent passwd xpusense > /dev/null || useradd --system --gid xpusense --no-create-home \
            --home-dir /nonexistent --shell /usr/sbin/nologin xpusense
        getent group video > /dev/null || groupadd --system video   # SupplementaryGroups= of the drop-in
        mkdir -p "$UNITS/xpusense-agent.service.d"
        install -m 0644 "$root/systemd/xpusense-agent-least-privilege.conf" \
            "$UNITS/xpusense-agent.service.d/least-privilege.conf"
        log "agent runs as user xpusense (drop-in $UNITS/xpusense-agent.service.d/least-privilege.conf)"
    elif [ -f "$UNITS/xpusense-agent.service.d/least-privilege.conf" ]; then
        install -m 0644 "$root/systemd/xpusense-agent-least-privilege.conf" \
            "$UNITS/xpusense-agent.service.d/least-privilege.conf"   # an upgrade keeps it, updated
    fi
fi
if [ "$collector" = 1 ]; then
    install -m 0644 "$root/systemd/xpusense-collector.service" "$UNITS/xpusense-collector.service"
    units=(xpusense-collector.service "${units[@]}")   # the collector first: the agent streams to it
fi
[ ${#units[@]} -gt 0 ] || die "nothing to install (--no-agent without --collector)"
# The checkpoint request dir of a running agent (RuntimeDirectoryPreserve= keeps it): as the unit
# makes it, 1777 (jobs add their done files; only a file's owner may rename it).
if [ "$agent" = 1 ] && [ -d /run/xpusense/checkpoint ] && [ ! -L /run/xpusense/checkpoint ]; then
    chmod 1777 /run/xpusense/checkpoint
fi
systemctl daemon-reload
systemctl enable --quiet "${units[@]}"
if [ "$start" = 1 ]; then
    for u in "${units[@]}"; do
        if systemctl is-active --quiet "$u"; then
            log "restarting $u"; systemctl restart "$u"
        else
            log "starting $u"; systemctl start "$u"
        fi
    done
fi
log "xpusense $after installed ($before before); units: ${units[*]}"
log "check: systemctl status ${units[*]}; journalctl -u xpusense-agent -p warning; $PREFIX/venv/bin/xpusense-agent sources"
