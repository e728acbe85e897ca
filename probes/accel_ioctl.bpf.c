// accel_ioctl: ioctl calls, errors and latency (log2 histogram, ns) per process on accelerator device
// files (/dev/nvidia*, /dev/davinci* by default), from syscall tracepoints only.
//
// Which fds are device files is learnt without reading kernel structs (generic headers are enough):
// sys_enter_openat/open compare the path with the configured prefixes (map accel_prefixes, filled by
// the agent from its device globs) and sys_exit_* records (tgid, fd) in accel_fds; close forgets it.
// Fds opened before the probe was attached, inherited over fork or duplicated are added by the agent
// from /proc/<pid>/fd (it writes into accel_fds too).

#ifndef ACCEL_MAX_PREFIXES
#define ACCEL_MAX_PREFIXES 4
#endif
#ifndef ACCEL_PREFIX_LEN
#define ACCEL_PREFIX_LEN 32
#endif
#ifndef ACCEL_MAX_FDS
#define ACCEL_MAX_FDS 16384
#endif
#ifndef ACCEL_MAX_PROCS
#define ACCEL_MAX_PROCS 4096
#endif
#ifndef ACCEL_SLOTS
#define ACCEL_SLOTS 40
#endif

// A prefix as 8-byte words and a byte mask (0xff for the prefix's bytes), so a match is a few
// XOR/AND/OR per word with no branch per character (the verifier walks it once).
#define ACCEL_PREFIX_WORDS (ACCEL_PREFIX_LEN / 8)
struct accel_prefix {
    u64 used;
    u64 word[ACCEL_PREFIX_WORDS];
    u64 mask[ACCEL_PREFIX_WORDS];
};

struct accel_fd_key {
    u32 tgid;
    u32 fd;
};

struct accel_stats {
    u64 calls;
    u64 errors;
    u64 sum_ns;
    u64 slots[ACCEL_SLOTS];
    char comm[16];
};

BPF_ARRAY(accel_prefixes, struct accel_prefix, ACCEL_MAX_PREFIXES);
BPF_TABLE("lru_hash", struct accel_fd_key, u8, accel_fds, ACCEL_MAX_FDS);
BPF_TABLE("lru_hash", u64, u8, accel_opening, 1024);        // pid_tgid between open enter and exit
BPF_TABLE("lru_hash", u64, u64, accel_inflight, 1024);      // pid_tgid -> ioctl start ns
BPF_TABLE("lru_hash", u32, struct accel_stats, accel_stats, ACCEL_MAX_PROCS);

static __always_inline int accel_match(const char *filename)
{
    u64 path[ACCEL_PREFIX_WORDS] = {};
    if (bpf_probe_read_user_str(path, sizeof(path), filename) <= 0)
        return 0;
    #pragma unroll
    for (int p = 0; p < ACCEL_MAX_PREFIXES; p++) {
        int idx = p;
        struct accel_prefix *pre = accel_prefixes.lookup(&idx);
        if (!pre || !pre->used)
            continue;
        u64 differ = 0;
        #pragma unroll
        for (int w = 0; w < ACCEL_PREFIX_WORDS; w++)
            differ |= (path[w] ^ pre->word[w]) & pre->mask[w];
        if (!differ)
            return 1;
    }
    return 0;
}

static __always_inline void accel_open_enter(const char *filename)
{
    if (!accel_match(filename))
        return;
    u64 id = bpf_get_current_pid_tgid();
    u8 one = 1;
    accel_opening.update(&id, &one);
}

static __always_inline void accel_open_exit(long ret)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!accel_opening.lookup(&id))
        return;
    accel_opening.delete(&id);
    if (ret < 0)
        return;
    struct accel_fd_key k = {.tgid = id >> 32, .fd = ret};
    u8 one = 1;
    accel_fds.update(&k, &one);
}

TRACEPOINT_PROBE(syscalls, sys_enter_openat)
{
    accel_open_enter(args->filename);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat)
{
    accel_open_exit(args->ret);
    return 0;
}

#if ACCEL_HAVE_OPEN   // x86_64 and others with the legacy open(2); arm64 has only openat
TRACEPOINT_PROBE(syscalls, sys_enter_open)
{
    accel_open_enter(args->filename);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_open)
{
    accel_open_exit(args->ret);
    return 0;
}
#endif

TRACEPOINT_PROBE(syscalls, sys_enter_close)
{
    struct accel_fd_key k = {.tgid = bpf_get_current_pid_tgid() >> 32, .fd = args->fd};
    accel_fds.delete(&k);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_ioctl)
{
    u64 id = bpf_get_current_pid_tgid();
    struct accel_fd_key k = {.tgid = id >> 32, .fd = args->fd};
    if (!accel_fds.lookup(&k))
        return 0;
    u64 now = bpf_ktime_get_ns();
    accel_inflight.update(&id, &now);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_ioctl)
{
    u64 id = bpf_get_current_pid_tgid();
    u64 *start = accel_inflight.lookup(&id);
    if (!start)
        return 0;
    u64 delta = bpf_ktime_get_ns() - *start;
    accel_inflight.delete(&id);

    u32 tgid = id >> 32;
    struct accel_stats *s = accel_stats.lookup(&tgid);
    if (!s) {
        struct accel_stats zero = {};
        bpf_get_current_comm(&zero.comm, sizeof(zero.comm));
        accel_stats.insert(&tgid, &zero);   // BPF_NOEXIST: another thread may have won
        s = accel_stats.lookup(&tgid);
        if (!s)
            return 0;
    }
    u32 slot = bpf_log2l(delta);
    if (slot >= ACCEL_SLOTS)
        slot = ACCEL_SLOTS - 1;
    __sync_fetch_and_add(&s->slots[slot], 1);
    __sync_fetch_and_add(&s->calls, 1);
    __sync_fetch_and_add(&s->sum_ns, delta);
    if (args->ret < 0)
        __sync_fetch_and_add(&s->errors, 1);
    return 0;
}
