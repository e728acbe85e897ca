// runqlat: run-queue latency (time from wake-up or preemption to running on a CPU) per cgroup v2,
// as a log2 histogram in nanoseconds. Two variants, chosen in probes/specs.py by feature tests:
//
// RUNQLAT_SCHED_INFO=1 (preferred): one raw tracepoint, sched_switch, and the kernel's own run-queue
//   accounting. With CONFIG_SCHED_INFO the scheduler keeps per task sched_info.pcount (times it came
//   onto a CPU) and sched_info.run_delay (ns it waited on a run queue, from being enqueued by a
//   wake-up or a preemption until it ran: runqlat's measure, on the scheduler's clock). Both are
//   updated in the context switch just after sched_switch fires, so when a task is switched out
//   (it is `current`), every arrival of the run that ends now is in them: the difference to what
//   this task showed at its previous switch-out is the wait before this run, and current's cgroup is
//   the one that waited. No wake-up tracepoints (half the events), no lookup keyed by pid: the state
//   lives in task-local storage (freed with the task), read through the BTF-typed pointer
//   bpf_get_current_task_btf() gives, with plain loads (the verifier checks them against the
//   kernel's BTF). The offsets come from the running kernel's BTF at load time (RUNQLAT_*_OFF), not
//   from headers. Histograms are per-CPU array slots; a task remembers its cgroup's slot, so only a
//   task's first switch-out in a cgroup looks up runqlat_cgidx (cgroup id -> slot); slots come from
//   the queue runqlat_free, which the loader fills and the agent refills when a cgroup is removed.
//   Slot 0 collects cgroups beyond RUNQLAT_MAX_CGROUPS - 1 (reported as "(other)").
// RUNQLAT_SCHED_INFO=0 (fallback): tracepoints sched:sched_wakeup, sched:sched_wakeup_new,
//   sched:sched_switch, no kernel struct read (generic kernel headers are enough). The cgroup of the
//   task that waited is only "current" when that task runs, not when it is woken (current is then
//   the waker) nor at the switch that puts it on the CPU (current is the task going off). So the
//   latency measured at switch-in is parked in the task's entry and charged to
//   bpf_get_current_cgroup_id() at the task's next switch-out, when current is the task itself.
//
// Compile-time parameters (from probes/specs.py, overridable with -D):
//   RUNQLAT_MAX_TASKS    LRU bound on tracked tasks (fallback; a fork storm evicts the oldest)
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
#ifndef RUNQLAT_SCHED_INFO
#define RUNQLAT_SCHED_INFO 0
#endif

struct runqlat_hist {       // the count is the sum of the slots
    u64 sum_ns;
    u64 slots[RUNQLAT_SLOTS];
};

#if RUNQLAT_SCHED_INFO
struct runqlat_seen {
    u64 pcount;       // sched_info.pcount at the task's last switch-out; 0: not seen yet
    u64 run_delay;    // sched_info.run_delay then
    u64 cgid;         // the cgroup whose slot it found last
    u32 slot;
    u32 pad;
};

#define RUNQLAT_AT(type, ptr, off) (*(type *)((char *)(ptr) + (off)))

BPF_TASK_STORAGE(runqlat_seen, struct runqlat_seen);
BPF_HASH(runqlat_cgidx, u64, u32, RUNQLAT_MAX_CGROUPS);
BPF_QUEUE(runqlat_free, u32, RUNQLAT_MAX_CGROUPS);
BPF_PERCPU_ARRAY(runqlat_slots, struct runqlat_hist, RUNQLAT_MAX_CGROUPS);

static __always_inline u32 runqlat_slot_of(u64 cgid)
{
    u32 *found = runqlat_cgidx.lookup(&cgid);
    if (found)
        return *found;
    u32 slot = 0;
    if (runqlat_free.pop(&slot))
        return 0;                              // none free: "(other)"
    if (runqlat_cgidx.insert(&cgid, &slot)) {  // another CPU was first: give ours back
        runqlat_free.push(&slot, 0);
        found = runqlat_cgidx.lookup(&cgid);
        return found ? *found : 0;
    }
    return slot;
}

RAW_TRACEPOINT_PROBE(sched_switch)
{
    struct task_struct *task = bpf_get_current_task_btf();
    if (!RUNQLAT_AT(int, task, RUNQLAT_PID_OFF))    // the idle task: the scheduler does not account it
        return 0;
    struct runqlat_seen *seen = runqlat_seen.task_storage_get(task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
    if (!seen)
        return 0;
    u64 pcount = RUNQLAT_AT(u64, task, RUNQLAT_PCOUNT_OFF);
    u64 run_delay = RUNQLAT_AT(u64, task, RUNQLAT_RUN_DELAY_OFF);
    u64 runs = pcount - seen->pcount;
    u64 waited = run_delay - seen->run_delay;
    u64 first = seen->pcount == 0;
    seen->pcount = pcount;
    seen->run_delay = run_delay;
    // One run per switch-out; more only if a switch-out was missed (then their mean, n times).
    if (first || !runs || runs >= 1024)
        return 0;
    // bpf_get_current_cgroup_id() without the helper call: task->cgroups->dfl_cgrp->kn->id
    void *cset = RUNQLAT_AT(void *, task, RUNQLAT_CGROUPS_OFF);
    void *cgrp = RUNQLAT_AT(void *, cset, RUNQLAT_DFL_CGRP_OFF);
    void *kn = RUNQLAT_AT(void *, cgrp, RUNQLAT_CGRP_KN_OFF);
    u64 cgid = RUNQLAT_AT(u64, kn, RUNQLAT_KN_ID_OFF);
    if (cgid != seen->cgid || !seen->slot) {
        seen->slot = runqlat_slot_of(cgid);
        seen->cgid = cgid;
    }
    u32 slot_idx = seen->slot;
    struct runqlat_hist *h = runqlat_slots.lookup(&slot_idx);
    if (!h)
        return 0;
    u64 each = runs == 1 ? waited : waited / runs;
    u32 b = bpf_log2l(each);
    if (b >= RUNQLAT_SLOTS)
        b = RUNQLAT_SLOTS - 1;
    h->slots[b] += runs;
    h->sum_ns += waited;
    return 0;
}
#else
// sched_switch's prev_state: since Linux 4.14 (commit efb40f588b43, "sched/tracing: Fix trace_sched_switch
// task-state printing") a preempted task reports TASK_REPORT_MAX (0x100) instead of TASK_RUNNING (0);
// any bit below it is a sleeping/stopped state. Runnable == no bit below TASK_REPORT_MAX.
#define RUNQLAT_TASK_REPORT_MAX 0x100

struct runqlat_task {
    u64 enq_ns;   // when it became runnable; 0 while it runs or sleeps
    u64 pend_ns;  // latency measured at switch-in, not yet charged to a cgroup
};

BPF_TABLE("lru_hash", u32, struct runqlat_task, runqlat_tasks, RUNQLAT_MAX_TASKS);
// Per CPU: plain adds, no atomics, no cache line bouncing between CPUs; the agent sums the CPUs.
BPF_TABLE("lru_percpu_hash", u64, struct runqlat_hist, runqlat_hist, RUNQLAT_MAX_CGROUPS);

static __always_inline void runqlat_record(u64 delta_ns)
{
    u64 cgid = bpf_get_current_cgroup_id();
    struct runqlat_hist *h = runqlat_hist.lookup(&cgid);
    if (!h) {
        struct runqlat_hist zero = {};
        runqlat_hist.update(&cgid, &zero);
        h = runqlat_hist.lookup(&cgid);
        if (!h)
            return;
    }
    u32 slot = bpf_log2l(delta_ns);
    if (slot >= RUNQLAT_SLOTS)
        slot = RUNQLAT_SLOTS - 1;
    h->slots[slot] += 1;
    h->sum_ns += delta_ns;
}

static __always_inline void runqlat_enqueue(u32 pid, u64 now)
{
    if (pid == 0)   // the idle task
        return;
    struct runqlat_task zero = {};
    struct runqlat_task *t = runqlat_tasks.lookup_or_try_init(&pid, &zero);
    if (t)
        t->enq_ns = now;
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
#endif
