#!/bin/sh
# Build the fake NVML library: tests/fakes/nvml/build.sh OUTDIR
# -> OUTDIR/libnvidia-ml.so.1 (+ libnvidia-ml.so symlink). Put OUTDIR on LD_LIBRARY_PATH and
# pynvml's CDLL("libnvidia-ml.so.1") loads it. CC overrides the compiler (default: cc).
# FAKE_NVML_MISSING="nvmlA nvmlB" leaves those functions out of the library's symbol table (a linker
# version script makes them local), so dlsym fails for them as with a driver that predates them.
set -eu
if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
out=$1
mkdir -p "$out"
tmp="$out/.libnvidia-ml.so.1.$$"
map="$out/.missing.map.$$"
trap 'rm -f "$tmp" "$map"' EXIT
missing=${FAKE_NVML_MISSING:-}
extra=""
if [ -n "$missing" ]; then
    { printf '{ local:'; for s in $missing; do printf ' %s;' "$s"; done; printf ' };\n'; } > "$map"
    extra="-Wl,--version-script=$map"
fi
${CC:-cc} -std=c11 -O2 -g -fPIC -shared -fvisibility=hidden -Wall -Wextra -Werror=implicit-function-declaration \
    -DFAKE_MISSING="\"$missing\"" -Wl,-soname,libnvidia-ml.so.1 $extra -o "$tmp" "$here/fake_nvml.c" -lm -lpthread
mv -f "$tmp" "$out/libnvidia-ml.so.1"          # atomic: a concurrent loader never sees half a file
ln -sfn libnvidia-ml.so.1 "$out/libnvidia-ml.so"
