// cuda_uprobe: CUDA driver API activity per process from uprobes on libcuda.so: kernel launches,
// memcpy calls and bytes by direction, allocations (count and bytes requested) and frees.
//
// Entry uprobes only (no uretprobes: those cost a second trap per call and break on some unwinders),
// so bytes are what was asked for, counted whether or not the call succeeded. Which symbol goes to
// which program is in probes/specs.py (CUDA_SYMBOLS); the byte count is the third argument of the
// cuMemcpy{HtoD,DtoH,DtoD}[Async]_v2 family and the second of cuMemAlloc_v2 / cuMemAllocManaged /
// cuMemAllocAsync (CUDA driver API signatures, stable since CUDA 3.2's _v2 entry points).
#include <uapi/linux/ptrace.h>

#ifndef CUDA_MAX_PROCS
#define CUDA_MAX_PROCS 4096
#endif

struct cuda_stats {
    u64 launches;
    u64 htod_calls;
    u64 htod_bytes;
    u64 dtoh_calls;
    u64 dtoh_bytes;
    u64 dtod_calls;
    u64 dtod_bytes;
    u64 allocs;
    u64 alloc_bytes;
    u64 frees;
    char comm[16];
};

BPF_TABLE("lru_hash", u32, struct cuda_stats, cuda_stats, CUDA_MAX_PROCS);

static __always_inline struct cuda_stats *cuda_proc(void)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct cuda_stats *s = cuda_stats.lookup(&tgid);
    if (s)
        return s;
    struct cuda_stats zero = {};
    bpf_get_current_comm(&zero.comm, sizeof(zero.comm));
    cuda_stats.insert(&tgid, &zero);   // BPF_NOEXIST: another thread may have won
    return cuda_stats.lookup(&tgid);
}

int cuda_launch(struct pt_regs *ctx)
{
    struct cuda_stats *s = cuda_proc();
    if (s)
        __sync_fetch_and_add(&s->launches, 1);
    return 0;
}

int cuda_memcpy_htod(struct pt_regs *ctx)
{
    struct cuda_stats *s = cuda_proc();
    if (!s)
        return 0;
    __sync_fetch_and_add(&s->htod_calls, 1);
    __sync_fetch_and_add(&s->htod_bytes, (u64)PT_REGS_PARM3(ctx));
    return 0;
}

int cuda_memcpy_dtoh(struct pt_regs *ctx)
{
    struct cuda_stats *s = cuda_proc();
    if (!s)
        return 0;
    __sync_fetch_and_add(&s->dtoh_calls, 1);
    __sync_fetch_and_add(&s->dtoh_bytes, (u64)PT_REGS_PARM3(ctx));
    return 0;
}

int cuda_memcpy_dtod(struct pt_regs *ctx)
{
    struct cuda_stats *s = cuda_proc();
    if (!s)
        return 0;
    __sync_fetch_and_add(&s->dtod_calls, 1);
    __sync_fetch_and_add(&s->dtod_bytes, (u64)PT_REGS_PARM3(ctx));
    return 0;
}

int cuda_alloc(struct pt_regs *ctx)
{
    struct cuda_stats *s = cuda_proc();
    if (!s)
        return 0;
    __sync_fetch_and_add(&s->allocs, 1);
    __sync_fetch_and_add(&s->alloc_bytes, (u64)PT_REGS_PARM2(ctx));
    return 0;
}

int cuda_free(struct pt_regs *ctx)
{
    struct cuda_stats *s = cuda_proc();
    if (s)
        __sync_fetch_and_add(&s->frees, 1);
    return 0;
}
