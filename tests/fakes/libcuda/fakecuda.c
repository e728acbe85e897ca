/* A stand-in for libcuda.so.1 (the NVIDIA driver library) for the cuda_uprobe tests: it exports the
 * driver API entry points the probe attaches to, with their real signatures, and does nothing but
 * count calls, so a test can drive a known number of launches, copies and allocations on a host
 * without a GPU. Build: gcc -shared -fPIC -O1 -o libcuda.so.1 fakecuda.c
 */
#include <stddef.h>
#include <stdlib.h>

typedef int CUresult;                    /* CUDA_SUCCESS == 0 */
typedef unsigned long long CUdeviceptr;
typedef void *CUfunction;
typedef void *CUstream;

#define EXPORT __attribute__((visibility("default"), noinline, used))

/* One counter per entry point: distinct bodies, so no two symbols are folded into one address. */
static volatile unsigned long calls[16];
static unsigned long long next_ptr = 0x100000;

EXPORT CUresult cuInit(unsigned int flags) { (void)flags; calls[0]++; return 0; }

EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                               unsigned int bx, unsigned int by, unsigned int bz,
                               unsigned int shared_mem, CUstream stream, void **params, void **extra)
{
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz;
    (void)shared_mem; (void)stream; (void)params; (void)extra;
    calls[1]++;
    return 0;
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes)
{
    (void)dst; (void)src; (void)bytes; calls[2]++; return 0;
}

EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes)
{
    (void)dst; (void)src; (void)bytes; calls[3]++; return 0;
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream s)
{
    (void)dst; (void)src; (void)bytes; (void)s; calls[4]++; return 0;
}

EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes)
{
    (void)dst; (void)src; (void)bytes; calls[5]++; return 0;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes)
{
    calls[6]++;
    *dptr = next_ptr;
    next_ptr += (bytes + 255) & ~255ULL;
    return 0;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) { (void)dptr; calls[7]++; return 0; }

/* Not part of the CUDA API: lets the driver program check what it did. */
EXPORT unsigned long fake_cuda_calls(int which) { return (which >= 0 && which < 16) ? calls[which] : 0; }
