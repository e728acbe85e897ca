// tc_traffic: ingress and egress bytes and packets per interface, from a clsact SCHED_CLS program
// that only counts: it always returns TC_ACT_OK, so every packet passes unchanged.
//
// skb->len is the frame length including the link-layer header at both hooks (cls_bpf pushes the
// MAC header back before running an ingress program), the same figure as the interface's
// IFLA_STATS64 tx/rx bytes. Interfaces are keyed by ifindex, which is unique only within one network
// namespace: one agent instance attaches in one namespace (config tc_netns).

#ifndef TC_TRAFFIC_MAX_IFACES
#define TC_TRAFFIC_MAX_IFACES 1024
#endif

#define TC_TRAFFIC_ACT_OK 0   // TC_ACT_OK, include/uapi/linux/pkt_cls.h
#define TC_TRAFFIC_INGRESS 0
#define TC_TRAFFIC_EGRESS 1

struct tc_traffic_key {
    u32 ifindex;
    u32 dir;
};

struct tc_traffic_val {
    u64 bytes;
    u64 packets;
};

// Per-CPU: no atomics, no cache-line bouncing between CPUs on the packet path.
BPF_TABLE("percpu_hash", struct tc_traffic_key, struct tc_traffic_val, tc_traffic, TC_TRAFFIC_MAX_IFACES);

static __always_inline void tc_traffic_count(struct __sk_buff *skb, u32 dir)
{
    struct tc_traffic_key k = {.ifindex = skb->ifindex, .dir = dir};
    struct tc_traffic_val zero = {};
    struct tc_traffic_val *v = tc_traffic.lookup_or_try_init(&k, &zero);
    if (v) {
        v->bytes += skb->len;
        v->packets += 1;
    }
}

int tc_traffic_ingress(struct __sk_buff *skb)
{
    tc_traffic_count(skb, TC_TRAFFIC_INGRESS);
    return TC_TRAFFIC_ACT_OK;
}

int tc_traffic_egress(struct __sk_buff *skb)
{
    tc_traffic_count(skb, TC_TRAFFIC_EGRESS);
    return TC_TRAFFIC_ACT_OK;
}
