// blkio: block I/O latency (log2 histogram, ns), operations and bytes per disk and direction.
//
// BLKIO_RAW_DONE=1 (preferred where the kernel's BTF allows): block:block_io_start counts bytes from
//   its record, and the raw tracepoint block_io_done reads the request itself: rq->start_time_ns
//   (when the block layer started accounting it: the start /proc/diskstats times from), its
//   operation (rq->cmd_flags) and its disk (rq->q->disk->major/first_minor), at offsets from the
//   running kernel's BTF (BLKIO_*_OFF), not from headers. No in-flight map at all: one add at start,
//   one histogram update at completion.
// Otherwise two tracepoint pairs, chosen in probes/specs.py by what the kernel has (define
// BLKIO_IO_START=1 for the first):
//   block:block_io_start / block:block_io_done (Linux 6.5+, commit 5a80bd075f3b): fired where the
//     request is accounted in /proc/diskstats, so operations match iostat and latency includes the
//     time queued in the I/O scheduler;
//   block:block_rq_issue / block:block_rq_complete (all kernels): from dispatch to the device until
//     completion (device service time); flush requests count as direction "flush".
// Neither pair exposes the request pointer, so an in-flight request is keyed by (dev, sector) as
// bcc's tracepoint-based tools do. In-flight requests are a plain (preallocated) hash, cheaper per
// I/O than an LRU one: a request whose completion is never seen stays until the agent drops it (it
// drops entries older than a minute at each nearline round). Histograms are per CPU: plain adds,
// no atomics; the agent sums the CPUs.

#ifndef BLKIO_MAX_INFLIGHT
#define BLKIO_MAX_INFLIGHT 16384
#endif
#ifndef BLKIO_MAX_DISKS
#define BLKIO_MAX_DISKS 1024
#endif
#ifndef BLKIO_SLOTS
#define BLKIO_SLOTS 40
#endif
#ifndef BLKIO_RAW_DONE
#define BLKIO_RAW_DONE 0
#endif

#define BLKIO_READ 0
#define BLKIO_WRITE 1
#define BLKIO_DISCARD 2
#define BLKIO_FLUSH 3   // flush-only and "none" operations

struct blkio_start_key {
    u32 dev;
    u32 pad;
    u64 sector;
};

struct blkio_start {
    u64 ts_ns;
    u64 bytes;   // taken at start: block_io_done reports 0 once the request has fully completed
};

struct blkio_key {
    u32 dev;   // kernel dev_t: major << 20 | minor
    u32 dir;
};

struct blkio_hist {
    u64 count;
    u64 sum_ns;
    u64 bytes;
    u64 errors;
    u64 slots[BLKIO_SLOTS];
};

BPF_PERCPU_HASH(blkio_hist, struct blkio_key, struct blkio_hist, BLKIO_MAX_DISKS);
#if !BLKIO_RAW_DONE
BPF_HASH(blkio_start, struct blkio_start_key, struct blkio_start, BLKIO_MAX_INFLIGHT);
#endif

// rwbs: optional 'F' (preflush), then the operation: W, R, D or E (discard/secure erase), F (flush),
// N (none); then modifiers (F fua, A ahead, S sync, M meta).
static __always_inline u32 blkio_dir(const char *rwbs)
{
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        char c = rwbs[i];
        if (c == 'W')
            return BLKIO_WRITE;
        if (c == 'R')
            return BLKIO_READ;
        if (c == 'D' || c == 'E')
            return BLKIO_DISCARD;
        if (c == 0)
            break;
    }
    return BLKIO_FLUSH;
}


static __always_inline struct blkio_hist *blkio_of(u32 dev, u32 dir)
{
    struct blkio_key hk = {.dev = dev, .dir = dir};
    struct blkio_hist *h = blkio_hist.lookup(&hk);
    if (!h) {
        struct blkio_hist zero = {};
        blkio_hist.update(&hk, &zero);
        h = blkio_hist.lookup(&hk);
    }
    return h;
}

#if !BLKIO_RAW_DONE
static __always_inline void blkio_begin(u32 dev, u64 sector, u32 bytes)
{
    struct blkio_start_key k = {.dev = dev, .sector = sector};
    struct blkio_start v = {.ts_ns = bpf_ktime_get_ns(), .bytes = bytes};
    blkio_start.update(&k, &v);
}

static __always_inline void blkio_end(u32 dev, u64 sector, const char *rwbs, int error)
{
    struct blkio_start_key k = {.dev = dev, .sector = sector};
    struct blkio_start *start = blkio_start.lookup(&k);
    if (!start)
        return;
    u64 delta = bpf_ktime_get_ns() - start->ts_ns;
    u64 bytes = start->bytes;
    blkio_start.delete(&k);

    struct blkio_hist *h = blkio_of(dev, blkio_dir(rwbs));
    if (!h)
        return;
    u32 slot = bpf_log2l(delta);
    if (slot >= BLKIO_SLOTS)
        slot = BLKIO_SLOTS - 1;
    h->slots[slot] += 1;
    h->count += 1;
    h->sum_ns += delta;
    h->bytes += bytes;
    if (error)
        h->errors += 1;
}

#endif

#if BLKIO_RAW_DONE
#define BLKIO_OP_READ 0        // enum req_op (include/linux/blk_types.h)
#define BLKIO_OP_WRITE 1
#define BLKIO_OP_DISCARD 3
#define BLKIO_OP_SECURE_ERASE 5
#define BLKIO_OP_MASK 0xff

TRACEPOINT_PROBE(block, block_io_start)
{
    struct blkio_hist *h = blkio_of(args->dev, blkio_dir(args->rwbs));
    if (h)
        h->bytes += args->bytes;
    return 0;
}

RAW_TRACEPOINT_PROBE(block_io_done)
{
    void *rq = (void *)ctx->args[0];
    void *q = 0, *disk = 0;
    u32 flags = 0;
    u64 start = 0;
    int devno[2] = {};    // major, first_minor
    if (bpf_probe_read_kernel(&start, sizeof(start), rq + BLKIO_RQ_START_OFF) || !start ||
        bpf_probe_read_kernel(&flags, sizeof(flags), rq + BLKIO_RQ_FLAGS_OFF) ||
        bpf_probe_read_kernel(&q, sizeof(q), rq + BLKIO_RQ_Q_OFF) ||
        bpf_probe_read_kernel(&disk, sizeof(disk), q + BLKIO_Q_DISK_OFF) || !disk)
        return 0;
#if BLKIO_DISK_MINOR_OFF == BLKIO_DISK_MAJOR_OFF + 4
    if (bpf_probe_read_kernel(devno, sizeof(devno), disk + BLKIO_DISK_MAJOR_OFF))
        return 0;
#else
    if (bpf_probe_read_kernel(&devno[0], 4, disk + BLKIO_DISK_MAJOR_OFF) ||
        bpf_probe_read_kernel(&devno[1], 4, disk + BLKIO_DISK_MINOR_OFF))
        return 0;
#endif
    u64 now = bpf_ktime_get_ns();
    if (now < start)
        return 0;
    u64 delta = now - start;
    u32 op = flags & BLKIO_OP_MASK;
    u32 dir = op == BLKIO_OP_WRITE ? BLKIO_WRITE : op == BLKIO_OP_READ ? BLKIO_READ
            : (op == BLKIO_OP_DISCARD || op == BLKIO_OP_SECURE_ERASE) ? BLKIO_DISCARD : BLKIO_FLUSH;
    struct blkio_hist *h = blkio_of(((u32)devno[0] << 20) | (u32)devno[1], dir);   // MKDEV, as the tracepoints
    if (!h)
        return 0;
    u32 slot = bpf_log2l(delta);
    if (slot >= BLKIO_SLOTS)
        slot = BLKIO_SLOTS - 1;
    h->slots[slot] += 1;
    h->count += 1;
    h->sum_ns += delta;
    return 0;
}
#elif BLKIO_IO_START
TRACEPOINT_PROBE(block, block_io_start)
{
    blkio_begin(args->dev, args->sector, args->bytes);
    return 0;
}

TRACEPOINT_PROBE(block, block_io_done)
{
    // No error field in block_io_done.
    blkio_end(args->dev, args->sector, args->rwbs, 0);
    return 0;
}
#else
TRACEPOINT_PROBE(block, block_rq_issue)
{
    blkio_begin(args->dev, args->sector, args->bytes);
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_complete)
{
    blkio_end(args->dev, args->sector, args->rwbs, args->error);
    return 0;
}
#endif
