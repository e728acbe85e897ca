/* Simulated agents for bench/collector_ingest.py and bench/fleet_scale.py, in C (libnghttp2, epoll).

   Why: on a 2-CPU machine the bench's Python load generator (grpc aio) spent ~470 us of CPU a batch,
   as much as the collector it measured; at 2,000 agents its own core was full and its delays were
   in the latency figure. This one does the same thing per agent at a fraction of the CPU:
   - every agent its own TCP connection and HTTP/2 session, one Ingest stream
     (POST /xpusense.v1.Ingest/Stream, gRPC framing), a keepalive PING every keepalive_ms, as the
     agent's channel (common/tls.py CHANNEL_OPTIONS), no BDP probing (as the agent);
   - Hello, then wait for the Welcome (at most 32 handshakes in flight, 5 attempts with backoff);
   - then batches on a fixed schedule (rate per agent, a phase per agent), at most `window` in
     flight; rate 0: as fast as acks allow. A batch's bytes are the Python generator's own template
     (SimAgent: protobuf's serialization cut where values and times go), filled in as next_batch()
     does: gauges (base + seq % 17) / 100 (base / 100 when idle; base a whole percentage), counters
     += step (whole numbers), every sample's
     time and sent_unix_nano = CLOCK_REALTIME now (the latency's start);
   - latency = the Ack's arrival (CLOCK_REALTIME) - the batch's time, as the Python generator.

   Protocol with the parent (bench/load_agents.py):
     argv: PLAN_FILE            the agents (written by the parent; format in load_plan below)
     stdout line 1:             {"ready": n, "fails": [...], "retries": r, "codes": [...]}
     stdin line:                "go GO T0 T1" (CLOCK_MONOTONIC seconds, as Python's time.monotonic)
                                or "stop" (the parent gave up)
     stdout line 2:             the results as JSON (the Python worker's out_q dict)
   With "compact 1" in the plan, the agents speak the compact encoding (common/compact.py): the
   Hello offers it, the Welcome must choose it, a SeriesTable (the plan's S line) goes first, and a
   batch's samples are zlib-compressed columns (refs 1..N, one time, the values in sample order),
   as SimAgent builds them in Python (zlib's compress2 at level 6 = Python's zlib.compress(data, 6)).
   With "compact 2", chained (common/compact_chain.py): each block after an agent's first deflated
   with its block before as zlib's preset dictionary.
   argv: PLAN_FILE --dump K NOW_NS: agent 0's next K batches (AgentMessage bytes, hex, a line each)
   with every time = NOW_NS, for the test that holds them equal to the Python generator's. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <nghttp2/nghttp2.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#define CONNECT_ATTEMPTS 5
#define CONNECTS_IN_FLIGHT 32
#define DRAIN_S 15.0
#define MAX_FAILS 64

enum { ST_IDLE, ST_CONNECTING, ST_HELLO, ST_READY, ST_DONE, ST_FAILED };

typedef struct {
    char *node_id;
    double phase_s;
    int idle;
    uint8_t *hello; size_t hello_len;
    uint8_t *head; size_t head_len;           /* Batch{node_id, boot_id} */
    uint8_t *body; size_t body_len;           /* the samples, values and times filled in per batch */
    int nv; size_t *v_off; char *v_kind; double *v_val, *v_arg;   /* g: arg = base; c: arg = step */
    int nt; size_t *t_off;
    uint8_t *table; size_t table_len;         /* compact: AgentMessage{series} */
    int *order;                               /* compact: the V entries in sample order */
    uint8_t *raw, *z; size_t raw_len, z_cap;  /* compact: the columns, and compressed */
    uint8_t *prev;                            /* compact 2: the block before, inflated */
    /* connection */
    int fd, state, attempts;
    nghttp2_session *s;
    int32_t sid;
    uint8_t *out; size_t out_len, out_off, out_cap;   /* request body not yet taken by nghttp2 */
    uint8_t *wbuf; size_t wlen, wcap;                 /* bytes nghttp2 made that the socket refused */
    uint8_t *in; size_t in_len, in_cap;               /* response body: gRPC frames */
    int want_out, closing;
    char grpc_status[16], grpc_message[160];
    double last_ping;
    /* sending */
    uint64_t seq;
    int64_t *sent_ns; uint64_t *sent_seq;   /* ring of window+1, by seq */
    int inflight, blocked, done_sending;
    long acked, window_acked, duplicates, sent;
} agent_t;

static agent_t *agents;
static int compact_mode;
static int n_agents, window_ = 8, keepalive_ms = 10000, port;
static double rate;
static char host[64];
static int ep;
static double go_t = -1, t0_t, t1_t;
static int handshaking, ready_n, retries;
static char *fails[MAX_FAILS]; static int n_fails, fails_total;
static char codes[512];
/* latencies */
static double *win_lat; static size_t win_n, win_cap;
typedef struct { double *v; size_t n, cap; } dvec;
static dvec *by_sec; static int n_sec;

static double mono(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
static int64_t real_ns(void) { struct timespec t; clock_gettime(CLOCK_REALTIME, &t); return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec; }

static void die(const char *what) { fprintf(stderr, "ingest_agents: %s\n", what); exit(2); }
static void *xmalloc(size_t n) { void *p = malloc(n ? n : 1); if (!p) die("out of memory"); return p; }
static void grow(uint8_t **b, size_t *cap, size_t need) {
    if (need <= *cap) return;
    size_t c = *cap ? *cap : 4096;
    while (c < need) c *= 2;
    *b = realloc(*b, c);
    if (!*b) die("out of memory");
    *cap = c;
}
static void dpush(dvec *d, double x) {
    if (d->n == d->cap) { d->cap = d->cap ? d->cap * 2 : 256; d->v = realloc(d->v, d->cap * sizeof(double)); if (!d->v) die("out of memory"); }
    d->v[d->n++] = x;
}

static void fail(agent_t *a, const char *why) {   /* "NODE: why", the first MAX_FAILS kept */
    fails_total++;
    if (n_fails < MAX_FAILS) {
        size_t n = strlen(a->node_id) + strlen(why) + 3;
        fails[n_fails] = xmalloc(n);
        snprintf(fails[n_fails++], n, "%s: %s", a->node_id, why);
    }
}

/* -- the plan ------------------------------------------------------------------------------------ */
static uint8_t *unhex(const char *h, size_t *len) {
    size_t n = strlen(h) / 2;
    uint8_t *b = xmalloc(n);
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(h + 2 * i, "%2x", &v) != 1) die("plan: bad hex");
        b[i] = (uint8_t)v;
    }
    *len = n;
    return b;
}

/* Lines: "host H", "port P", "rate R", "window W", "keepalive_ms K", "agents N", then per agent
   "A NODE PHASE_S IDLE HELLO_HEX HEAD_HEX BODY_HEX NV NT", NV lines "V OFFSET g|c VALUE ARG"
   (doubles as Python's repr), one line "T OFF OFF ..." (NT offsets of 9-byte time varints). */
static void load_plan(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) die("cannot open the plan");
    char *line = NULL; size_t cap = 0; ssize_t got;
    int k = -1;
    while ((got = getline(&line, &cap, f)) > 0) {
        if (line[got - 1] == '\n') line[got - 1] = 0;
        char *save, *tok = strtok_r(line, " ", &save);
        if (!tok) continue;
        if (!strcmp(tok, "host")) snprintf(host, sizeof host, "%s", strtok_r(NULL, " ", &save));
        else if (!strcmp(tok, "port")) port = atoi(strtok_r(NULL, " ", &save));
        else if (!strcmp(tok, "rate")) rate = strtod(strtok_r(NULL, " ", &save), NULL);
        else if (!strcmp(tok, "window")) window_ = atoi(strtok_r(NULL, " ", &save));
        else if (!strcmp(tok, "keepalive_ms")) keepalive_ms = atoi(strtok_r(NULL, " ", &save));
        else if (!strcmp(tok, "compact")) compact_mode = atoi(strtok_r(NULL, " ", &save));
        else if (!strcmp(tok, "S")) {
            if (k < 0) die("plan: S line before an agent");
            agents[k].table = unhex(strtok_r(NULL, " ", &save), &agents[k].table_len);
        }
        else if (!strcmp(tok, "agents")) { n_agents = atoi(strtok_r(NULL, " ", &save)); agents = calloc(n_agents, sizeof(agent_t)); }
        else if (!strcmp(tok, "A")) {
            if (++k >= n_agents) die("plan: more agents than announced");
            agent_t *a = &agents[k];
            a->node_id = strdup(strtok_r(NULL, " ", &save));
            a->phase_s = strtod(strtok_r(NULL, " ", &save), NULL);
            a->idle = atoi(strtok_r(NULL, " ", &save));
            a->hello = unhex(strtok_r(NULL, " ", &save), &a->hello_len);
            a->head = unhex(strtok_r(NULL, " ", &save), &a->head_len);
            a->body = unhex(strtok_r(NULL, " ", &save), &a->body_len);
            a->nv = atoi(strtok_r(NULL, " ", &save));
            a->nt = atoi(strtok_r(NULL, " ", &save));
            a->v_off = xmalloc(a->nv * sizeof(size_t)); a->v_kind = xmalloc(a->nv);
            a->v_val = xmalloc(a->nv * sizeof(double)); a->v_arg = xmalloc(a->nv * sizeof(double));
            a->t_off = xmalloc(a->nt * sizeof(size_t));
            for (int i = 0; i < a->nv; i++) {
                if ((got = getline(&line, &cap, f)) <= 0) die("plan: missing V line");
                char kind;
                if (sscanf(line, "V %zu %c %lf %lf", &a->v_off[i], &kind, &a->v_val[i], &a->v_arg[i]) != 4) die("plan: bad V line");
                a->v_kind[i] = kind;
                if (a->v_off[i] + 8 > a->body_len) die("plan: value offset past the body");
            }
            if ((got = getline(&line, &cap, f)) <= 0 || line[0] != 'T') die("plan: missing T line");
            char *p = line + 1;
            for (int i = 0; i < a->nt; i++) {
                a->t_off[i] = strtoul(p, &p, 10);
                if (a->t_off[i] + 9 > a->body_len) die("plan: time offset past the body");
            }
            a->sent_ns = xmalloc((window_ + 1) * sizeof(int64_t));
            a->sent_seq = calloc(window_ + 1, sizeof(uint64_t));
            a->fd = -1;
        }
    }
    free(line);
    fclose(f);
    if (k + 1 != n_agents || !port) die("plan: incomplete");
}

/* -- batches -------------------------------------------------------------------------------------- */
static size_t put_varint(uint8_t *p, uint64_t v) {
    size_t n = 0;
    while (v >= 0x80) { p[n++] = (uint8_t)(v | 0x80); v >>= 7; }
    p[n++] = (uint8_t)v;
    return n;
}

static const agent_t *sorting;
static int by_offset(const void *x, const void *y) {
    size_t a = sorting->v_off[*(const int *)x], b = sorting->v_off[*(const int *)y];
    return a < b ? -1 : a > b;
}

static void put_le(uint8_t *p, uint64_t v, int n) { for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i)); }

/* compact: the columns (version 1, n samples, first time, ref deltas, time deltas, values, no
   histograms) compressed into a->z; returns the compressed length. */
static size_t compact_columns(agent_t *a, int64_t now, double wobble) {
    size_t n = a->nv;
    if (!a->order) {
        a->order = xmalloc(n * sizeof(int));
        for (size_t i = 0; i < n; i++) a->order[i] = (int)i;
        sorting = a;
        qsort(a->order, n, sizeof(int), by_offset);
        a->raw_len = 13 + 20 * n + 4;
        a->raw = calloc(a->raw_len, 1);
        if (!a->raw) die("out of memory");
        a->raw[0] = 1;
        put_le(a->raw + 1, n, 4);
        for (size_t i = 0; i < n; i++) put_le(a->raw + 13 + 4 * i, 1, 4);   /* refs 1, 2, ... as deltas */
        a->z_cap = compressBound(a->raw_len);
        a->z = xmalloc(a->z_cap);
    }
    put_le(a->raw + 5, (uint64_t)now, 8);
    uint8_t *vals = a->raw + 13 + 12 * n;
    for (size_t k = 0; k < n; k++) {
        int i = a->order[k];
        double v = a->v_kind[i] == 'c' ? (a->v_val[i] += a->v_arg[i]) : (a->v_arg[i] + wobble) / 100.0;
        memcpy(vals + 8 * k, &v, 8);
    }
    uLongf zl = a->z_cap;
    if (compact_mode == 2 && a->prev) {   /* chained: on the block before */
        static z_stream z;
        static int z_ready;
        if (!z_ready && deflateInit2(&z, 6, Z_DEFLATED, 15, 8, Z_DEFAULT_STRATEGY) != Z_OK) die("zlib deflateInit2 failed");
        z_ready = 1;
        if (deflateReset(&z) != Z_OK || deflateSetDictionary(&z, a->prev, a->raw_len) != Z_OK) die("zlib dictionary failed");
        z.next_in = a->raw; z.avail_in = a->raw_len; z.next_out = a->z; z.avail_out = a->z_cap;
        if (deflate(&z, Z_FINISH) != Z_STREAM_END) die("zlib deflate failed");
        zl = a->z_cap - z.avail_out;
    } else if (compress2(a->z, &zl, a->raw, a->raw_len, 6) != Z_OK) {
        die("zlib compress2 failed");
    }
    if (compact_mode == 2) {
        if (!a->prev) a->prev = xmalloc(a->raw_len);
        memcpy(a->prev, a->raw, a->raw_len);
    }
    return zl;
}

/* A batch of the pieces given (after Batch{node_id, boot_id}) as a gRPC message (5-byte prefix +
   AgentMessage{batch}) appended to buf, and its send time kept for the latency. */
static void emit(agent_t *a, int64_t now, uint8_t **buf, size_t *len, size_t *cap, int n,
                 const uint8_t *const *parts, const size_t *sizes) {
    size_t blen = a->head_len;
    for (int i = 0; i < n; i++) blen += sizes[i];
    uint8_t pre[12]; size_t pn = 0;
    pre[pn++] = 0x12; pn += put_varint(pre + pn, blen);               /* AgentMessage.batch = 2 */
    size_t mlen = pn + blen;
    grow(buf, cap, *len + 5 + mlen);
    uint8_t *p = *buf + *len;
    p[0] = 0; p[1] = mlen >> 24; p[2] = mlen >> 16; p[3] = mlen >> 8; p[4] = mlen;
    p += 5;
    memcpy(p, pre, pn); p += pn;
    memcpy(p, a->head, a->head_len); p += a->head_len;
    for (int i = 0; i < n; i++) { memcpy(p, parts[i], sizes[i]); p += sizes[i]; }
    *len += 5 + mlen;
    a->sent_seq[a->seq % (window_ + 1)] = a->seq;
    a->sent_ns[a->seq % (window_ + 1)] = now;
}

/* The next batch as a gRPC message appended to buf. */
static void next_batch(agent_t *a, int64_t now, uint8_t **buf, size_t *len, size_t *cap) {
    a->seq++;
    double wobble = a->idle ? 0.0 : (double)(a->seq % 17);
    if (compact_mode) {
        size_t zl = compact_columns(a, now, wobble);
        uint8_t mid[32]; size_t mn = 0;
        mid[mn++] = 0x18; mn += put_varint(mid + mn, a->seq);          /* Batch.seq = 3 */
        mid[mn++] = 0x30; mn += put_varint(mid + mn, (uint64_t)now);   /* Batch.sent_unix_nano = 6 */
        mid[mn++] = 0x3a; mn += put_varint(mid + mn, zl);              /* Batch.columns = 7 */
        const uint8_t *parts[] = {mid, a->z};
        size_t sizes[] = {mn, zl};
        emit(a, now, buf, len, cap, 2, parts, sizes);
        return;
    }
    uint8_t t[10];
    size_t tn = put_varint(t, (uint64_t)now);
    if (tn != 9) die("a time that is not a 9-byte varint");
    for (int i = 0; i < a->nv; i++) {
        double v = a->v_kind[i] == 'c' ? (a->v_val[i] += a->v_arg[i]) : (a->v_arg[i] + wobble) / 100.0;
        memcpy(a->body + a->v_off[i], &v, 8);   /* little-endian double, as protobuf */
    }
    for (int i = 0; i < a->nt; i++) memcpy(a->body + a->t_off[i], t, 9);
    uint8_t seqb[12], tail[12];
    size_t sn = 0, tl = 0;
    seqb[sn++] = 0x18; sn += put_varint(seqb + sn, a->seq);           /* Batch.seq = 3 */
    tail[tl++] = 0x30; tl += put_varint(tail + tl, (uint64_t)now);    /* Batch.sent_unix_nano = 6 */
    const uint8_t *parts[] = {seqb, a->body, tail};
    size_t sizes[] = {sn, a->body_len, tl};
    emit(a, now, buf, len, cap, 3, parts, sizes);
}

/* -- HTTP/2 -------------------------------------------------------------------------------------- */
static void want_out(agent_t *a, int on) {
    if (a->want_out == on || a->fd < 0) return;
    struct epoll_event ev = {.events = EPOLLIN | (on ? EPOLLOUT : 0), .data.ptr = a};
    epoll_ctl(ep, EPOLL_CTL_MOD, a->fd, &ev);
    a->want_out = on;
}

static void drop_conn(agent_t *a) {
    if (a->s) { nghttp2_session_del(a->s); a->s = NULL; }
    if (a->fd >= 0) { epoll_ctl(ep, EPOLL_CTL_DEL, a->fd, NULL); close(a->fd); a->fd = -1; }
    a->out_len = a->out_off = a->wlen = a->in_len = 0;
    a->want_out = 0;
}

/* Write what nghttp2 has to send, in one send() (frames gathered first, as grpc's transport writes
   them: a batch's HEADERS/DATA/PING frames in one segment, not one each); what the socket refuses
   waits in wbuf for EPOLLOUT. */
static int flush(agent_t *a) {
    if (!a->wlen) {
        for (;;) {
            const uint8_t *data;
            ssize_t n = nghttp2_session_mem_send(a->s, &data);
            if (n < 0) return -1;
            if (n == 0) break;
            grow(&a->wbuf, &a->wcap, a->wlen + n);
            memcpy(a->wbuf + a->wlen, data, n);
            a->wlen += n;
        }
    }
    while (a->wlen) {
        ssize_t n = send(a->fd, a->wbuf, a->wlen, MSG_NOSIGNAL);
        if (n < 0) { if (errno == EAGAIN) { want_out(a, 1); return 0; } return -1; }
        memmove(a->wbuf, a->wbuf + n, a->wlen - n);
        a->wlen -= n;
        if (!a->wlen && nghttp2_session_want_write(a->s)) return flush(a);
    }
    want_out(a, 0);
    return 0;
}

static ssize_t body_read(nghttp2_session *s, int32_t sid, uint8_t *buf, size_t len, uint32_t *flags,
                         nghttp2_data_source *src, void *ud) {
    (void)s; (void)sid; (void)ud;
    agent_t *a = src->ptr;
    size_t avail = a->out_len - a->out_off;
    if (!avail) {
        if (a->closing) { *flags |= NGHTTP2_DATA_FLAG_EOF; return 0; }
        return NGHTTP2_ERR_DEFERRED;
    }
    size_t n = avail < len ? avail : len;
    memcpy(buf, a->out + a->out_off, n);
    a->out_off += n;
    if (a->out_off == a->out_len) a->out_off = a->out_len = 0;
    return (ssize_t)n;
}

static void queue_out(agent_t *a) {   /* new bytes in a->out: let nghttp2 take them */
    if (a->s && a->sid > 0) nghttp2_session_resume_data(a->s, a->sid);
}

static uint64_t get_varint(const uint8_t **p, const uint8_t *end) {
    uint64_t v = 0; int sh = 0;
    while (*p < end && sh < 64) { uint8_t b = *(*p)++; v |= (uint64_t)(b & 0x7f) << sh; if (!(b & 0x80)) return v; sh += 7; }
    return v;
}

static void send_one(agent_t *a);
static int in_recv;   /* inside nghttp2_session_mem_recv */

static void on_ack(agent_t *a, uint64_t seq, int dup) {
    int64_t now_ns = real_ns();
    double now = mono();
    size_t slot = seq % (window_ + 1);
    int known = a->sent_seq[slot] == seq;
    if (known) a->sent_seq[slot] = 0;
    if (dup) a->duplicates++;
    else {
        a->acked++;
        if (known) {
            double ms = (now_ns - a->sent_ns[slot]) / 1e6;
            int sec = (int)(now - go_t);
            if (sec >= 0 && sec < n_sec) dpush(&by_sec[sec], ms);
            if (now >= t0_t && now < t1_t) { a->window_acked++; if (win_n == win_cap) { win_cap = win_cap ? win_cap * 2 : 65536; win_lat = realloc(win_lat, win_cap * sizeof(double)); } win_lat[win_n++] = ms; }
        } else if (now >= t0_t && now < t1_t) a->window_acked++;
    }
    if (a->inflight > 0) a->inflight--;
    if (a->blocked && !a->done_sending) { a->blocked = 0; send_one(a); }
    else if (rate == 0 && !a->done_sending && go_t > 0) send_one(a);
}

/* gRPC frames of the response body: Welcome (field 2) and Ack (field 1: seq 2, duplicate 3). */
static void parse_in(agent_t *a) {
    size_t off = 0;
    while (a->in_len - off >= 5) {
        const uint8_t *f = a->in + off;
        size_t mlen = ((size_t)f[1] << 24) | ((size_t)f[2] << 16) | ((size_t)f[3] << 8) | f[4];
        if (a->in_len - off < 5 + mlen) break;
        const uint8_t *p = f + 5, *end = p + mlen;
        while (p < end) {
            uint64_t key = get_varint(&p, end);
            int field = key >> 3, wt = key & 7;
            if (wt == 0) { get_varint(&p, end); continue; }
            if (wt != 2) break;
            uint64_t l = get_varint(&p, end);
            const uint8_t *q = p, *qe = p + l;
            p = qe;
            if (field == 2 && a->state == ST_HELLO) {
                a->state = ST_READY; handshaking--; ready_n++;
                if (compact_mode) {   /* the series' definitions before the first batch */
                    grow(&a->out, &a->out_cap, a->out_len + 5 + a->table_len);
                    uint8_t *t = a->out + a->out_len;
                    t[0] = 0; t[1] = a->table_len >> 24; t[2] = a->table_len >> 16; t[3] = a->table_len >> 8;
                    t[4] = a->table_len;
                    memcpy(t + 5, a->table, a->table_len);
                    a->out_len += 5 + a->table_len;
                    queue_out(a);
                }
            } else if (field == 1) {
                uint64_t seq = 0; int dup = 0;
                while (q < qe) {
                    uint64_t k2 = get_varint(&q, qe);
                    if ((k2 & 7) == 2) { q += get_varint(&q, qe); continue; }
                    uint64_t v = get_varint(&q, qe);
                    if ((k2 >> 3) == 2) seq = v; else if ((k2 >> 3) == 3) dup = (int)v;
                }
                on_ack(a, seq, dup);
            }
        }
        off += 5 + mlen;
    }
    memmove(a->in, a->in + off, a->in_len - off);
    a->in_len -= off;
}

static int on_data(nghttp2_session *s, uint8_t flags, int32_t sid, const uint8_t *data, size_t len, void *ud) {
    (void)s; (void)flags; (void)sid;
    agent_t *a = ud;
    grow(&a->in, &a->in_cap, a->in_len + len);
    memcpy(a->in + a->in_len, data, len);
    a->in_len += len;
    parse_in(a);
    return 0;
}

static int on_header(nghttp2_session *s, const nghttp2_frame *fr, const uint8_t *name, size_t nl,
                     const uint8_t *value, size_t vl, uint8_t flags, void *ud) {
    (void)s; (void)fr; (void)flags;
    agent_t *a = ud;
    if (nl == 11 && !memcmp(name, "grpc-status", 11)) snprintf(a->grpc_status, sizeof a->grpc_status, "%.*s", (int)vl, value);
    if (nl == 12 && !memcmp(name, "grpc-message", 12)) snprintf(a->grpc_message, sizeof a->grpc_message, "%.*s", (int)vl, value);
    return 0;
}

static void retry_or_fail(agent_t *a, const char *why);

static int on_close(nghttp2_session *s, int32_t sid, uint32_t err, void *ud) {
    (void)s; (void)sid; (void)err;
    agent_t *a = ud;
    if (a->state == ST_DONE) return 0;
    char why[300];
    snprintf(why, sizeof why, "stream closed (grpc-status %s %s)", a->grpc_status[0] ? a->grpc_status : "none", a->grpc_message);
    a->closing = 2;   /* handled after nghttp2 returns */
    if (a->state == ST_HELLO) retry_or_fail(a, why);
    else { fail(a, why); a->state = ST_FAILED; }
    return 0;
}

static nghttp2_session_callbacks *cbs;

static int start_stream(agent_t *a) {
    if (nghttp2_session_client_new(&a->s, cbs, a)) return -1;
    nghttp2_settings_entry iv[] = {{NGHTTP2_SETTINGS_ENABLE_PUSH, 0}, {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 4194304}};
    nghttp2_submit_settings(a->s, NGHTTP2_FLAG_NONE, iv, 2);
    char authority[96];
    snprintf(authority, sizeof authority, "%s:%d", host, port);
#define H(n, v) {(uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, strlen(v), NGHTTP2_NV_FLAG_NONE}
    nghttp2_nv hdrs[] = {H(":method", "POST"), H(":scheme", "http"), H(":path", "/xpusense.v1.Ingest/Stream"),
                         H(":authority", authority), H("content-type", "application/grpc"), H("te", "trailers"),
                         H("user-agent", "xpusense-bench-loadgen")};
    nghttp2_data_provider dp = {.source.ptr = a, .read_callback = body_read};
    a->grpc_status[0] = a->grpc_message[0] = 0;
    a->closing = 0;
    a->out_len = a->out_off = 0;
    grow(&a->out, &a->out_cap, 5 + a->hello_len);
    uint8_t *p = a->out;
    p[0] = 0; p[1] = a->hello_len >> 24; p[2] = a->hello_len >> 16; p[3] = a->hello_len >> 8; p[4] = a->hello_len;
    memcpy(p + 5, a->hello, a->hello_len);
    a->out_len = 5 + a->hello_len;
    a->sid = nghttp2_submit_request(a->s, NULL, hdrs, sizeof hdrs / sizeof hdrs[0], &dp, a);
    a->last_ping = mono();
    return a->sid > 0 ? flush(a) : -1;
}

/* -- connecting ------------------------------------------------------------------------------------ */
static int connect_one(agent_t *a) {   /* 0, or the errno that refused it at once */
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, host, &sa.sin_addr);
    a->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (a->fd < 0) return errno;
    int one = 1;
    setsockopt(a->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(a->fd, (struct sockaddr *)&sa, sizeof sa) < 0 && errno != EINPROGRESS) {
        int e = errno;
        close(a->fd);
        a->fd = -1;
        return e;
    }
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.ptr = a};
    epoll_ctl(ep, EPOLL_CTL_ADD, a->fd, &ev);
    a->want_out = 1;
    a->state = ST_CONNECTING;
    handshaking++;
    return 0;
}

/* retry timers: due time per agent (0: none) */
static double *retry_at;

static void retry_or_fail(agent_t *a, const char *why) {
    if (a->state == ST_CONNECTING || a->state == ST_HELLO) handshaking--;
    if (++a->attempts >= CONNECT_ATTEMPTS) { fail(a, why); a->state = ST_FAILED; }
    else {
        retries++;
        if (strlen(codes) + strlen(why) + 4 < sizeof codes && !strstr(codes, why)) {
            if (codes[0]) strcat(codes, "|");
            strncat(codes, why, 60);
        }
        a->state = ST_IDLE;
        retry_at[a - agents] = mono() + (0.1 + 0.1 * drand48()) * (1 << (a->attempts - 1));
    }
    a->closing = 2;
}

static void on_io(agent_t *a, uint32_t ev) {
    if (a->state == ST_CONNECTING) {
        int err = 0; socklen_t l = sizeof err;
        getsockopt(a->fd, SOL_SOCKET, SO_ERROR, &err, &l);
        if (err || (ev & (EPOLLERR | EPOLLHUP))) { retry_or_fail(a, err ? strerror(err) : "connect failed"); drop_conn(a); return; }
        if (!(ev & EPOLLOUT)) return;
        a->state = ST_HELLO;
        if (start_stream(a)) { retry_or_fail(a, "could not start the stream"); drop_conn(a); }
        return;
    }
    if (ev & EPOLLIN) {
        uint8_t buf[65536];
        for (;;) {
            ssize_t n = recv(a->fd, buf, sizeof buf, 0);
            if (n > 0) {
                in_recv = 1;
                ssize_t used = nghttp2_session_mem_recv(a->s, buf, n);
                in_recv = 0;
                if (used < 0) { n = 0; }
                else if (a->closing == 2) break;
                else continue;
            }
            if (n < 0 && errno == EAGAIN) break;
            /* EOF or error */
            if (a->state == ST_HELLO) retry_or_fail(a, "connection closed before the Welcome");
            else if (a->state == ST_READY) { fail(a, "connection closed by the collector"); a->state = ST_FAILED; }
            a->closing = 2;
            break;
        }
    }
    if (a->closing == 2) { drop_conn(a); return; }
    if ((ev & EPOLLOUT) || nghttp2_session_want_write(a->s)) {
        if (flush(a)) {
            if (a->state == ST_HELLO) retry_or_fail(a, "write failed");
            else if (a->state == ST_READY) { fail(a, "write failed"); a->state = ST_FAILED; }
            drop_conn(a);
        }
    }
}

/* -- the schedule ---------------------------------------------------------------------------------- */
typedef struct { double due; int i; } tev;
static tev *heap; static int heap_n;
static void hpush(double due, int i) {
    int k = heap_n++;
    while (k > 0) { int p = (k - 1) / 2; if (heap[p].due <= due) break; heap[k] = heap[p]; k = p; }
    heap[k].due = due; heap[k].i = i;
}
static tev hpop(void) {
    tev top = heap[0], last = heap[--heap_n];
    int k = 0;
    for (;;) {
        int c = 2 * k + 1;
        if (c >= heap_n) break;
        if (c + 1 < heap_n && heap[c + 1].due < heap[c].due) c++;
        if (heap[c].due >= last.due) break;
        heap[k] = heap[c]; k = c;
    }
    if (heap_n) heap[k] = last;
    return top;
}

static void send_one(agent_t *a) {
    if (a->state != ST_READY || mono() >= t1_t) { a->done_sending = 1; return; }
    if (a->inflight >= window_) { a->blocked = 1; return; }
    next_batch(a, real_ns(), &a->out, &a->out_len, &a->out_cap);
    a->inflight++;
    a->sent++;
    queue_out(a);
    if (in_recv) return;   /* nghttp2 may not send from its own callbacks: on_io flushes after */
    if (flush(a)) { fail(a, "write failed"); a->state = ST_FAILED; drop_conn(a); }
}

static void finish(agent_t *a) {   /* done sending and drained: end the stream, close */
    if (a->state != ST_READY) return;
    a->state = ST_DONE;
    if (a->s) {
        a->closing = 1;
        queue_out(a);
        flush(a);
    }
    drop_conn(a);
}

/* -- output ------------------------------------------------------------------------------------- */
static void print_json_str(const char *s) {
    putchar('"');
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') { putchar('\\'); putchar(*s); }
        else if ((unsigned char)*s < 0x20) printf("\\u%04x", *s);
        else putchar(*s);
    }
    putchar('"');
}

static void print_ready(void) {
    printf("{\"ready\": %d, \"retries\": %d, \"codes\": [", ready_n, retries);
    char *save, *c = strtok_r(codes, "|", &save);
    for (int first = 1; c; c = strtok_r(NULL, "|", &save), first = 0) { if (!first) printf(", "); print_json_str(c); }
    printf("], \"fails\": [");
    for (int i = 0; i < n_fails; i++) { if (i) printf(", "); print_json_str(fails[i]); }
    printf("]}\n");
    fflush(stdout);
    for (int i = 0; i < n_fails; i++) free(fails[i]);
    n_fails = 0;
}

static void print_results(void) {
    long acked = 0, wacked = 0, dup = 0, sent = 0;
    for (int i = 0; i < n_agents; i++) { acked += agents[i].acked; wacked += agents[i].window_acked; dup += agents[i].duplicates; sent += agents[i].sent; }
    printf("{\"acked\": %ld, \"window_acked\": %ld, \"duplicates\": %ld, \"sent\": %ld, \"latencies_ms\": [", acked, wacked, dup, sent);
    for (size_t i = 0; i < win_n; i++) printf(i ? ",%.3f" : "%.3f", win_lat[i]);
    printf("], \"by_second\": {");
    int first = 1;
    for (int s = 0; s < n_sec; s++) {
        if (!by_sec[s].n) continue;
        printf(first ? "\"%d\": [" : ", \"%d\": [", s);
        first = 0;
        for (size_t i = 0; i < by_sec[s].n; i++) printf(i ? ",%.3f" : "%.3f", by_sec[s].v[i]);
        printf("]");
    }
    printf("}, \"fails\": [");
    for (int i = 0; i < n_fails; i++) { if (i) printf(", "); print_json_str(fails[i]); }
    if (fails_total > n_fails) printf("%s\"... and %d more\"", n_fails ? ", " : "", fails_total - n_fails);
    printf("]}\n");
    fflush(stdout);
}

/* -- main --------------------------------------------------------------------------------------- */
int main(int argc, char **argv) {
    if (argc < 2) die("usage: ingest_agents PLAN [--dump K NOW_NS]");
    load_plan(argv[1]);
    if (argc == 5 && !strcmp(argv[2], "--dump")) {
        int k = atoi(argv[3]);
        int64_t now = strtoll(argv[4], NULL, 10);
        for (int j = 0; j < k; j++) {
            uint8_t *b = NULL; size_t len = 0, cap = 0;
            next_batch(&agents[0], now, &b, &len, &cap);
            for (size_t i = 5; i < len; i++) printf("%02x", b[i]);
            printf("\n");
            free(b);
        }
        return 0;
    }
    srand48(getpid());
    nghttp2_session_callbacks_new(&cbs);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, on_data);
    nghttp2_session_callbacks_set_on_stream_close_callback(cbs, on_close);
    nghttp2_session_callbacks_set_on_header_callback(cbs, on_header);
    ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event sev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(ep, EPOLL_CTL_ADD, 0, &sev);
    retry_at = calloc(n_agents, sizeof(double));
    heap = xmalloc(((size_t)n_agents * (window_ + 1) + 1) * sizeof(tev));
    int next_connect = 0, reported = 0, stopping = 0;
    double drain_until = 0, last_keepalive = mono();
    struct epoll_event evs[256];
    for (;;) {
        double now = mono();
        /* connects: at most CONNECTS_IN_FLIGHT handshakes at a time, retries first */
        for (int i = 0; i < n_agents && handshaking < CONNECTS_IN_FLIGHT; i++)
            if (retry_at[i] > 0 && retry_at[i] <= now) {
                retry_at[i] = 0;
                int e = connect_one(&agents[i]);
                if (e) retry_or_fail(&agents[i], strerror(e));
            }
        while (next_connect < n_agents && handshaking < CONNECTS_IN_FLIGHT) {
            agent_t *a = &agents[next_connect++];
            int e = connect_one(a);
            if (e) retry_or_fail(a, strerror(e));
        }
        if (!reported) {
            int settled = next_connect == n_agents;
            for (int i = 0; settled && i < n_agents; i++)
                if (agents[i].state != ST_READY && agents[i].state != ST_FAILED) settled = 0;
            if (settled) { print_ready(); reported = 1; }
        }
        if (go_t > 0) {
            while (heap_n && heap[0].due <= now) {
                tev e = hpop();
                agent_t *a = &agents[e.i];
                if (a->state != ST_READY || a->done_sending) continue;
                send_one(a);
                if (rate > 0 && !a->done_sending) hpush(e.due + 1.0 / rate, e.i);
            }
            if (now >= t1_t) {
                if (!drain_until) drain_until = now + DRAIN_S;
                int busy = 0;
                for (int i = 0; i < n_agents; i++) {
                    agent_t *a = &agents[i];
                    if (a->state != ST_READY) continue;
                    a->done_sending = 1;
                    if (a->inflight == 0) finish(a);
                    else if (now >= drain_until) {
                        char msg[80];
                        snprintf(msg, sizeof msg, "%d batches not acknowledged %g s after the end", a->inflight, DRAIN_S);
                        fail(a, msg);
                        finish(a);
                    } else busy = 1;
                }
                if (!busy) break;
            }
        }
        if (stopping) break;
        if (now - last_keepalive >= 1.0) {   /* the channel's keepalive: a PING every keepalive_ms */
            last_keepalive = now;
            for (int i = 0; i < n_agents; i++) {
                agent_t *a = &agents[i];
                if (a->state == ST_READY && now - a->last_ping >= keepalive_ms / 1000.0) {
                    a->last_ping = now;
                    nghttp2_submit_ping(a->s, NGHTTP2_FLAG_NONE, NULL);
                    if (flush(a)) { fail(a, "write failed"); a->state = ST_FAILED; drop_conn(a); }
                }
            }
        }
        double wait = 0.2;
        if (go_t > 0 && heap_n) wait = heap[0].due - now;
        if (wait > 0.2) wait = 0.2;
        int ms = wait <= 0 ? 0 : (int)ceil(wait * 1000);
        int n = epoll_wait(ep, evs, 256, ms);
        for (int k = 0; k < n; k++) {
            agent_t *a = evs[k].data.ptr;
            if (!a) {   /* the parent: "go GO T0 T1" or "stop" */
                char line[256];
                ssize_t got = read(0, line, sizeof line - 1);
                if (got <= 0) { stopping = 1; epoll_ctl(ep, EPOLL_CTL_DEL, 0, NULL); continue; }
                line[got] = 0;
                if (sscanf(line, "go %lf %lf %lf", &go_t, &t0_t, &t1_t) == 3) {
                    n_sec = (int)(t1_t - go_t + DRAIN_S + 5);
                    by_sec = calloc(n_sec, sizeof(dvec));
                    for (int i = 0; i < n_agents; i++) {
                        if (agents[i].state == ST_READY) {
                            if (rate > 0) hpush(go_t + agents[i].phase_s, i);
                            else for (int w = 0; w < window_; w++) hpush(go_t, i);
                        }
                    }
                } else stopping = 1;
                continue;
            }
            if (a->fd >= 0) on_io(a, evs[k].events);
        }
    }
    if (go_t > 0) print_results();
    return 0;
}
