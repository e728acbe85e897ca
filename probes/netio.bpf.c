// netio: network bytes per cgroup v2 (or per interface on older kernels) and TCP retransmits.
//
// NETIO_SOCK=1 (sock:sock_send_length / sock:sock_recv_length, Linux 6.3+, commit 6e6eda44b939):
//   payload bytes that sendmsg/recvmsg returned on IPv4/IPv6 sockets, charged to the cgroup of the
//   calling task (the syscall runs in the task's context). MSG_PEEK reads are not counted.
// NETIO_SOCK=0 (fallback, net:net_dev_xmit / net:netif_receive_skb, all kernels): frame bytes per
//   interface name; the cgroup is unknown there (transmit may run in softirq context).
// tcp:tcp_retransmit_skb (Linux 4.15+) counts retransmitted segments by address family; it fires in
// timer or softirq context, where the current task is not the socket's owner. With
// NETIO_RETRANS_CGROUP=1 (variant sock_cgroup) they are counted per (cgroup, family), the cgroup
// being the socket's own (sk->sk_cgrp_data.cgroup, set when the socket was created or accepted),
// read at offsets from the kernel's BTF (NETIO_SK_CGRP_OFF, NETIO_CGRP_KN_OFF, NETIO_KN_ID_OFF).

#ifndef NETIO_MAX_CGROUPS
#define NETIO_MAX_CGROUPS 4096
#endif
#ifndef NETIO_MAX_DEVICES
#define NETIO_MAX_DEVICES 1024
#endif

#define NETIO_AF_INET 2
#define NETIO_AF_INET6 10
#define NETIO_MSG_PEEK 2

struct netio_bytes {
    u64 tx_bytes;
    u64 rx_bytes;
    u64 tx_calls;
    u64 rx_calls;
};

#ifndef NETIO_RETRANS_CGROUP
#define NETIO_RETRANS_CGROUP 0
#endif

#if NETIO_RETRANS_CGROUP
struct netio_retrans_key {
    u64 cgid;       // the socket's cgroup v2 id; 0 when it could not be read
    u32 family;     // 0: IPv4, 1: IPv6
    u32 pad;
};

BPF_TABLE("lru_hash", struct netio_retrans_key, u64, netio_retrans_cgroup, NETIO_MAX_CGROUPS);

static __always_inline u64 netio_sk_cgroup(const void *sk)
{
    void *cgrp = NULL, *kn = NULL;
    u64 id = 0;
    if (bpf_probe_read_kernel(&cgrp, sizeof(cgrp), (const char *)sk + NETIO_SK_CGRP_OFF) || !cgrp)
        return 0;
    if (bpf_probe_read_kernel(&kn, sizeof(kn), (const char *)cgrp + NETIO_CGRP_KN_OFF) || !kn)
        return 0;
    bpf_probe_read_kernel(&id, sizeof(id), (const char *)kn + NETIO_KN_ID_OFF);
    return id;
}

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)
{
    struct netio_retrans_key k = {};
    k.cgid = netio_sk_cgroup(args->skaddr);
    k.family = args->family == NETIO_AF_INET6 ? 1 : 0;
    u64 zero = 0;
    u64 *v = netio_retrans_cgroup.lookup_or_try_init(&k, &zero);
    if (v)
        __sync_fetch_and_add(v, 1);
    return 0;
}
#else
// index 0: IPv4, 1: IPv6
BPF_PERCPU_ARRAY(netio_retransmits, u64, 2);

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)
{
    int idx = args->family == NETIO_AF_INET6 ? 1 : 0;
    u64 *v = netio_retransmits.lookup(&idx);
    if (v)
        *v += 1;    // per-CPU slot: no atomic needed
    return 0;
}
#endif

#if NETIO_SOCK
BPF_TABLE("lru_hash", u64, struct netio_bytes, netio_cgroup, NETIO_MAX_CGROUPS);

static __always_inline void netio_count(u16 family, int ret, int tx)
{
    if (ret <= 0 || (family != NETIO_AF_INET && family != NETIO_AF_INET6))
        return;
    u64 cgid = bpf_get_current_cgroup_id();
    struct netio_bytes zero = {};
    struct netio_bytes *v = netio_cgroup.lookup_or_try_init(&cgid, &zero);
    if (!v)
        return;
    if (tx) {
        __sync_fetch_and_add(&v->tx_bytes, ret);
        __sync_fetch_and_add(&v->tx_calls, 1);
    } else {
        __sync_fetch_and_add(&v->rx_bytes, ret);
        __sync_fetch_and_add(&v->rx_calls, 1);
    }
}

TRACEPOINT_PROBE(sock, sock_send_length)
{
    netio_count(args->family, args->ret, 1);
    return 0;
}

TRACEPOINT_PROBE(sock, sock_recv_length)
{
    if (args->flags & NETIO_MSG_PEEK)
        return 0;
    netio_count(args->family, args->ret, 0);
    return 0;
}
#else
struct netio_dev_key {
    char name[16];   // IFNAMSIZ
};

BPF_HASH(netio_device, struct netio_dev_key, struct netio_bytes, NETIO_MAX_DEVICES);

static __always_inline void netio_dev_count(struct netio_dev_key *k, u32 len, int tx)
{
    struct netio_bytes zero = {};
    struct netio_bytes *v = netio_device.lookup_or_try_init(k, &zero);
    if (!v)
        return;
    if (tx) {
        __sync_fetch_and_add(&v->tx_bytes, len);
        __sync_fetch_and_add(&v->tx_calls, 1);
    } else {
        __sync_fetch_and_add(&v->rx_bytes, len);
        __sync_fetch_and_add(&v->rx_calls, 1);
    }
}

TRACEPOINT_PROBE(net, net_dev_xmit)
{
    if (args->rc != 0)   // NETDEV_TX_OK
        return 0;
    struct netio_dev_key k = {};
    TP_DATA_LOC_READ_CONST(k.name, name, sizeof(k.name));
    netio_dev_count(&k, args->len, 1);
    return 0;
}

TRACEPOINT_PROBE(net, netif_receive_skb)
{
    struct netio_dev_key k = {};
    TP_DATA_LOC_READ_CONST(k.name, name, sizeof(k.name));
    netio_dev_count(&k, args->len, 0);
    return 0;
}
#endif
