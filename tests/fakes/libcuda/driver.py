"""Call the fake libcuda's entry points a known number of times through ctypes.

    python driver.py LIBRARY N [--wait]

With --wait it loads the library, prints "ready" and waits for a line on stdin before calling, so
a test can attach its probes in between. Prints one JSON line with what it did.
"""

import ctypes
import json
import os
import sys

lib = ctypes.CDLL(sys.argv[1])
n = int(sys.argv[2])
if "--wait" in sys.argv:
    print("ready", flush=True)
    sys.stdin.readline()
HTOD, DTOH, HTOD_ASYNC, DTOD, ALLOC = 4096, 8192, 1024, 512, 1 << 20
buf = ctypes.create_string_buffer(DTOH)
ptr = ctypes.c_ulonglong(0)
lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t]
lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_size_t]
lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
lib.cuMemcpyDtoD_v2.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_size_t]
lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t]
lib.cuMemFree_v2.argtypes = [ctypes.c_ulonglong]
lib.cuInit(0)
for _ in range(n):
    lib.cuMemAlloc_v2(ctypes.byref(ptr), ALLOC)
    lib.cuMemcpyHtoD_v2(ptr.value, buf, HTOD)
    lib.cuMemcpyHtoDAsync_v2(ptr.value, buf, HTOD_ASYNC, None)
    lib.cuLaunchKernel(None, 1, 1, 1, 32, 1, 1, 0, None, None, None)
    lib.cuLaunchKernel(None, 1, 1, 1, 32, 1, 1, 0, None, None, None)
    lib.cuMemcpyDtoD_v2(ptr.value, ptr.value, DTOD)
    lib.cuMemcpyDtoH_v2(buf, ptr.value, DTOH)
    lib.cuMemFree_v2(ptr.value)
print(json.dumps({"pid": os.getpid(), "n": n, "launches": 2 * n, "htod_bytes": n * (HTOD + HTOD_ASYNC),
                  "htod_calls": 2 * n, "dtoh_bytes": n * DTOH, "dtoh_calls": n, "dtod_bytes": n * DTOD,
                  "dtod_calls": n, "allocs": n, "alloc_bytes": n * ALLOC, "frees": n,
                  "lib_launches": lib.fake_cuda_calls(1)}), flush=True)
