#!/bin/sh
# Build the fake NVML library: tests/fakes/nvml/build.sh OUTDIR
# -> OUTDIR/libnvidia-ml.so.1 (+ libnvidia-ml.so symlink). Put OUTDIR on LD_LIBRARY_PATH and
# pynvml's CDLL("libnvidia-ml.so.1") loads it. CC overrides the compiler (default: cc).
set -eu
if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
out=$1
mkdir -p "$out"
tmp="$out/.libnvidia-ml.so.1.$$"
trap 'rm -f "$tmp"' EXIT
${CC:-cc} -std=c11 -O2 -g -fPIC -shared -fvisibility=hidden -Wall -Wextra -Werror=implicit-function-declaration \
    -Wl,-soname,libnvidia-ml.so.1 -o "$tmp" "$here/fake_nvml.c" -lm -lpthread
mv -f "$tmp" "$out/libnvidia-ml.so.1"          # atomic: a concurrent loader never sees half a file
ln -sfn libnvidia-ml.so.1 "$out/libnvidia-ml.so"
