// cuda_uprobe: CUDA driver API activity per process from uprobes on libcuda.so: kernel launches,
// memcpy calls and bytes by direction, allocations (count and bytes requested) and frees.
//
// Entry uprobes only (no uretprobes: those cost a second trap per call and break on some unwinders),
// so bytes are what was asked for, counted whether or not the call succeeded. Which symbol goes to
// which program is in probes/specs.py (CUDA_SYMBOLS); the byte count is the third argument of the
// cuMemcpy{HtoD,DtoH,DtoD}[Async]_v2 family and the second of cuMemAlloc_v2 / cuMemAllocManaged /
// cuMemAllocAsync (CUDA driver API signatures, stable since CUDA 3.2's _v2 entry points).
// Slot 0 collects processes beyond CUDA_MAX_PROCS - 1 at once (reported as pid "(other)").

// A uprobe's context is the user registers (struct pt_regs). Arguments are read at their place in
// that struct's layout, which is the architecture's ABI (uapi asm/ptrace.h), instead of including
// <uapi/linux/ptrace.h> for bcc's PT_REGS_PARMn: its headers cost clang ~0.09 s at every start.
#if defined(bpf_target_x86)
#define CUDA_ARG2(ctx) (((u64 *)(ctx))[13])    // rsi: r15 r14 r13 r12 bp bx r11 r10 r9 r8 ax cx dx si di ...
#define CUDA_ARG3(ctx) (((u64 *)(ctx))[12])    // rdx
#elif defined(bpf_target_arm64)
#define CUDA_ARG2(ctx) (((u64 *)(ctx))[1])     // x1: regs[31], sp, pc, pstate
#define CUDA_ARG3(ctx) (((u64 *)(ctx))[2])     // x2
#else
#include <uapi/linux/ptrace.h>
#define CUDA_ARG2(ctx) PT_REGS_PARM2(ctx)
#define CUDA_ARG3(ctx) PT_REGS_PARM3(ctx)
#endif

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
};

struct cuda_proc {
    u32 slot;         // index into cuda_slots; 0: no slot was free ("(other)")
    u32 pad;
    char comm[16];
};

struct cuda_cpu {
    u32 tgid;         // the process that last called on this CPU
    u32 slot;         // and its slot
};

// A process's figures live in a per-CPU array slot (plain adds, no atomics, no hashing per call);
// cuda_procs says which process has which slot (and its name); each CPU remembers the last
// process that called on it, so only a process's first call on a CPU looks it up. Slots come from
// the queue cuda_free_slots, which the loader fills and the agent refills when a process has exited.
BPF_HASH(cuda_procs, u32, struct cuda_proc, CUDA_MAX_PROCS);
BPF_QUEUE(cuda_free_slots, u32, CUDA_MAX_PROCS);
BPF_PERCPU_ARRAY(cuda_slots, struct cuda_stats, CUDA_MAX_PROCS);
BPF_PERCPU_ARRAY(cuda_cpu, struct cuda_cpu, 1);

static __always_inline struct cuda_stats *cuda_proc(void)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    int zero = 0;
    struct cuda_cpu *c = cuda_cpu.lookup(&zero);
    if (!c)
        return 0;
    if (c->tgid != tgid || !c->slot) {
        struct cuda_proc *p = cuda_procs.lookup(&tgid);
        if (!p) {
            struct cuda_proc np = {};
            if (cuda_free_slots.pop(&np.slot))
                np.slot = 0;
            bpf_get_current_comm(&np.comm, sizeof(np.comm));
            if (cuda_procs.insert(&tgid, &np) && np.slot)   // another thread was first
                cuda_free_slots.push(&np.slot, 0);
            p = cuda_procs.lookup(&tgid);
            if (!p)
                return 0;
        }
        c->tgid = tgid;
        c->slot = p->slot;
    }
    u32 slot = c->slot;
    return cuda_slots.lookup(&slot);
}

int cuda_launch(struct pt_regs *ctx)
{
    struct cuda_stats *s = cuda_proc();
    if (s)
        s->launches += 1;
    return 0;
}

int cuda_memcpy_htod(struct pt_regs *ctx)
{
    struct cuda_stats *s = cuda_proc();
    if (!s)
        return 0;
    s->htod_calls += 1;
    s->htod_bytes += CUDA_ARG3(ctx);
    return 0;
}

int cuda_memcpy_dtoh(struct pt_regs *ctx)
{
    struct cuda_stats *s = cuda_proc();
    if (!s)
        return 0;
    s->dtoh_calls += 1;
    s->dtoh_bytes += CUDA_ARG3(ctx);
    return 0;
}

int cuda_memcpy_dtod(struct pt_regs *ctx)
{
    struct cuda_stats *s = cuda_proc();
    if (!s)
        return 0;
    s->dtod_calls += 1;
    s->dtod_bytes += CUDA_ARG3(ctx);
    return 0;
}

int cuda_alloc(struct pt_regs *ctx)
{
    struct cuda_stats *s = cuda_proc();
    if (!s)
        return 0;
    s->allocs += 1;
    s->alloc_bytes += CUDA_ARG2(ctx);
    return 0;
}

int cuda_free(struct pt_regs *ctx)
{
    struct cuda_stats *s = cuda_proc();
    if (s)
        s->frees += 1;
    return 0;
}
