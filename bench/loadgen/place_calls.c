/* Closed-loop Scheduler.Place calls for bench/place_latency.py and bench/fleet_scale.py, in C
   (libnghttp2, one blocking connection): the Python client (grpc's sync stub) spent ~1 ms of CPU a
   call and waited for a CPU beside the NATS servers and the bucket's writer, and both were in the
   "Place over gRPC" figure. This one makes the same calls on one HTTP/2 connection, as grpc's
   channel does: each a stream (POST /xpusense.v1.Scheduler/Place, gRPC framing, the request's
   bytes as the Python client serializes them), the time from before its frames are written to
   the stream's close with grpc-status 0; then a pause; again until the time is up.

   argv: HOST:PORT REQUESTS_FILE SECONDS PAUSE_S
     REQUESTS_FILE: one PlaceRequest a line, hex; the calls take them in turn. One call is made
     before the clock starts (the connection's set-up is not a figure).
   stdout: {"latencies_ms": [...], "errors": N, "first_error": "..."} */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <nghttp2/nghttp2.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

typedef struct { uint8_t *b; size_t n; } req_t;

static int fd = -1, closed;
static char status[16], message[200];
static const uint8_t *body; static size_t body_len, body_off;

static void die(const char *what, const char *detail) { fprintf(stderr, "place_calls: %s%s\n", what, detail); exit(2); }
static double mono(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }

static ssize_t body_read(nghttp2_session *s, int32_t sid, uint8_t *buf, size_t len, uint32_t *flags,
                         nghttp2_data_source *src, void *ud) {
    (void)s; (void)sid; (void)src; (void)ud;
    size_t n = body_len - body_off < len ? body_len - body_off : len;
    memcpy(buf, body + body_off, n);
    body_off += n;
    if (body_off == body_len) *flags |= NGHTTP2_DATA_FLAG_EOF;
    return (ssize_t)n;
}

static int on_header(nghttp2_session *s, const nghttp2_frame *fr, const uint8_t *name, size_t nl,
                     const uint8_t *value, size_t vl, uint8_t flags, void *ud) {
    (void)s; (void)fr; (void)flags; (void)ud;
    if (nl == 11 && !memcmp(name, "grpc-status", 11)) snprintf(status, sizeof status, "%.*s", (int)vl, value);
    if (nl == 12 && !memcmp(name, "grpc-message", 12)) snprintf(message, sizeof message, "%.*s", (int)vl, value);
    return 0;
}

static int on_close(nghttp2_session *s, int32_t sid, uint32_t err, void *ud) {
    (void)s; (void)sid; (void)ud;
    closed = err ? -1 : 1;
    return 0;
}

static void send_all(nghttp2_session *s) {
    uint8_t out[65536]; size_t n = 0;   /* a call's frames gathered into one write, as grpc's transport does */
    for (;;) {
        const uint8_t *data;
        ssize_t got = nghttp2_session_mem_send(s, &data);
        if (got < 0) die("nghttp2: ", nghttp2_strerror((int)got));
        if (got == 0 || n + (size_t)got > sizeof out) {
            for (size_t off = 0; off < n;) {
                ssize_t w = send(fd, out + off, n - off, MSG_NOSIGNAL);
                if (w < 0) die("send: ", strerror(errno));
                off += w;
            }
            n = 0;
            if (got == 0) return;
        }
        if ((size_t)got > sizeof out) die("a frame larger than the write buffer", "");
        memcpy(out + n, data, got);
        n += got;
    }
}

/* One call: 0, or -1 with status/message saying why. */
static int call(nghttp2_session *s, const char *authority, const req_t *r, uint8_t *framed) {
#define H(n, v) {(uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, strlen(v), NGHTTP2_NV_FLAG_NONE}
    nghttp2_nv hdrs[] = {H(":method", "POST"), H(":scheme", "http"), H(":path", "/xpusense.v1.Scheduler/Place"),
                         H(":authority", authority), H("content-type", "application/grpc"), H("te", "trailers"),
                         H("user-agent", "xpusense-bench-place")};
    framed[0] = 0; framed[1] = r->n >> 24; framed[2] = r->n >> 16; framed[3] = r->n >> 8; framed[4] = r->n;
    memcpy(framed + 5, r->b, r->n);
    body = framed; body_len = 5 + r->n; body_off = 0;
    status[0] = message[0] = 0;
    closed = 0;
    nghttp2_data_provider dp = {.read_callback = body_read};
    if (nghttp2_submit_request(s, NULL, hdrs, sizeof hdrs / sizeof hdrs[0], &dp, NULL) < 0) die("submit failed", "");
    send_all(s);
    uint8_t buf[65536];
    while (!closed) {
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n <= 0) die("the scheduler closed the connection", n < 0 ? strerror(errno) : "");
        if (nghttp2_session_mem_recv(s, buf, n) < 0) die("nghttp2: bad input from the scheduler", "");
        send_all(s);   /* SETTINGS and PING acks, WINDOW_UPDATEs */
    }
    return closed == 1 && !strcmp(status, "0") ? 0 : -1;
}

int main(int argc, char **argv) {
    if (argc != 5) die("usage: place_calls HOST:PORT REQUESTS_FILE SECONDS PAUSE_S", "");
    char host[64]; int port;
    if (sscanf(argv[1], "%63[^:]:%d", host, &port) != 2) die("not HOST:PORT: ", argv[1]);
    double seconds = atof(argv[3]), pause_s = atof(argv[4]);
    FILE *f = fopen(argv[2], "r");
    if (!f) die("cannot open ", argv[2]);
    req_t reqs[64]; int nreq = 0; size_t most = 0;
    char *line = NULL; size_t cap = 0; ssize_t got;
    while ((got = getline(&line, &cap, f)) > 1 && nreq < 64) {
        size_t n = (size_t)(got - (line[got - 1] == '\n')) / 2;
        reqs[nreq].b = malloc(n); reqs[nreq].n = n;
        for (size_t i = 0; i < n; i++) { unsigned v; sscanf(line + 2 * i, "%2x", &v); reqs[nreq].b[i] = (uint8_t)v; }
        if (n > most) most = n;
        nreq++;
    }
    fclose(f);
    if (!nreq) die("no requests in ", argv[2]);
    uint8_t *framed = malloc(most + 5);

    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) die("not an IPv4 address: ", host);
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) die("connect: ", strerror(errno));
    nghttp2_session_callbacks *cbs;
    nghttp2_session_callbacks_new(&cbs);
    nghttp2_session_callbacks_set_on_header_callback(cbs, on_header);
    nghttp2_session_callbacks_set_on_stream_close_callback(cbs, on_close);
    nghttp2_session *s;
    nghttp2_session_client_new(&s, cbs, NULL);
    nghttp2_settings_entry iv[] = {{NGHTTP2_SETTINGS_ENABLE_PUSH, 0}, {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 4194304}};
    nghttp2_submit_settings(s, NGHTTP2_FLAG_NONE, iv, 2);

    char authority[96];
    snprintf(authority, sizeof authority, "%s:%d", host, port);
    if (call(s, authority, &reqs[0], framed)) die("the first call failed: grpc-status ", status[0] ? status : "none");
    size_t nlat = 0, lcap = 1 << 16;
    double *lat = malloc(lcap * sizeof(double));
    long errors = 0;
    char first_error[256] = "";
    struct timespec pause = {.tv_sec = (time_t)pause_s, .tv_nsec = (long)((pause_s - (time_t)pause_s) * 1e9)};
    double end = mono() + seconds;
    for (long i = 0; mono() < end; i++) {
        double t = mono();
        int rc = call(s, authority, &reqs[i % nreq], framed);
        double ms = (mono() - t) * 1e3;
        if (rc) {
            if (!errors++) snprintf(first_error, sizeof first_error, "grpc-status %s: %s", status[0] ? status : "none", message);
        } else {
            if (nlat == lcap) { lcap *= 2; lat = realloc(lat, lcap * sizeof(double)); }
            lat[nlat++] = ms;
        }
        nanosleep(&pause, NULL);
    }
    printf("{\"latencies_ms\": [");
    for (size_t i = 0; i < nlat; i++) printf(i ? ",%.4f" : "%.4f", lat[i]);
    printf("], \"errors\": %ld, \"first_error\": \"", errors);
    for (char *c = first_error; *c; c++) if (*c != '"' && *c != '\\' && (unsigned char)*c >= 0x20) putchar(*c);
    printf("\"}\n");
    return 0;
}
