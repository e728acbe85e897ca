// tcp_rtt: TCP smoothed round-trip time (log2 histogram, ns) per remote address.
//
// tcp:tcp_probe (Linux 4.16+) fires in tcp_rcv_established for every segment an established socket
// receives, data or ACK, with the socket's smoothed RTT as the kernel keeps it (`srtt`, which the
// tracepoint records as tp->srtt_us >> 3: microseconds). Each such segment adds the socket's current
// srtt to the histogram of its remote address, so a busy connection weighs more than an idle one.
// Sockets without an RTT estimate yet (srtt 0) and loopback peers (127.0.0.0/8, ::1, and their
// IPv4-mapped forms) are skipped. The agent maps addresses to regions (a CIDR table in config).
//
// Remote addresses are kept as IPv6 (IPv4 as ::ffff:a.b.c.d) in a plain hash of TCP_RTT_MAX_REMOTES
// entries; a sample of an address that finds it full is counted in tcp_rtt_missed. The agent
// deletes entries that stood still for a round once it has accounted for them.

#ifndef TCP_RTT_MAX_REMOTES
#define TCP_RTT_MAX_REMOTES 4096
#endif
#ifndef TCP_RTT_SLOTS
#define TCP_RTT_SLOTS 40
#endif

#define TCP_RTT_AF_INET 2
#define TCP_RTT_AF_INET6 10

struct tcp_rtt_key {
    u8 addr[16];
};

struct tcp_rtt_hist {
    u64 slots[TCP_RTT_SLOTS];
    u64 sum_ns;
};

// One entry per remote address, shared by all CPUs (a per-CPU value of 328 bytes times the CPUs
// times the entries would be too large): atomic adds.
BPF_HASH(tcp_rtt_remote, struct tcp_rtt_key, struct tcp_rtt_hist, TCP_RTT_MAX_REMOTES);
BPF_PERCPU_ARRAY(tcp_rtt_missed, u64, 1);

TRACEPOINT_PROBE(tcp, tcp_probe)
{
    u32 srtt_us = args->srtt;
    if (srtt_us == 0)
        return 0;
    struct tcp_rtt_key k = {};
    if (args->family == TCP_RTT_AF_INET) {
        // struct sockaddr_in: family (2), port (2), address (4)
        if (args->daddr[4] == 127)
            return 0;
        k.addr[10] = 0xff;
        k.addr[11] = 0xff;
        __builtin_memcpy(&k.addr[12], (const void *)&args->daddr[4], 4);
    } else if (args->family == TCP_RTT_AF_INET6) {
        // struct sockaddr_in6: family (2), port (2), flowinfo (4), address (16)
        __builtin_memcpy(k.addr, (const void *)&args->daddr[8], 16);
        u8 high = 0;    // bytes 0..9 all zero: ::1 or an IPv4-mapped address
#pragma unroll
        for (int i = 0; i < 10; i++)
            high |= k.addr[i];
        if (high == 0 && k.addr[10] == 0 && k.addr[11] == 0 && k.addr[12] == 0 && k.addr[13] == 0
            && k.addr[14] == 0 && k.addr[15] == 1)
            return 0;                               // ::1
        if (high == 0 && k.addr[10] == 0xff && k.addr[11] == 0xff && k.addr[12] == 127)
            return 0;                               // ::ffff:127.x.y.z
    } else {
        return 0;
    }
    u64 ns = (u64)srtt_us * 1000;
    struct tcp_rtt_hist zero = {};
    struct tcp_rtt_hist *h = tcp_rtt_remote.lookup_or_try_init(&k, &zero);
    if (!h) {
        int idx = 0;
        u64 *m = tcp_rtt_missed.lookup(&idx);
        if (m)
            *m += 1;    // per-CPU slot: no atomic needed
        return 0;
    }
    u32 slot = bpf_log2l(ns);
    if (slot >= TCP_RTT_SLOTS)
        slot = TCP_RTT_SLOTS - 1;
    __sync_fetch_and_add(&h->slots[slot], 1);
    __sync_fetch_and_add(&h->sum_ns, ns);
    return 0;
}
