// runqlat: run-queue latency (time from wake-up or preemption to running on a CPU) per cgroup v2,
// as a log2 histogram in nanoseconds. Tracepoints only: sched:sched_wakeup, sched:sched_wakeup_new,
// sched:sched_switch. No kernel struct is read, so generic kernel headers are enough.
//
// The cgroup of the task that waited is only "current" when that task runs, not when it is woken
// (current is then the waker) nor at the switch that puts it on the CPU (current is the task going
// off). So the latency measured at switch-in is parked in the task's entry and charged to
// bpf_get_current_cgroup_id() at the task's next switch-out, when current is the task itself.
//
// Compile-time parameters (from probes/specs.py, overridable with -D):
//   RUNQLAT_MAX_TASKS    LRU bound on tracked tasks (a fork storm evicts the oldest)
//   RUNQLAT_MAX_CGROUPS  LRU bound on cgroups with a histogram
//   RUNQLAT_SLOTS        log2 buckets; slot i holds latencies in [2^(i-1), 2^i - 1] ns

#ifndef RUNQLAT_MAX_TASKS
#define RUNQLAT_MAX_TASKS 16384
#endif
#ifndef RUNQLAT_MAX_CGROUPS
#define RUNQLAT_MAX_CGROUPS 1024
#endif
#ifndef RUNQLAT_SLOTS
#define RUNQLAT_SLOTS 40
#endif

// sched_switch's prev_state: since Linux 4.14 (commit efb40f588b43, "sched/tracing: Fix trace_sched_switch
// task-state printing") a preempted task reports TASK_REPORT_MAX (0x100) instead of TASK_RUNNING (0);
// any bit below it is a sleeping/stopped state. Runnable == no bit below TASK_REPORT_MAX.
#define RUNQLAT_TASK_REPORT_MAX 0x100

struct runqlat_task {
    u64 enq_ns;   // when it became runnable; 0 while it runs or sleeps
    u64 pend_ns;  // latency measured at switch-in, not yet charged to a cgroup
};

struct runqlat_hist {       // the count is the sum of the slots: one atomic fewer per event
    u64 sum_ns;
    u64 slots[RUNQLAT_SLOTS];
};

BPF_TABLE("lru_hash", u32, struct runqlat_task, runqlat_tasks, RUNQLAT_MAX_TASKS);
BPF_TABLE("lru_hash", u64, struct runqlat_hist, runqlat_hist, RUNQLAT_MAX_CGROUPS);

static __always_inline void runqlat_enqueue(u32 pid, u64 now)
{
    if (pid == 0)   // the idle task
        return;
    struct runqlat_task zero = {};
    struct runqlat_task *t = runqlat_tasks.lookup_or_try_init(&pid, &zero);
    if (t)
        t->enq_ns = now;
}

static __always_inline void runqlat_record(u64 delta_ns)
{
    u64 cgid = bpf_get_current_cgroup_id();
    struct runqlat_hist zero = {};
    struct runqlat_hist *h = runqlat_hist.lookup_or_try_init(&cgid, &zero);
    if (!h)
        return;
    u32 slot = bpf_log2l(delta_ns);
    if (slot >= RUNQLAT_SLOTS)
        slot = RUNQLAT_SLOTS - 1;
    __sync_fetch_and_add(&h->slots[slot], 1);
    __sync_fetch_and_add(&h->sum_ns, delta_ns);
}

TRACEPOINT_PROBE(sched, sched_wakeup)
{
    runqlat_enqueue(args->pid, bpf_ktime_get_ns());
    return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup_new)
{
    runqlat_enqueue(args->pid, bpf_ktime_get_ns());
    return 0;
}

TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    u32 prev = args->prev_pid;
    u32 next = args->next_pid;
    struct runqlat_task *t;

    if (prev != 0) {
        t = runqlat_tasks.lookup(&prev);
        if (t && t->pend_ns) {          // current == prev: its cgroup is the one that waited
            runqlat_record(t->pend_ns);
            t->pend_ns = 0;
        }
        if ((args->prev_state & (RUNQLAT_TASK_REPORT_MAX - 1)) == 0) {  // preempted: back on the run queue
            if (t)
                t->enq_ns = now;
            else
                runqlat_enqueue(prev, now);
        }
    }
    if (next != 0) {
        t = runqlat_tasks.lookup(&next);
        if (t && t->enq_ns) {
            u64 delta = now - t->enq_ns;
            t->pend_ns = delta ? delta : 1;
            t->enq_ns = 0;
        }
    }
    return 0;
}
