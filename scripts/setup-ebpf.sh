#!/usr/bin/env bash
# setup-ebpf.sh - make bcc usable for tracepoint programs on a Debian 12 host.
#
#   sudo scripts/setup-ebpf.sh [--strict]
#
# Idempotent. Steps:
#   1. apt-get installs python3-bpfcc, bpfcc-tools, libbpfcc and kernel headers.
#      Headers for the running kernel are used when the distribution has them;
#      otherwise (custom kernels such as the CI one) Debian's generic headers are
#      installed and linked to /lib/modules/$(uname -r)/{build,source}, with a
#      WARNING (fine for tracepoints/uprobes, not for code reading kernel structs).
#   2. mounts tracefs at /sys/kernel/tracing and debugfs at /sys/kernel/debug.
#   3. self-check: loads a bcc program on tracepoint sched:sched_switch and
#      checks that it counted events.
#
# Exit status: 0 on success. On failure it prints "ebpf: UNAVAILABLE (reason)"
# and exits 1 with --strict, 0 without it (so CI continues and privileged tests
# skip with their own reason).
set -uo pipefail

STRICT=0
for arg in "$@"; do
    case "$arg" in
        --strict) STRICT=1 ;;
        -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "setup-ebpf: unknown argument: $arg (usage: $0 [--strict])" >&2; exit 2 ;;
    esac
done

PY=/usr/bin/python3             # Debian's python: it sees /usr/lib/python3/dist-packages/bcc
KREL=$(uname -r)
MODDIR=/lib/modules/$KREL
BCC_PKGS=(python3-bpfcc bpfcc-tools libbpfcc)
export DEBIAN_FRONTEND=noninteractive

log()  { echo "setup-ebpf: $*"; }
warn() { echo "setup-ebpf: WARNING: $*" >&2; }
fail() {
    echo "ebpf: UNAVAILABLE ($*)" >&2
    if [ "$STRICT" = 1 ]; then exit 1; fi
    echo "setup-ebpf: continuing without eBPF (pass --strict to make this fatal)" >&2
    exit 0
}

[ "$(id -u)" = 0 ] || fail "must run as root (uid $(id -u))"
command -v apt-get >/dev/null || fail "apt-get not found: this script supports Debian/Ubuntu only"

# ---------------------------------------------------------------- 1. packages
APT_UPDATED=0
apt_update_once() {
    [ "$APT_UPDATED" = 1 ] && return 0
    APT_UPDATED=1
    log "apt-get update"
    apt-get update -qq >/dev/null || warn "apt-get update failed"
}
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'ok installed'; }
has_candidate() { apt-cache policy "$1" 2>/dev/null | grep -q 'Candidate: [^(]'; }
apt_install() {   # install the packages not yet installed; update lists only if needed
    local missing=() p
    for p in "$@"; do installed "$p" || missing+=("$p"); done
    [ ${#missing[@]} = 0 ] && return 0
    for p in "${missing[@]}"; do has_candidate "$p" || { apt_update_once; break; }; done
    log "apt-get install ${missing[*]}"
    quiet_install "${missing[@]}" && return 0
    [ "$APT_UPDATED" = 1 ] && return 1
    apt_update_once     # stale lists (404s) are the usual cause: retry once after update
    quiet_install "${missing[@]}"
}
quiet_install() {   # stdout dropped; stderr kept, minus debconf's apt-utils notice
    apt-get install -y -qq --no-install-recommends "$@" 2>&1 >/dev/null \
        | { grep -v '^debconf: delaying package configuration' >&2 || true; }
    return "${PIPESTATUS[0]}"
}
lists_present() { ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1; }

apt_install "${BCC_PKGS[@]}" || fail "could not install ${BCC_PKGS[*]}"

# Generic headers flavour for this architecture (Debian's linux-headers-<flavour>).
case "$(dpkg --print-architecture)" in
    amd64)   FLAVOUR=amd64 ;;
    arm64)   FLAVOUR=arm64 ;;
    i386)    FLAVOUR=686-pae ;;
    ppc64el) FLAVOUR=powerpc64le ;;
    s390x)   FLAVOUR=s390x ;;
    armhf)   FLAVOUR=armmp ;;
    *)       FLAVOUR=$(dpkg --print-architecture) ;;
esac

headers_release() {   # kernel release the headers in dir $1 were built for
    sed -n 's/^#define UTS_RELEASE "\(.*\)"$/\1/p' "$1/include/generated/utsrelease.h" 2>/dev/null
}

if [ -e "$MODDIR/build" ]; then
    log "kernel headers: using existing $MODDIR/build -> $(readlink -f "$MODDIR/build")"
elif has_candidate "linux-headers-$KREL" || {
        # Refresh lists only if they are missing or this looks like a distro kernel
        # (a newer Debian kernel than the lists know); a custom kernel has no package.
        { ! lists_present || [[ "$KREL" == *-"$FLAVOUR" ]]; } && apt_update_once \
            && has_candidate "linux-headers-$KREL"; }; then
    apt_install "linux-headers-$KREL" || fail "could not install linux-headers-$KREL"
    log "kernel headers: linux-headers-$KREL"
else
    apt_install "linux-headers-$FLAVOUR" || fail "no headers for kernel $KREL and could not install linux-headers-$FLAVOUR"
    # linux-headers-<flavour> depends on linux-headers-<kver>-<flavour>, whose package ships
    # /lib/modules/<kver>/build -> /usr/src/linux-headers-<kver>-<flavour>   (generated files)
    # /lib/modules/<kver>/source -> /usr/src/linux-headers-<kver>-common     (include/linux/...)
    GEN_PKG=$(dpkg-query -W -f='${Depends}' "linux-headers-$FLAVOUR" | tr ',' '\n' \
              | sed -n 's/^ *\(linux-headers-[^ ]*\).*/\1/p' | head -n1)
    GEN_KVER=${GEN_PKG#linux-headers-}
    GEN_BUILD=$(readlink -f "/lib/modules/$GEN_KVER/build" 2>/dev/null)
    GEN_SOURCE=$(readlink -f "/lib/modules/$GEN_KVER/source" 2>/dev/null)
    if [ -z "$GEN_KVER" ] || [ ! -d "$GEN_BUILD" ]; then   # fall back to the newest installed
        GEN_BUILD=$(ls -d /usr/src/linux-headers-*-"$FLAVOUR" 2>/dev/null | sort -V | tail -n1)
        GEN_SOURCE=${GEN_BUILD%-"$FLAVOUR"}-common
    fi
    [ -d "$GEN_BUILD" ] || fail "linux-headers-$FLAVOUR installed but no /usr/src/linux-headers-*-$FLAVOUR found"
    mkdir -p "$MODDIR"
    ln -sfn "$GEN_BUILD" "$MODDIR/build"
    # Debian splits headers: the -<flavour> dir has only generated files, the rest is in
    # -common. bcc adds both trees to the include path when build/ and source/ both exist.
    if [ ! -e "$MODDIR/source" ] && [ -d "$GEN_SOURCE" ]; then
        ln -sfn "$GEN_SOURCE" "$MODDIR/source"
    fi
    log "kernel headers: linked $MODDIR/build -> $GEN_BUILD"
fi
# A build link from an earlier (fallback) run may lack its source link.
BUILD_DIR=$(readlink -f "$MODDIR/build")
if [ ! -e "$MODDIR/source" ] && [ ! -e "$BUILD_DIR/include/linux/kconfig.h" ] \
        && [ -d "${BUILD_DIR%-"$FLAVOUR"}-common/include/linux" ]; then
    ln -sfn "${BUILD_DIR%-"$FLAVOUR"}-common" "$MODDIR/source"
    log "kernel headers: linked $MODDIR/source -> ${BUILD_DIR%-"$FLAVOUR"}-common"
fi
HREL=$(headers_release "$BUILD_DIR")
if [ -n "$HREL" ] && [ "$HREL" != "$KREL" ]; then
    warn "NO KERNEL HEADERS FOR RUNNING KERNEL $KREL: using generic headers for $HREL" \
         "($BUILD_DIR). Tracepoint/uprobe programs work; programs that read kernel" \
         "structs may see wrong layouts."
fi

# ---------------------------------------------------------------- 2. mounts
if ! mountpoint -q /sys/kernel/tracing; then
    mount -t tracefs nodev /sys/kernel/tracing || warn "could not mount tracefs at /sys/kernel/tracing"
fi
# bcc's Python module prefers /sys/kernel/debug/tracing when that path exists; older tools
# and the kprobe blacklist live under debugfs. Mount it, and make sure debug/tracing is not
# an empty directory (bcc would pick it and find no events).
if ! mountpoint -q /sys/kernel/debug; then
    mount -t debugfs nodev /sys/kernel/debug 2>/dev/null || warn "could not mount debugfs at /sys/kernel/debug"
fi
if [ -d /sys/kernel/debug/tracing ] && [ ! -e /sys/kernel/debug/tracing/events ]; then
    mount -t tracefs nodev /sys/kernel/debug/tracing 2>/dev/null \
        || warn "/sys/kernel/debug/tracing is empty and tracefs could not be mounted there"
fi
[ -e /sys/kernel/tracing/events/sched/sched_switch ] \
    || fail "tracefs has no sched:sched_switch event (tracefs not mounted or CONFIG_FTRACE off)"

# ---------------------------------------------------------------- 3. self-check
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
"$PY" - >"$OUT" 2>&1 <<'EOF'
import ctypes, os, sys, time
try:
    import bcc
    from bcc import BPF
except Exception as e:
    print("REASON: cannot import bcc with %s: %s" % (sys.executable, e)); sys.exit(1)
if not BPF.tracepoint_exists("sched", "sched_switch"):
    print("REASON: bcc cannot see tracepoint sched:sched_switch (tracefs: %s)" % bcc.TRACEFS); sys.exit(1)
prog = r"""
BPF_ARRAY(counts, u64, 1);
TRACEPOINT_PROBE(sched, sched_switch) {
    int k = 0;
    u64 *v = counts.lookup(&k);
    if (v) __sync_fetch_and_add(v, 1);
    return 0;
}
"""
try:
    b = BPF(text=prog)
except Exception as e:
    print("REASON: bcc could not compile/load a tracepoint program: %s" % e); sys.exit(1)
for _ in range(200):          # sleeps force context switches
    time.sleep(0.001)
n = b["counts"][ctypes.c_int(0)].value
b.cleanup()
if n <= 0:
    print("REASON: program attached to sched:sched_switch but counted no events"); sys.exit(1)
print("ebpf: ok (bcc %s, kernel %s, sched:sched_switch fired %d times)"
      % (getattr(bcc, "__version__", "?"), os.uname().release, n))
EOF
rc=$?
if [ $rc = 0 ] && grep -q '^ebpf: ok' "$OUT"; then
    grep '^ebpf: ok' "$OUT"
    exit 0
fi
echo "setup-ebpf: self-check output:" >&2
tail -n 30 "$OUT" >&2
REASON=$(sed -n 's/^REASON: //p' "$OUT" | tail -n1)
fail "${REASON:-self-check exited with status $rc}"
