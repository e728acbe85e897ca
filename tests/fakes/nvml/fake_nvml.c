/*
 * fake_nvml.c - a fake libnvidia-ml.so.1 that plays a scenario file, so that pynvml's own ctypes
 * code runs in tests on machines without an NVIDIA GPU.
 *
 * The scenario format, the environment variables and the list of functions are documented in
 * README.md beside this file. Struct layouts follow nvidia-ml-py 13.615.71 (pynvml.py); each one
 * names the pynvml class it mirrors. C11, libc + libm + pthread only.
 *
 * Time: t = seconds since $FAKE_NVML_T0 (unix epoch, float, or "init+S": S seconds after the
 * first successful nvmlInit) or, when unset, since that first nvmlInit in this process. Every value that changes is a function of t, so a test
 * places itself on a scenario's timeline with FAKE_NVML_T0 instead of sleeping.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

/* ---------------------------------------------------------------- NVML constants (pynvml.py) */
typedef unsigned int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3, NVML_ERROR_NO_PERMISSION = 4, NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6, NVML_ERROR_INSUFFICIENT_SIZE = 7, NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9, NVML_ERROR_TIMEOUT = 10, NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12, NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14, NVML_ERROR_GPU_IS_LOST = 15, NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17, NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19, NVML_ERROR_MEMORY = 20, NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25, NVML_ERROR_NOT_READY = 27,
    NVML_ERROR_GPU_NOT_FOUND = 28, NVML_ERROR_INVALID_STATE = 29, NVML_ERROR_UNKNOWN = 999,
};
enum { VT_DOUBLE = 0, VT_UINT = 1, VT_ULONG = 2, VT_ULL = 3, VT_SLL = 4, VT_SINT = 5 };
#define SCOPE_ALL_LINKS 0xFFFFFFFFu
#define NVML_NVLINK_MAX_LINKS 36u
#define NVML_GPM_METRIC_MAX 477u            /* pynvml 13.615.71; we only touch numMetrics entries */
#define NO_INSTANCE 0xFFFFFFFFu              /* gpuInstanceId/computeInstanceId when not MIG */
#define EV_DEFAULT_TYPES (0x1ull | 0x2ull | 0x4ull | 0x8ull | 0x10ull | 0x80ull | 0x100ull | 0x400ull)

/* ---------------------------------------------------------------- structs, mirroring pynvml */
typedef struct nvmlDevice_st *nvmlDevice_t;          /* c_nvmlDevice_t = POINTER(opaque) */
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;           /* c_nvmlUtilization_t */
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;    /* c_nvmlMemory_t */
typedef struct {                                                          /* c_nvmlMemory_v2_t */
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define nvmlMemory_v2 ((unsigned)(sizeof(nvmlMemory_v2_t) | (2u << 24)))  /* 0x02000028 */
typedef struct {                                                          /* nvmlPciInfo_t (v3) */
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
typedef struct {                                                /* c_nvmlProcessInfo_v2_t == _v3_t */
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;
typedef struct { unsigned int version, sensorType; int temperature; } nvmlTemperature_v1_t;
#define nvmlTemperature_v1 ((unsigned)(sizeof(nvmlTemperature_v1_t) | (1u << 24)))  /* 0x100000C */
typedef union {                                                           /* c_nvmlValue_t */
    double dVal; unsigned int uiVal; unsigned long ulVal; unsigned long long ullVal;
    long long sllVal; int siVal; unsigned short usVal;
} nvmlValue_t;
typedef struct {                                                          /* c_nvmlFieldValue_t */
    uint32_t fieldId, scopeId;
    int64_t timestamp, latencyUsec;
    unsigned int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;
typedef struct nvmlEventSet_st *nvmlEventSet_t;     /* c_nvmlEventSet_t = POINTER(opaque) */
typedef struct {                                                          /* c_nvmlEventData_t */
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;
typedef struct { nvmlDevice_t device; unsigned long long eventType, eventData; } nvmlEventData_v1_t;
typedef struct nvmlGpmSample_st *nvmlGpmSample_t;   /* c_nvmlGpmSample_t = POINTER(opaque) */
typedef struct { const char *shortName, *longName, *unit; } nvmlGpmMetricInfo_t; /* c_metricInfo_t */
typedef struct {                                                          /* c_nvmlGpmMetric_t */
    unsigned int metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    nvmlGpmMetricInfo_t metricInfo;
} nvmlGpmMetric_t;
typedef struct {                                                      /* c_nvmlGpmMetricsGet_t */
    unsigned int version, numMetrics;
    nvmlGpmSample_t sample1, sample2;
    nvmlGpmMetric_t metrics[NVML_GPM_METRIC_MAX];
} nvmlGpmMetricsGet_t;
typedef struct { unsigned int version, isSupportedDevice; } nvmlGpmSupport_t; /* c_nvmlGpmSupport_t */

_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "c_nvmlMemory_v2_t");
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "c_nvmlProcessInfo_v3_t");
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "c_nvmlFieldValue_t");
_Static_assert(sizeof(nvmlEventData_t) == 32, "c_nvmlEventData_t");
_Static_assert(sizeof(nvmlGpmMetric_t) == 40, "c_nvmlGpmMetric_t");

/* ---------------------------------------------------------------- scenario model */
#define MAX_GPUS 32
#define MAX_MIG 8
#define MAX_PROCS 64
#define MAX_EVENTS 512
#define MAX_ERRS 64
#define MAX_IDS 64

/* Values that change over time: name, and whether they hold (step) instead of interpolating. */
#define SERIES(X) \
    X(S_GPU_UTIL, "gpu_util", 0) X(S_MEM_UTIL, "mem_util", 0) X(S_MEM_USED, "mem_used", 0) \
    X(S_GPM_GRAPHICS, "gpm_graphics_util", 0) X(S_GPM_SM, "gpm_sm_util", 0) \
    X(S_GPM_SM_OCC, "gpm_sm_occupancy", 0) X(S_GPM_TENSOR, "gpm_tensor_util", 0) \
    X(S_GPM_DRAM, "gpm_dram_bw_util", 0) X(S_GPM_FP64, "gpm_fp64_util", 0) \
    X(S_GPM_FP32, "gpm_fp32_util", 0) X(S_GPM_FP16, "gpm_fp16_util", 0) \
    X(S_NVL_RX, "nvlink_rx_mibps", 0) X(S_NVL_TX, "nvlink_tx_mibps", 0) \
    X(S_PCIE_TX, "pcie_tx_kbps", 0) X(S_PCIE_RX, "pcie_rx_kbps", 0) \
    X(S_SM_CLK, "sm_clock_mhz", 0) X(S_MEM_CLK, "mem_clock_mhz", 0) \
    X(S_GR_CLK, "graphics_clock_mhz", 0) X(S_VID_CLK, "video_clock_mhz", 0) \
    X(S_POWER, "power_mw", 0) X(S_GPU_TEMP, "gpu_temp_c", 0) X(S_MEM_TEMP, "mem_temp_c", 0) \
    X(S_FAN, "fan_pct", 0) X(S_REASONS, "clocks_event_reasons", 1) \
    X(S_ENC_UTIL, "enc_util", 0) X(S_DEC_UTIL, "dec_util", 0) \
    X(S_ECC_SBE_VOL, "ecc_corrected_volatile", 1) X(S_ECC_DBE_VOL, "ecc_uncorrected_volatile", 1) \
    X(S_ECC_SBE_AGG, "ecc_corrected_aggregate", 1) X(S_ECC_DBE_AGG, "ecc_uncorrected_aggregate", 1) \
    X(S_REMAP_COR, "remapped_cor", 1) X(S_REMAP_UNC, "remapped_unc", 1) \
    X(S_REMAP_PEND, "remapped_pending", 1) X(S_REMAP_FAIL, "remapped_failure", 1) \
    X(S_NVL_CRC, "nvlink_crc_errors", 1) X(S_NVL_REPLAY, "nvlink_replay_errors", 1) \
    X(S_NVL_RECOVERY, "nvlink_recovery_errors", 1) X(S_MIG_MODE, "mig_mode", 1)

#define X_ENUM(id, name, step) id,
enum { SERIES(X_ENUM) S_COUNT };
#define X_NAME(id, name, step) name,
static const char *const series_names[S_COUNT] = { SERIES(X_NAME) };
#define X_STEP(id, name, step) step,
static const int series_step[S_COUNT] = { SERIES(X_STEP) };

typedef struct { int n; double *t, *v; } series_t;
typedef struct { unsigned gi; unsigned long long total, used; char profile[32]; int noci; } mig_t;
typedef struct { unsigned pid; unsigned long long used; char name[64]; } proc_t;
typedef struct { unsigned pid, v[6]; double from, to; } putil_t;   /* sm mem enc dec jpg ofa %, FROM <= t < TO */
typedef struct { char fn[64]; nvmlReturn_t code; double from, to; } err_t;
typedef struct { double t; int gpu; unsigned long long type, data; unsigned gi, ci; } event_t;
typedef struct { unsigned id; double from, to; } gpm_nan_t;

struct nvmlDevice_st { int gpu, mig; };   /* mig = -1 for the whole GPU */

typedef struct {
    char name[96], uuid[96], serial[32], pci_bus_id[32];
    unsigned pci_device_id, pci_subsystem_id, arch, cc_major, cc_minor;
    unsigned long long mem_total, mem_reserved;
    unsigned mig_max; int n_mig; mig_t mig[MAX_MIG];
    unsigned nvlink_links, nvlink_max_links, nvlink_speed_mbps, nvlink_version;
    unsigned power_limit_mw, max_sm_clk, max_mem_clk, max_gr_clk, max_vid_clk;
    unsigned temp_threshold[4];   /* shutdown, slowdown, mem_max, gpu_max (nvmlTemperatureThresholds_t); 0: NOT_SUPPORTED */
    unsigned pcie_gen, pcie_max_gen, pcie_width, pcie_max_width;
    unsigned pcie_switch, pcie_switch_hops, cpu_socket;   /* nvmlDeviceGetTopologyCommonAncestor */
    int gpm, ecc_mode, mig_monitor;
    unsigned long long event_types;
    double lost_at, repeat, energy_start_mj;
    series_t s[S_COUNT];
    int n_errs; err_t errs[MAX_ERRS];
    int n_unsup_fields; unsigned unsup_fields[MAX_IDS];
    int n_unsup_gpm; unsigned unsup_gpm[MAX_IDS];
    double gpm_min_interval_ms, gpm_short_value;
    int n_field_types; unsigned field_type_id[MAX_IDS], field_type[MAX_IDS];
    int n_gpm_nan; gpm_nan_t gpm_nan[MAX_IDS];
    int n_procs; proc_t procs[MAX_PROCS];
    int n_putil; putil_t putil[MAX_PROCS];
    double putil_period_ms;   /* the driver's per-process sampling period */
    int mig_process_util;     /* MIG device handles answer the per-process utilisation calls */
} gpu_t;

static struct {
    int gpu_count;
    char driver_version[80], nvml_version[80], procs_file[8400];
    int cuda_driver_version;
    int deliver_past_events;
    nvmlReturn_t init_error;
    unsigned process_info_size;          /* bytes per entry of the _v3 process calls: 24, or 32 (R535.43-.86) */
    char missing_symbols[1024];          /* sorted, space separated: must match the build (FAKE_MISSING) */
    gpu_t gpu[MAX_GPUS];
    int n_events; event_t events[MAX_EVENTS];
} S;

static struct nvmlDevice_st dev_handles[MAX_GPUS];
static struct nvmlDevice_st mig_handles[MAX_GPUS][MAX_MIG];

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t waiters = PTHREAD_COND_INITIALIZER;   /* event waits: woken by shutdown, set free */
static int loaded;          /* scenario parsed */
static int refcount;        /* nvmlInit minus nvmlShutdown */
static double T0;           /* unix time of t = 0 */
static int t0_set;

/* ---------------------------------------------------------------- call counting */
#define MAX_FNS 160
static struct { const char *name; unsigned long long n; } calls[MAX_FNS];
static int n_calls_fns;
static unsigned long long calls_total;
static double calls_last_flush;

static void count_call(const char *fn)
{
    calls_total++;
    for (int i = 0; i < n_calls_fns; i++)
        if (calls[i].name == fn || strcmp(calls[i].name, fn) == 0) { calls[i].n++; return; }
    if (n_calls_fns < MAX_FNS) { calls[n_calls_fns].name = fn; calls[n_calls_fns++].n = 1; }
}

static double wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static int cmp_calls(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Writes "name count" lines (sorted, plus "_total N") atomically to $FAKE_NVML_CALLS. */
static void flush_calls(void)
{
    const char *path = getenv("FAKE_NVML_CALLS");
    if (!path || !*path) return;
    calls_last_flush = wall_now();
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    const char *names[MAX_FNS];
    for (int i = 0; i < n_calls_fns; i++) names[i] = calls[i].name;
    qsort(names, (size_t)n_calls_fns, sizeof names[0], cmp_calls);
    for (int i = 0; i < n_calls_fns; i++)
        for (int j = 0; j < n_calls_fns; j++)
            if (calls[j].name == names[i]) { fprintf(f, "%s %llu\n", names[i], calls[j].n); break; }
    fprintf(f, "_total %llu\n", calls_total);
    if (fclose(f) == 0) rename(tmp, path); else unlink(tmp);
}

__attribute__((destructor)) static void at_unload(void)
{
    pthread_mutex_lock(&mu);
    flush_calls();
    pthread_mutex_unlock(&mu);
}

/* Every exported NVML function starts with ENTER: takes the lock and counts the call. */
#define ENTER(fn_) const char *FN = fn_; pthread_mutex_lock(&mu); count_call(FN); \
    if (calls_last_flush + 1.0 < wall_now()) flush_calls();
#define LEAVE(x) do { nvmlReturn_t r__ = (x); pthread_mutex_unlock(&mu); return r__; } while (0)
#define REQUIRE_INIT() do { if (refcount <= 0) LEAVE(NVML_ERROR_UNINITIALIZED); } while (0)

/* ---------------------------------------------------------------- time and series */
static double now_t(void) { return wall_now() - T0; }

static double seg_area(double a, double va, double b, double vb, double lo, double hi)
{
    double L = a > lo ? a : lo, H = b < hi ? b : hi;
    if (H <= L) return 0;
    double fL = va + (vb - va) * (L - a) / (b - a), fH = va + (vb - va) * (H - a) / (b - a);
    return 0.5 * (fL + fH) * (H - L);
}

/* Value of a series at x (no wrap). Linear between keyframes, held before the first and after the
 * last; two keyframes at the same time make a step. Step series hold the last keyframe <= x. */
static double s_value_raw(const series_t *s, int step, double x)
{
    if (s->n == 0) return 0;
    int i = -1;
    for (int k = 0; k < s->n; k++) if (s->t[k] <= x) i = k; else break;
    if (i < 0) return s->v[0];
    if (step || i == s->n - 1) return s->v[i];
    double a = s->t[i], b = s->t[i + 1];
    return s->v[i] + (s->v[i + 1] - s->v[i]) * (x - a) / (b - a);
}

/* Integral of a (linear) series over [0, x], x >= 0, no wrap. */
static double s_integral_raw(const series_t *s, double x)
{
    if (s->n == 0 || x <= 0) return 0;
    double acc = 0, t0 = s->t[0], tl = s->t[s->n - 1];
    if (t0 > 0) acc += s->v[0] * (x < t0 ? x : t0);
    for (int i = 0; i + 1 < s->n; i++)
        if (s->t[i + 1] > s->t[i]) acc += seg_area(s->t[i], s->v[i], s->t[i + 1], s->v[i + 1], 0, x);
    if (x > tl) acc += s->v[s->n - 1] * (x - (tl > 0 ? tl : 0));
    return acc;
}

static double gv(const gpu_t *g, int id, double t)   /* value of series id at time t */
{
    if (t < 0) t = 0;
    if (g->repeat > 0) t = fmod(t, g->repeat);
    return s_value_raw(&g->s[id], series_step[id], t);
}

static double gi_(const gpu_t *g, int id, double t)  /* integral of series id over [0, t] */
{
    const series_t *s = &g->s[id];
    if (t <= 0) return 0;
    if (g->repeat > 0) {
        double n = floor(t / g->repeat);
        return n * s_integral_raw(s, g->repeat) + s_integral_raw(s, t - n * g->repeat);
    }
    return s_integral_raw(s, t);
}

static double gavg(const gpu_t *g, int id, double t1, double t2)  /* mean over [t1, t2] */
{
    if (t2 - t1 < 1e-9) return gv(g, id, t2);
    return (gi_(g, id, t2) - gi_(g, id, t1)) / (t2 - t1);
}

static int has(const gpu_t *g, int id) { return g->s[id].n > 0; }

static unsigned long long u64(double v) { return v <= 0 ? 0 : (unsigned long long)(v + 1e-6); }
static unsigned u32(double v) { return v <= 0 ? 0 : v >= 4294967295.0 ? 0xFFFFFFFFu : (unsigned)(v + 0.5); }

/* ---------------------------------------------------------------- scenario parsing */
static const struct { const char *name; nvmlReturn_t code; const char *text; } errtab[] = {
    {"SUCCESS", 0, "Success"}, {"UNINITIALIZED", 1, "Uninitialized"},
    {"INVALID_ARGUMENT", 2, "Invalid Argument"}, {"NOT_SUPPORTED", 3, "Not Supported"},
    {"NO_PERMISSION", 4, "Insufficient Permissions"},
    {"ALREADY_INITIALIZED", 5, "Already Initialized"}, {"NOT_FOUND", 6, "Not Found"},
    {"INSUFFICIENT_SIZE", 7, "Insufficient Size"},
    {"INSUFFICIENT_POWER", 8, "Insufficient External Power"},
    {"DRIVER_NOT_LOADED", 9, "Driver Not Loaded"}, {"TIMEOUT", 10, "Timeout"},
    {"IRQ_ISSUE", 11, "Interrupt Request Issue"},
    {"LIBRARY_NOT_FOUND", 12, "NVML Shared Library Not Found"},
    {"FUNCTION_NOT_FOUND", 13, "Function Not Found"},
    {"CORRUPTED_INFOROM", 14, "Corrupted infoROM"}, {"GPU_IS_LOST", 15, "GPU is lost"},
    {"RESET_REQUIRED", 16, "GPU requires restart"},
    {"OPERATING_SYSTEM", 17, "The operating system has blocked the request."},
    {"LIB_RM_VERSION_MISMATCH", 18, "RM has detected an NVML/RM version mismatch."},
    {"IN_USE", 19, "In use by another client"}, {"MEMORY", 20, "Insufficient Memory"},
    {"NO_DATA", 21, "No data"}, {"ARGUMENT_VERSION_MISMATCH", 25, "Argument version mismatch"},
    {"NOT_READY", 27, "Not ready"}, {"GPU_NOT_FOUND", 28, "GPU not found"},
    {"INVALID_STATE", 29, "Invalid state"}, {"UNKNOWN", 999, "Unknown Error"},
};

static const struct { const char *name; unsigned long long mask; } evtab[] = {
    {"sbe", 0x1}, {"dbe", 0x2}, {"pstate", 0x4}, {"xid", 0x8}, {"clock", 0x10},
    {"power_source", 0x80}, {"mig_config", 0x100}, {"dram_retirement", 0x400},
    {"dram_retirement_failure", 0x800}, {"gpu_unavailable", 0x4000}, {"gpu_recovery", 0x8000},
};

static const char *scn_path;
static int scn_line;
static char scn_err[1024];

static int perr(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(scn_err, sizeof scn_err, "%s:%d: ", scn_path, scn_line);
    vsnprintf(scn_err + n, sizeof scn_err - (size_t)n, fmt, ap);
    va_end(ap);
    return -1;
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s)) s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1])) *--e = 0;
    return s;
}

/* A number with an optional size suffix: K M G T (x1000^n) or Ki Mi Gi Ti (x1024^n), optional B. */
static int parse_num(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno) return -1;
    double mul = 1;
    const char *p = end;
    if (*p) {
        const char *units = "KMGT";
        const char *u = strchr(units, toupper((unsigned char)*p));
        if (u && *p) {
            int pow_ = (int)(u - units) + 1;
            p++;
            double base = 1000;
            if (*p == 'i') { base = 1024; p++; }
            for (int i = 0; i < pow_; i++) mul *= base;
        }
        if (*p == 'B') p++;
        if (*p) return -1;
    }
    *out = v * mul;
    return 0;
}

static int parse_uint(const char *s, unsigned long long *out)
{
    double v;
    if (parse_num(s, &v) || v < 0) return -1;
    *out = (unsigned long long)(v + 0.5);
    return 0;
}

static int parse_code(const char *s, nvmlReturn_t *out)
{
    const char *n = strncmp(s, "NVML_ERROR_", 11) == 0 ? s + 11 : s;
    for (size_t i = 0; i < sizeof errtab / sizeof errtab[0]; i++)
        if (strcasecmp(errtab[i].name, n) == 0) { *out = errtab[i].code; return 0; }
    unsigned long long v;
    if (parse_uint(s, &v)) return -1;
    *out = (nvmlReturn_t)v;
    return 0;
}

static int parse_bool(const char *s, int *out)
{
    if (!strcasecmp(s, "yes") || !strcasecmp(s, "true") || !strcmp(s, "1") || !strcasecmp(s, "on")) *out = 1;
    else if (!strcasecmp(s, "no") || !strcasecmp(s, "false") || !strcmp(s, "0") || !strcasecmp(s, "off")) *out = 0;
    else return -1;
    return 0;
}

/* "50" or "0:10 5:90 10:10" (t:value, t non-decreasing). */
static int parse_series(const char *val, series_t *out)
{
    int cap = 8, n = 0;
    double *t = malloc(sizeof(double) * (size_t)cap), *v = malloc(sizeof(double) * (size_t)cap);
    char buf[8192];
    snprintf(buf, sizeof buf, "%s", val);
    char *save = NULL;
    for (char *tok = strtok_r(buf, " \t", &save); tok; tok = strtok_r(NULL, " \t", &save)) {
        double tt = 0, vv;
        char *colon = strchr(tok, ':');
        if (colon) {
            *colon = 0;
            if (parse_num(tok, &tt) || parse_num(colon + 1, &vv)) goto bad;
        } else {
            if (n > 0 || parse_num(tok, &vv)) goto bad;
        }
        if (n > 0 && tt < t[n - 1]) { free(t); free(v); return perr("keyframe times must not decrease"); }
        if (n == cap) {
            cap *= 2;
            t = realloc(t, sizeof(double) * (size_t)cap);
            v = realloc(v, sizeof(double) * (size_t)cap);
        }
        t[n] = tt; v[n] = vv; n++;
    }
    if (n == 0) goto bad;
    free(out->t); free(out->v);
    out->t = t; out->v = v; out->n = n;
    return 0;
bad:
    free(t); free(v);
    return perr("bad value list '%s' (want a number or t:value pairs)", val);
}

static void copy_str(char *dst, size_t n, const char *src, int gpu_index)
{
    /* "{i}" becomes the GPU index; "{x}" its two-digit hex form */
    size_t o = 0;
    for (const char *p = src; *p && o + 1 < n; ) {
        if (p[0] == '{' && (p[1] == 'i' || p[1] == 'x') && p[2] == '}') {
            char num[16];
            snprintf(num, sizeof num, p[1] == 'i' ? "%d" : "%02x", gpu_index);
            for (char *q = num; *q && o + 1 < n; q++) dst[o++] = *q;
            p += 3;
        } else dst[o++] = *p++;
    }
    dst[o] = 0;
}

static int find_series(const char *key)
{
    for (int i = 0; i < S_COUNT; i++) if (!strcmp(series_names[i], key)) return i;
    return -1;
}

static int set_gpu_key(gpu_t *g, int idx, const char *key, char *val)
{
    unsigned long long u;
    double d;
    int sid = find_series(key);
    if (sid >= 0) return parse_series(val, &g->s[sid]);
#define STR(k, field) if (!strcmp(key, k)) { copy_str(g->field, sizeof g->field, val, idx); return 0; }
#define UINT(k, field) if (!strcmp(key, k)) { if (parse_uint(val, &u)) return perr("bad number for %s", key); g->field = u; return 0; }
#define DBL(k, field) if (!strcmp(key, k)) { if (parse_num(val, &d)) return perr("bad number for %s", key); g->field = d; return 0; }
    STR("name", name) STR("uuid", uuid) STR("serial", serial) STR("pci_bus_id", pci_bus_id)
    UINT("pci_device_id", pci_device_id) UINT("pci_subsystem_id", pci_subsystem_id)
    UINT("arch", arch) UINT("memory_total", mem_total) UINT("memory_reserved", mem_reserved)
    UINT("mig_max", mig_max)
    UINT("nvlink_links", nvlink_links) UINT("nvlink_max_links", nvlink_max_links)
    UINT("nvlink_speed_mbps", nvlink_speed_mbps) UINT("nvlink_version", nvlink_version)
    UINT("power_limit_mw", power_limit_mw)
    UINT("temp_shutdown_c", temp_threshold[0]) UINT("temp_slowdown_c", temp_threshold[1])
    UINT("temp_mem_max_c", temp_threshold[2]) UINT("temp_gpu_max_c", temp_threshold[3])
    UINT("max_sm_clock_mhz", max_sm_clk) UINT("max_mem_clock_mhz", max_mem_clk)
    UINT("max_graphics_clock_mhz", max_gr_clk) UINT("max_video_clock_mhz", max_vid_clk)
    UINT("pcie_gen", pcie_gen) UINT("pcie_max_gen", pcie_max_gen)
    UINT("pcie_width", pcie_width) UINT("pcie_max_width", pcie_max_width)
    UINT("pcie_switch", pcie_switch) UINT("pcie_switch_hops", pcie_switch_hops) UINT("cpu_socket", cpu_socket)
    UINT("ecc_mode", ecc_mode) UINT("event_types", event_types)
    DBL("lost_at", lost_at) DBL("repeat", repeat) DBL("energy_start_mj", energy_start_mj)
    DBL("gpm_min_interval_ms", gpm_min_interval_ms) DBL("gpm_short_value", gpm_short_value)
    DBL("process_util_period_ms", putil_period_ms)
#undef STR
#undef UINT
#undef DBL
    if (!strcmp(key, "compute_capability")) {
        unsigned a, b;
        if (sscanf(val, "%u.%u", &a, &b) != 2) return perr("compute_capability wants MAJOR.MINOR");
        g->cc_major = a; g->cc_minor = b;
        return 0;
    }
    if (!strcmp(key, "gpm")) return parse_bool(val, &g->gpm) ? perr("gpm wants yes/no") : 0;
    if (!strcmp(key, "mig_monitor")) return parse_bool(val, &g->mig_monitor) ? perr("mig_monitor wants yes/no") : 0;
    if (!strcmp(key, "mig_process_util"))
        return parse_bool(val, &g->mig_process_util) ? perr("mig_process_util wants yes/no") : 0;
    if (!strcmp(key, "process_util")) {   /* process_util = PID SM MEM ENC DEC [FROM_T [TO_T]] */
        double x[7] = {0, 0, 0, 0, 0, -INFINITY, INFINITY};
        int k = 0;
        char *save = NULL;
        for (char *tok = strtok_r(val, " \t", &save); tok; tok = strtok_r(NULL, " \t", &save), k++)
            if (k >= 7 || parse_num(tok, &x[k])) return perr("process_util = PID SM MEM ENC DEC [FROM_T [TO_T]]");
        if (k < 5) return perr("process_util = PID SM MEM ENC DEC [FROM_T [TO_T]]");
        for (int i = 1; i < 5; i++)
            if (x[i] < 0 || x[i] > 100) return perr("process_util: utilisation must be 0-100 %%");
        if (g->n_putil >= MAX_PROCS) return perr("at most %d process_util lines per GPU", MAX_PROCS);
        putil_t *p = &g->putil[g->n_putil++];
        memset(p, 0, sizeof *p);
        p->pid = (unsigned)x[0];
        for (int i = 0; i < 4; i++) p->v[i] = (unsigned)x[i + 1];
        p->from = x[5]; p->to = x[6];
        return 0;
    }
    if (!strcmp(key, "mig")) {          /* mig = GI_ID MEMORY_TOTAL [MEMORY_USED] [PROFILE] [noci] */
        char *save = NULL, *a = strtok_r(val, " \t", &save), *b = strtok_r(NULL, " \t", &save);
        unsigned long long gi, tot, used = 0;
        if (!a || !b || parse_uint(a, &gi) || parse_uint(b, &tot))
            return perr("mig = GI_ID MEMORY_TOTAL [MEMORY_USED] [PROFILE] [noci]");
        if (g->n_mig >= MAX_MIG) return perr("at most %d MIG instances per GPU", MAX_MIG);
        mig_t *m = &g->mig[g->n_mig++];
        memset(m, 0, sizeof *m);
        m->gi = (unsigned)gi; m->total = tot;
        for (char *tok = strtok_r(NULL, " \t", &save); tok; tok = strtok_r(NULL, " \t", &save)) {
            if (!strcmp(tok, "noci")) m->noci = 1;
            else if (!parse_uint(tok, &u)) m->used = u;
            else snprintf(m->profile, sizeof m->profile, "%s", tok);
        }
        (void)used;
        return 0;
    }
    if (!strcmp(key, "process")) {      /* process = PID USED_BYTES [NAME] */
        char *save = NULL, *a = strtok_r(val, " \t", &save), *b = strtok_r(NULL, " \t", &save);
        char *c = strtok_r(NULL, " \t", &save);
        unsigned long long pid, used;
        if (!a || !b || parse_uint(a, &pid) || parse_uint(b, &used)) return perr("process = PID USED_BYTES [NAME]");
        if (g->n_procs >= MAX_PROCS) return perr("at most %d processes per GPU", MAX_PROCS);
        proc_t *p = &g->procs[g->n_procs++];
        p->pid = (unsigned)pid; p->used = used;
        snprintf(p->name, sizeof p->name, "%s", c ? c : "");
        return 0;
    }
    if (!strcmp(key, "unsupported")) {  /* names of NVML functions, field:N, gpm:N */
        char *save = NULL;
        for (char *tok = strtok_r(val, " \t,", &save); tok; tok = strtok_r(NULL, " \t,", &save)) {
            if (!strncmp(tok, "field:", 6) || !strncmp(tok, "gpm:", 4)) {
                int is_field = tok[0] == 'f';
                if (parse_uint(strchr(tok, ':') + 1, &u)) return perr("bad id in '%s'", tok);
                if (is_field ? g->n_unsup_fields >= MAX_IDS : g->n_unsup_gpm >= MAX_IDS) return perr("too many ids");
                if (is_field) g->unsup_fields[g->n_unsup_fields++] = (unsigned)u;
                else g->unsup_gpm[g->n_unsup_gpm++] = (unsigned)u;
            } else if (!strncmp(tok, "nvml", 4)) {
                if (g->n_errs >= MAX_ERRS) return perr("too many error entries");
                err_t *e = &g->errs[g->n_errs++];
                snprintf(e->fn, sizeof e->fn, "%s", tok);
                e->code = NVML_ERROR_NOT_SUPPORTED; e->from = -INFINITY; e->to = INFINITY;
            } else return perr("unsupported: '%s' is not an nvml* function, field:N or gpm:N", tok);
        }
        return 0;
    }
    if (!strcmp(key, "field_type")) {   /* field_type = ID:TYPE ... (TYPE a name or a valueType number) */
        static const char *const names[] = {"double", "uint", "ulong", "ull", "sll", "sint", "ushort"};
        char *save = NULL;
        for (char *tok = strtok_r(val, " \t,", &save); tok; tok = strtok_r(NULL, " \t,", &save)) {
            char *colon = strchr(tok, ':');
            unsigned long long id, type = 99;
            if (!colon) return perr("field_type wants ID:TYPE");
            *colon = 0;
            for (unsigned k = 0; k < 7; k++) if (!strcmp(colon + 1, names[k])) type = k;
            if (parse_uint(tok, &id) || (type == 99 && parse_uint(colon + 1, &type)))
                return perr("field_type wants ID:TYPE, TYPE one of double uint ulong ull sll sint ushort or a number");
            if (g->n_field_types >= MAX_IDS) return perr("too many field_type entries");
            g->field_type_id[g->n_field_types] = (unsigned)id;
            g->field_type[g->n_field_types++] = (unsigned)type;
        }
        return 0;
    }
    if (!strcmp(key, "gpm_nan")) {      /* gpm_nan = METRIC_ID [FROM_T [TO_T]] */
        char *save = NULL, *a = strtok_r(val, " \t", &save), *b = strtok_r(NULL, " \t", &save);
        char *c = strtok_r(NULL, " \t", &save);
        if (!a || parse_uint(a, &u)) return perr("gpm_nan = METRIC_ID [FROM_T [TO_T]]");
        if (g->n_gpm_nan >= MAX_IDS) return perr("too many gpm_nan entries");
        gpm_nan_t *n = &g->gpm_nan[g->n_gpm_nan];
        n->id = (unsigned)u; n->from = -INFINITY; n->to = INFINITY;
        if (b && parse_num(b, &n->from)) return perr("bad FROM_T");
        if (c && parse_num(c, &n->to)) return perr("bad TO_T");
        g->n_gpm_nan++;
        return 0;
    }
    if (!strcmp(key, "error")) {        /* error = FUNCTION CODE [FROM_T [TO_T]] */
        char *save = NULL, *a = strtok_r(val, " \t", &save), *b = strtok_r(NULL, " \t", &save);
        char *c = strtok_r(NULL, " \t", &save), *e4 = strtok_r(NULL, " \t", &save);
        if (!a || !b || strncmp(a, "nvml", 4)) return perr("error = nvmlFUNCTION CODE [FROM_T [TO_T]]");
        if (g->n_errs >= MAX_ERRS) return perr("too many error entries");
        err_t *e = &g->errs[g->n_errs];
        snprintf(e->fn, sizeof e->fn, "%s", a);
        if (parse_code(b, &e->code)) return perr("bad error code '%s'", b);
        e->from = -INFINITY; e->to = INFINITY;
        if (c && parse_num(c, &e->from)) return perr("bad FROM_T");
        if (e4 && parse_num(e4, &e->to)) return perr("bad TO_T");
        g->n_errs++;
        return 0;
    }
    if (!strcmp(key, "event")) {        /* event = T TYPE [DATA [GI [CI]]] */
        char *save = NULL, *a = strtok_r(val, " \t", &save), *b = strtok_r(NULL, " \t", &save);
        char *c = strtok_r(NULL, " \t", &save), *d = strtok_r(NULL, " \t", &save);
        char *f = strtok_r(NULL, " \t", &save);
        double t;
        unsigned long long mask = 0, data = 0, gi = NO_INSTANCE, ci = NO_INSTANCE;
        if (!a || !b || parse_num(a, &t)) return perr("event = T TYPE [DATA [GI [CI]]]");
        if ((d && parse_uint(d, &gi)) || (f && parse_uint(f, &ci))) return perr("bad GI or CI in '%s'", val);
        for (size_t i = 0; i < sizeof evtab / sizeof evtab[0]; i++)
            if (!strcasecmp(evtab[i].name, b)) mask = evtab[i].mask;
        if (!mask && (parse_uint(b, &mask) || !mask)) return perr("unknown event type '%s'", b);
        if (c && parse_uint(c, &data)) return perr("bad event data '%s'", c);
        if (mask == 0x8 && !c) return perr("an xid event needs the XID number");
        if (S.n_events >= MAX_EVENTS) return perr("at most %d events", MAX_EVENTS);
        event_t *ev = &S.events[S.n_events++];
        ev->t = t; ev->gpu = idx; ev->type = mask; ev->data = data;
        ev->gi = (unsigned)gi; ev->ci = (unsigned)ci;
        return 0;
    }
    return perr("unknown key '%s'", key);
}

static int set_system_key(const char *key, char *val, const char *scn_dir)
{
    unsigned long long u;
    if (!strcmp(key, "gpu_count")) {
        if (parse_uint(val, &u) || u > MAX_GPUS) return perr("gpu_count must be 0..%d", MAX_GPUS);
        S.gpu_count = (int)u;
        return 0;
    }
    if (!strcmp(key, "driver_version")) { snprintf(S.driver_version, sizeof S.driver_version, "%s", val); return 0; }
    if (!strcmp(key, "nvml_version")) { snprintf(S.nvml_version, sizeof S.nvml_version, "%s", val); return 0; }
    if (!strcmp(key, "cuda_driver_version")) {
        if (parse_uint(val, &u)) return perr("cuda_driver_version wants an int such as 12040");
        S.cuda_driver_version = (int)u;
        return 0;
    }
    if (!strcmp(key, "procs_file")) {
        if (val[0] == '/' || !scn_dir) snprintf(S.procs_file, sizeof S.procs_file, "%s", val);
        else snprintf(S.procs_file, sizeof S.procs_file, "%s/%s", scn_dir, val);
        return 0;
    }
    if (!strcmp(key, "event_delivery")) {
        if (!strcmp(val, "after_register")) S.deliver_past_events = 0;
        else if (!strcmp(val, "all")) S.deliver_past_events = 1;
        else return perr("event_delivery wants after_register or all");
        return 0;
    }
    if (!strcmp(key, "init_error")) return parse_code(val, &S.init_error) ? perr("bad init_error") : 0;
    if (!strcmp(key, "process_info_size")) {
        if (parse_uint(val, &u) || (u != 16 && u != 24 && u != 32)) return perr("process_info_size must be 16, 24 or 32");
        S.process_info_size = (unsigned)u;
        return 0;
    }
    if (!strcmp(key, "missing_symbols")) {    /* appends; checked against the build after parsing */
        char *save = NULL;
        for (char *tok = strtok_r(val, " \t,", &save); tok; tok = strtok_r(NULL, " \t,", &save)) {
            size_t used = strlen(S.missing_symbols);
            if (used + strlen(tok) + 2 > sizeof S.missing_symbols) return perr("too many missing_symbols");
            snprintf(S.missing_symbols + used, sizeof S.missing_symbols - used, "%s%s", used ? " " : "", tok);
        }
        return 0;
    }
    return perr("unknown key '%s' in [system]", key);
}

/* "[gpu *]", "[gpu 3]", "[gpu 0-3]", "[gpu 0,2,4-5]", "[system]" -> mask of GPU slots (0 = system) */
static int parse_section(char *s, uint64_t *mask)
{
    *mask = 0;
    if (!strcmp(s, "system")) return 0;
    if (strncmp(s, "gpu", 3) || !isspace((unsigned char)s[3])) return perr("section must be [system] or [gpu SPEC]");
    char *spec = trim(s + 3), *save = NULL;
    if (!strcmp(spec, "*")) { *mask = MAX_GPUS >= 64 ? ~0ull : ((1ull << MAX_GPUS) - 1); return 0; }
    for (char *tok = strtok_r(spec, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        unsigned a, b;
        tok = trim(tok);
        if (sscanf(tok, "%u-%u", &a, &b) == 2) {}
        else if (sscanf(tok, "%u", &a) == 1) b = a;
        else return perr("bad GPU list '%s'", tok);
        if (b < a || b >= MAX_GPUS) return perr("GPU index out of range 0..%d", MAX_GPUS - 1);
        for (unsigned i = a; i <= b; i++) *mask |= 1ull << i;
    }
    return 0;
}

static void defaults(void)
{
    for (int i = 0; i < MAX_GPUS; i++) {
        for (int k = 0; k < S_COUNT; k++) { free(S.gpu[i].s[k].t); free(S.gpu[i].s[k].v); }
    }
    memset(&S, 0, sizeof S);
    snprintf(S.driver_version, sizeof S.driver_version, "550.54.15");
    snprintf(S.nvml_version, sizeof S.nvml_version, "12.550.54.15");
    S.cuda_driver_version = 12040;
    S.process_info_size = 24;
    for (int i = 0; i < MAX_GPUS; i++) {
        gpu_t *g = &S.gpu[i];
        snprintf(g->name, sizeof g->name, "NVIDIA Fake GPU");
        snprintf(g->uuid, sizeof g->uuid, "GPU-fa4e0000-0000-4000-8000-%012x", i);
        snprintf(g->serial, sizeof g->serial, "16500000%05d", i);
        snprintf(g->pci_bus_id, sizeof g->pci_bus_id, "00000000:%02X:00.0", 0x10 + i);
        g->pci_device_id = 0x233010DE; g->pci_subsystem_id = 0x16C110DE;
        g->arch = 9; g->cc_major = 9; g->cc_minor = 0;
        g->mem_total = 80ull << 30;
        g->mig_max = 7;
        g->power_limit_mw = 700000;
        g->temp_threshold[0] = 92; g->temp_threshold[1] = 89; g->temp_threshold[2] = 95; g->temp_threshold[3] = 87;
        g->max_sm_clk = 1980; g->max_mem_clk = 2619; g->max_gr_clk = 1980; g->max_vid_clk = 1545;
        g->pcie_gen = 5; g->pcie_max_gen = 5; g->pcie_width = 16; g->pcie_max_width = 16;
        g->pcie_switch = 1000 + i; g->pcie_switch_hops = 1; g->cpu_socket = 0;   /* a switch of its own */
        g->ecc_mode = 1;
        g->mig_monitor = 1;
        g->gpm_min_interval_ms = 100;   /* nvml.h: "should be greater than 100ms" (DCGM: a hard limit) */
        g->putil_period_ms = 1000.0 / 6;   /* as the encoder/decoder sampling period (167 ms) */
        g->event_types = EV_DEFAULT_TYPES;
        g->lost_at = INFINITY;
        g->nvlink_speed_mbps = 26562;
        g->nvlink_version = 6;
        dev_handles[i].gpu = i; dev_handles[i].mig = -1;
        for (int m = 0; m < MAX_MIG; m++) { mig_handles[i][m].gpu = i; mig_handles[i][m].mig = m; }
    }
}

#ifndef FAKE_MISSING
#define FAKE_MISSING ""
#endif
static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* "b a" -> "a b": word lists compared as sets */
static void sorted_words(const char *in, char *out, size_t n)
{
    char buf[1024], *w[128];
    int k = 0;
    snprintf(buf, sizeof buf, "%s", in);
    char *save = NULL;
    for (char *tok = strtok_r(buf, " \t,", &save); tok && k < 128; tok = strtok_r(NULL, " \t,", &save)) w[k++] = tok;
    qsort(w, (size_t)k, sizeof w[0], cmp_str);
    out[0] = 0;
    for (int i = 0; i < k; i++)
        if (i == 0 || strcmp(w[i], w[i - 1]))
            snprintf(out + strlen(out), n - strlen(out), "%s%s", out[0] ? " " : "", w[i]);
}

/* missing_symbols are really absent (hidden by build.sh's version script, so dlsym fails as with an
 * older driver): the scenario and the library must agree. */
static int check_missing(void)
{
    char want[1024], have[1024];
    sorted_words(S.missing_symbols, want, sizeof want);
    sorted_words(FAKE_MISSING, have, sizeof have);
    if (strcmp(want, have)) {
        snprintf(scn_err, sizeof scn_err, "%.200s: missing_symbols '%.120s' but this library was built without '%.120s' "
                 "(use fakenvml.env(), which builds the matching library)", scn_path, want, have);
        return -1;
    }
    return 0;
}

static int cmp_events(const void *a, const void *b)
{
    const event_t *x = a, *y = b;
    return x->t < y->t ? -1 : x->t > y->t ? 1 : (x->gpu - y->gpu);
}

static int load_scenario(const char *path)
{
    defaults();
    scn_path = path; scn_line = 0; scn_err[0] = 0;
    FILE *f = fopen(path, "r");
    if (!f) { snprintf(scn_err, sizeof scn_err, "%s: %s", path, strerror(errno)); return -1; }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = 0; else snprintf(dir, sizeof dir, ".");
    uint64_t section = 0;
    char line[8192];
    int rc = 0;
    while (fgets(line, sizeof line, f)) {
        scn_line++;
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        char *s = trim(line);
        if (!*s) continue;
        if (*s == '[') {
            char *close = strchr(s, ']');
            if (!close || close[1]) { rc = perr("unterminated section header"); break; }
            *close = 0;
            if ((rc = parse_section(trim(s + 1), &section))) break;
            continue;
        }
        char *eq = strchr(s, '=');
        if (!eq) { rc = perr("expected KEY = VALUE"); break; }
        *eq = 0;
        char *key = trim(s), *val = trim(eq + 1);
        if (!section) { if ((rc = set_system_key(key, val, dir))) break; continue; }
        for (int i = 0; i < MAX_GPUS && !rc; i++) {
            if (!(section & (1ull << i))) continue;
            char copy[8192];
            snprintf(copy, sizeof copy, "%s", val);   /* strtok_r modifies its input */
            rc = set_gpu_key(&S.gpu[i], i, key, copy);
        }
        if (rc) break;
    }
    fclose(f);
    if (rc) return rc;
    /* events of GPUs beyond gpu_count (from [gpu *]) are dropped */
    int n = 0;
    for (int i = 0; i < S.n_events; i++) if (S.events[i].gpu < S.gpu_count) S.events[n++] = S.events[i];
    S.n_events = n;
    qsort(S.events, (size_t)S.n_events, sizeof S.events[0], cmp_events);
    if (check_missing()) return -1;
    for (int i = 0; i < S.gpu_count; i++)
        if (S.gpu[i].nvlink_max_links < S.gpu[i].nvlink_links) S.gpu[i].nvlink_max_links = S.gpu[i].nvlink_links;
    return 0;
}

/* ---------------------------------------------------------------- device lookup */
static int mig_on(const gpu_t *g, double t) { return gv(g, S_MIG_MODE, t) != 0; }

/* The index-th MIG device (a GPU instance with a compute instance) of g, or -1. */
static int mig_by_index(const gpu_t *g, unsigned index)
{
    unsigned k = 0;
    for (int i = 0; i < g->n_mig; i++)
        if (!g->mig[i].noci && k++ == index) return i;
    return -1;
}

static int handle_decode(nvmlDevice_t h, gpu_t **g, int *mig)
{
    if (!h) return -1;
    struct nvmlDevice_st *p = h;
    if (p >= &dev_handles[0] && p < &dev_handles[MAX_GPUS]) {
        int i = (int)(p - dev_handles);
        if (i >= S.gpu_count) return -1;
        *g = &S.gpu[i]; *mig = -1;
        return 0;
    }
    if (p >= &mig_handles[0][0] && p < &mig_handles[0][0] + MAX_GPUS * MAX_MIG) {
        int k = (int)(p - &mig_handles[0][0]), i = k / MAX_MIG, m = k % MAX_MIG;
        if (i >= S.gpu_count || !mig_on(&S.gpu[i], now_t()) || m >= S.gpu[i].n_mig || S.gpu[i].mig[m].noci) return -1;
        *g = &S.gpu[i]; *mig = m;
        return 0;
    }
    return -1;
}

static nvmlReturn_t injected(const gpu_t *g, const char *fn, double t)
{
    for (int i = 0; i < g->n_errs; i++)
        if (!strcmp(g->errs[i].fn, fn) && t >= g->errs[i].from && t < g->errs[i].to) return g->errs[i].code;
    return NVML_SUCCESS;
}

/* The common prologue of device functions: initialised, valid handle, not lost, not injected. */
static nvmlReturn_t dev_check(nvmlDevice_t h, const char *fn, int allow_mig, gpu_t **g, int *mig, double *t)
{
    if (refcount <= 0) return NVML_ERROR_UNINITIALIZED;
    if (handle_decode(h, g, mig)) return NVML_ERROR_INVALID_ARGUMENT;
    *t = now_t();
    if (*t >= (*g)->lost_at) return NVML_ERROR_GPU_IS_LOST;
    nvmlReturn_t r = injected(*g, fn, *t);
    if (r) return r;
    if (*mig >= 0 && !allow_mig) return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

#define DEV(h, allow_mig) gpu_t *g; int mig; double t; \
    { nvmlReturn_t r_ = dev_check(h, FN, allow_mig, &g, &mig, &t); if (r_) LEAVE(r_); } (void)mig; (void)t;
#define OUT(p) do { if (!(p)) LEAVE(NVML_ERROR_INVALID_ARGUMENT); } while (0)

static int id_in(const unsigned *ids, int n, unsigned id)
{
    for (int i = 0; i < n; i++) if (ids[i] == id) return 1;
    return 0;
}

static void put_str(char *dst, unsigned len, const char *src)
{
    if (!dst || !len) return;
    snprintf(dst, len, "%s", src);
}

/* ---------------------------------------------------------------- init / system */
static nvmlReturn_t do_init(const char *fn)
{
    ENTER(fn);
    if (!loaded) {
        const char *path = getenv("FAKE_NVML_SCENARIO");
        if (!path || !*path) LEAVE(NVML_ERROR_DRIVER_NOT_LOADED);
        if (load_scenario(path)) {
            fprintf(stderr, "fake_nvml: %s\n", scn_err);
            LEAVE(NVML_ERROR_UNKNOWN);
        }
        loaded = 1;
    }
    if (S.init_error) LEAVE(S.init_error);
    if (!t0_set) {
        /* FAKE_NVML_T0: a unix time, or "init+S": S seconds after this first nvmlInit (a test that
         * cannot know when a loaded machine gets the process this far). FAKE_NVML_T0_FILE: where
         * the resolved t = 0 is written, for such a test to read. */
        const char *e = getenv("FAKE_NVML_T0");
        int after_init = e && !strncmp(e, "init+", 5);
        const char *num = after_init ? e + 5 : e;
        char *end = NULL;
        double v = num && *num ? strtod(num, &end) : 0;
        int ok = num && *num && end && !*end;
        T0 = after_init ? wall_now() + (ok ? v : 0) : ok ? v : wall_now();
        t0_set = 1;
        const char *out = getenv("FAKE_NVML_T0_FILE");
        if (out && *out) {
            char tmp[4096];
            snprintf(tmp, sizeof tmp, "%s.tmp", out);
            FILE *f = fopen(tmp, "w");
            if (f) {
                fprintf(f, "%.6f\n", T0);
                if (fclose(f) == 0) rename(tmp, out);
            }
        }
    }
    refcount++;
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlInit(void) { return do_init("nvmlInit"); }
API nvmlReturn_t nvmlInit_v2(void) { return do_init("nvmlInit_v2"); }
API nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return do_init("nvmlInitWithFlags"); }

API nvmlReturn_t nvmlShutdown(void)
{
    ENTER("nvmlShutdown");
    REQUIRE_INIT();
    if (--refcount == 0) flush_calls();
    pthread_cond_broadcast(&waiters);
    LEAVE(NVML_SUCCESS);
}

API const char *nvmlErrorString(nvmlReturn_t result)
{
    for (size_t i = 0; i < sizeof errtab / sizeof errtab[0]; i++)
        if (errtab[i].code == result) return errtab[i].text;
    return "Unknown Error";
}

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    ENTER("nvmlSystemGetDriverVersion"); REQUIRE_INIT(); OUT(version);
    if (strlen(S.driver_version) + 1 > length) LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    put_str(version, length, S.driver_version);
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    ENTER("nvmlSystemGetNVMLVersion"); OUT(version);   /* works without nvmlInit, as in NVML */
    if (strlen(S.nvml_version) + 1 > length) LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    put_str(version, length, loaded ? S.nvml_version : "12.550.54.15");
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    ENTER("nvmlSystemGetCudaDriverVersion"); REQUIRE_INIT(); OUT(v);
    *v = S.cuda_driver_version;
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v)
{
    ENTER("nvmlSystemGetCudaDriverVersion_v2"); REQUIRE_INIT(); OUT(v);
    *v = S.cuda_driver_version;
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int length)
{
    ENTER("nvmlSystemGetProcessName"); REQUIRE_INIT(); OUT(name); OUT(length);
    for (int i = 0; i < S.gpu_count; i++)
        for (int k = 0; k < S.gpu[i].n_procs; k++)
            if (S.gpu[i].procs[k].pid == pid && S.gpu[i].procs[k].name[0]) {
                put_str(name, length, S.gpu[i].procs[k].name);
                LEAVE(NVML_SUCCESS);
            }
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%u/comm", pid);
    FILE *f = fopen(path, "r");
    if (!f) LEAVE(NVML_ERROR_NOT_FOUND);
    if (!fgets(buf, sizeof buf, f)) buf[0] = 0;
    fclose(f);
    buf[strcspn(buf, "\n")] = 0;
    put_str(name, length, buf);
    LEAVE(NVML_SUCCESS);
}

/* ---------------------------------------------------------------- handles and identity */
static nvmlReturn_t get_count(const char *fn, unsigned int *count)
{
    ENTER(fn); REQUIRE_INIT(); OUT(count);
    *count = (unsigned)S.gpu_count;
    LEAVE(NVML_SUCCESS);
}
API nvmlReturn_t nvmlDeviceGetCount(unsigned int *c) { return get_count("nvmlDeviceGetCount", c); }
API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *c) { return get_count("nvmlDeviceGetCount_v2", c); }

static nvmlReturn_t get_handle(const char *fn, unsigned int index, nvmlDevice_t *device)
{
    ENTER(fn); REQUIRE_INIT(); OUT(device);
    if (index >= (unsigned)S.gpu_count) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    gpu_t *g = &S.gpu[index];
    double t = now_t();
    if (t >= g->lost_at) LEAVE(NVML_ERROR_GPU_IS_LOST);
    nvmlReturn_t r = injected(g, fn, t);
    if (r) LEAVE(r);
    *device = &dev_handles[index];
    LEAVE(NVML_SUCCESS);
}
API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int i, nvmlDevice_t *d) { return get_handle("nvmlDeviceGetHandleByIndex", i, d); }
API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) { return get_handle("nvmlDeviceGetHandleByIndex_v2", i, d); }

API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    ENTER("nvmlDeviceGetHandleByUUID"); REQUIRE_INIT(); OUT(uuid); OUT(device);
    for (int i = 0; i < S.gpu_count; i++)
        if (!strcmp(S.gpu[i].uuid, uuid)) {
            if (now_t() >= S.gpu[i].lost_at) LEAVE(NVML_ERROR_GPU_IS_LOST);
            *device = &dev_handles[i];
            LEAVE(NVML_SUCCESS);
        }
    LEAVE(NVML_ERROR_NOT_FOUND);
}

API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus, nvmlDevice_t *device)
{
    ENTER("nvmlDeviceGetHandleByPciBusId_v2"); REQUIRE_INIT(); OUT(bus); OUT(device);
    for (int i = 0; i < S.gpu_count; i++) {
        const char *mine = S.gpu[i].pci_bus_id;
        size_t lm = strlen(mine), lb = strlen(bus);   /* accept the short (legacy) form too */
        if (!strcasecmp(mine, bus) || (lb < lm && !strcasecmp(mine + (lm - lb), bus))) {
            if (now_t() >= S.gpu[i].lost_at) LEAVE(NVML_ERROR_GPU_IS_LOST);
            *device = &dev_handles[i];
            LEAVE(NVML_SUCCESS);
        }
    }
    LEAVE(NVML_ERROR_NOT_FOUND);
}

API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t h, unsigned int *index)
{
    ENTER("nvmlDeviceGetIndex"); DEV(h, 0); OUT(index);
    *index = (unsigned)(g - S.gpu);
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t h, char *name, unsigned int length)
{
    ENTER("nvmlDeviceGetName"); DEV(h, 1); OUT(name);
    char buf[160];
    if (mig >= 0) snprintf(buf, sizeof buf, "%s MIG %s", g->name, g->mig[mig].profile);
    else snprintf(buf, sizeof buf, "%s", g->name);
    if (strlen(buf) + 1 > length) LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    put_str(name, length, buf);
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t h, char *uuid, unsigned int length)
{
    ENTER("nvmlDeviceGetUUID"); DEV(h, 1); OUT(uuid);
    char buf[128];
    if (mig >= 0)
        snprintf(buf, sizeof buf, "MIG-%08x-fa4e-4000-8000-%012x", (unsigned)(g - S.gpu), g->mig[mig].gi);
    else snprintf(buf, sizeof buf, "%s", g->uuid);
    if (strlen(buf) + 1 > length) LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    put_str(uuid, length, buf);
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t h, char *serial, unsigned int length)
{
    ENTER("nvmlDeviceGetSerial"); DEV(h, 0); OUT(serial);
    if (strlen(g->serial) + 1 > length) LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    put_str(serial, length, g->serial);
    LEAVE(NVML_SUCCESS);
}

static nvmlReturn_t pci_info(const char *fn, nvmlDevice_t h, nvmlPciInfo_t *pci)
{
    ENTER(fn); DEV(h, 0); OUT(pci);
    unsigned dom = 0, bus = 0, dev = 0, func = 0;
    sscanf(g->pci_bus_id, "%x:%x:%x.%x", &dom, &bus, &dev, &func);
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", dom & 0xFFFF, bus, dev, func);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", dom, bus, dev, func);
    pci->domain = dom; pci->bus = bus; pci->device = dev;
    pci->pciDeviceId = g->pci_device_id; pci->pciSubSystemId = g->pci_subsystem_id;
    LEAVE(NVML_SUCCESS);
}
API nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t h, nvmlPciInfo_t *p) { return pci_info("nvmlDeviceGetPciInfo", h, p); }
API nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t h, nvmlPciInfo_t *p) { return pci_info("nvmlDeviceGetPciInfo_v2", h, p); }
API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t h, nvmlPciInfo_t *p) { return pci_info("nvmlDeviceGetPciInfo_v3", h, p); }

API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t h, int *major, int *minor)
{
    ENTER("nvmlDeviceGetCudaComputeCapability"); DEV(h, 1); OUT(major); OUT(minor);
    *major = (int)g->cc_major; *minor = (int)g->cc_minor;
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t h, unsigned int *arch)
{
    ENTER("nvmlDeviceGetArchitecture"); DEV(h, 1); OUT(arch);
    *arch = g->arch;
    LEAVE(NVML_SUCCESS);
}

/* ---------------------------------------------------------------- memory and MIG */
static void mem_now(const gpu_t *g, int mig, double t, unsigned long long *total,
                    unsigned long long *reserved, unsigned long long *used)
{
    if (mig >= 0) { *total = g->mig[mig].total; *reserved = 0; *used = g->mig[mig].used; }
    else {
        *total = g->mem_total; *reserved = g->mem_reserved;
        *used = u64(gv(g, S_MEM_USED, t));
        if (mig_on(g, t)) {   /* the whole GPU: what its instances use */
            *used = 0;
            for (int i = 0; i < g->n_mig; i++) *used += g->mig[i].used;
        }
    }
    if (*reserved > *total) *reserved = *total;
    if (*used > *total - *reserved) *used = *total - *reserved;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t h, nvmlMemory_t *m)
{
    ENTER("nvmlDeviceGetMemoryInfo"); DEV(h, 1); OUT(m);
    if (mig < 0 && mig_on(g, t) && !g->mig_monitor) LEAVE(NVML_ERROR_NO_PERMISSION);  /* aggregate: monitor cap */
    unsigned long long total, reserved, used;
    mem_now(g, mig, t, &total, &reserved, &used);
    m->total = total; m->used = used + reserved; m->free = total - used - reserved;  /* v1: used includes reserved */
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t h, nvmlMemory_v2_t *m)
{
    ENTER("nvmlDeviceGetMemoryInfo_v2"); DEV(h, 1); OUT(m);
    if (mig < 0 && mig_on(g, t) && !g->mig_monitor) LEAVE(NVML_ERROR_NO_PERMISSION);
    if (m->version != nvmlMemory_v2) LEAVE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    unsigned long long total, reserved, used;
    mem_now(g, mig, t, &total, &reserved, &used);
    m->total = total; m->reserved = reserved; m->used = used; m->free = total - reserved - used;
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t h, unsigned int *current, unsigned int *pending)
{
    ENTER("nvmlDeviceGetMigMode"); DEV(h, 0); OUT(current); OUT(pending);
    *current = *pending = (unsigned)mig_on(g, t);
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t h, unsigned int *count)
{
    ENTER("nvmlDeviceGetMaxMigDeviceCount"); DEV(h, 0); OUT(count);
    *count = g->mig_max;
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t h, unsigned int index, nvmlDevice_t *out)
{
    ENTER("nvmlDeviceGetMigDeviceHandleByIndex"); DEV(h, 0); OUT(out);
    if (index >= g->mig_max) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    int m = mig_on(g, t) ? mig_by_index(g, index) : -1;
    if (m < 0) LEAVE(NVML_ERROR_NOT_FOUND);
    *out = &mig_handles[g - S.gpu][m];
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t h, unsigned int *is_mig)
{
    ENTER("nvmlDeviceIsMigDeviceHandle"); DEV(h, 1); OUT(is_mig);
    *is_mig = mig >= 0;
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t h, unsigned int *id)
{
    ENTER("nvmlDeviceGetGpuInstanceId"); DEV(h, 1); OUT(id);
    if (mig < 0) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *id = g->mig[mig].gi;
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t h, unsigned int *id)
{
    ENTER("nvmlDeviceGetComputeInstanceId"); DEV(h, 1); OUT(id);
    if (mig < 0) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *id = 0;
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t h, nvmlDevice_t *out)
{
    ENTER("nvmlDeviceGetDeviceHandleFromMigDeviceHandle"); DEV(h, 1); OUT(out);
    if (mig < 0) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *out = &dev_handles[g - S.gpu];
    LEAVE(NVML_SUCCESS);
}

/* ---------------------------------------------------------------- utilisation, clocks, power */
API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t h, nvmlUtilization_t *u)
{
    ENTER("nvmlDeviceGetUtilizationRates"); DEV(h, 0); OUT(u);
    if (mig_on(g, t)) LEAVE(NVML_ERROR_NOT_SUPPORTED);   /* as on real GPUs with MIG enabled */
    u->gpu = u32(gv(g, S_GPU_UTIL, t));
    u->memory = u32(gv(g, S_MEM_UTIL, t));
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t h, unsigned int counter, unsigned int *value)
{
    ENTER("nvmlDeviceGetPcieThroughput"); DEV(h, 0); OUT(value);
    if (counter > 1) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *value = u32(gv(g, counter == 0 ? S_PCIE_TX : S_PCIE_RX, t));
    LEAVE(NVML_SUCCESS);
}

static double clock_now(const gpu_t *g, unsigned type, double t)
{
    switch (type) {
    case 0: return gv(g, has(g, S_GR_CLK) ? S_GR_CLK : S_SM_CLK, t);
    case 1: return gv(g, S_SM_CLK, t);
    case 2: return gv(g, S_MEM_CLK, t);
    default: return gv(g, S_VID_CLK, t);
    }
}

static unsigned clock_max(const gpu_t *g, unsigned type)
{
    return type == 0 ? g->max_gr_clk : type == 1 ? g->max_sm_clk : type == 2 ? g->max_mem_clk : g->max_vid_clk;
}

API nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t h, unsigned int type, unsigned int *clock)
{
    ENTER("nvmlDeviceGetClockInfo"); DEV(h, 0); OUT(clock);
    if (type > 3) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *clock = u32(clock_now(g, type, t));
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t h, unsigned int type, unsigned int *clock)
{
    ENTER("nvmlDeviceGetMaxClockInfo"); DEV(h, 0); OUT(clock);
    if (type > 3) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *clock = clock_max(g, type);
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetClock(nvmlDevice_t h, unsigned int type, unsigned int id, unsigned int *clock)
{
    ENTER("nvmlDeviceGetClock"); DEV(h, 0); OUT(clock);
    if (type > 3 || id > 3) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *clock = id == 0 ? u32(clock_now(g, type, t)) : clock_max(g, type);
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t h, unsigned int *mw)
{
    ENTER("nvmlDeviceGetPowerUsage"); DEV(h, 0); OUT(mw);
    *mw = u32(gv(g, S_POWER, t));
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t h, unsigned int *mw)
{
    ENTER("nvmlDeviceGetEnforcedPowerLimit"); DEV(h, 0); OUT(mw);
    *mw = g->power_limit_mw;
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t h, unsigned int *mw)
{
    ENTER("nvmlDeviceGetPowerManagementLimit"); DEV(h, 0); OUT(mw);
    *mw = g->power_limit_mw;
    LEAVE(NVML_SUCCESS);
}

static unsigned long long energy_mj(const gpu_t *g, double t)   /* mW integrated over s = mJ */
{
    return u64(g->energy_start_mj + gi_(g, S_POWER, t));
}

API nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t h, unsigned long long *mj)
{
    ENTER("nvmlDeviceGetTotalEnergyConsumption"); DEV(h, 0); OUT(mj);
    *mj = energy_mj(g, t);
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t h, unsigned int sensor, unsigned int *temp)
{
    ENTER("nvmlDeviceGetTemperature"); DEV(h, 0); OUT(temp);
    if (sensor != 0) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *temp = u32(gv(g, S_GPU_TEMP, t));
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t h, nvmlTemperature_v1_t *temp)
{
    ENTER("nvmlDeviceGetTemperatureV"); DEV(h, 0); OUT(temp);
    if (temp->version != nvmlTemperature_v1) LEAVE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (temp->sensorType != 0) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    temp->temperature = (int)lround(gv(g, S_GPU_TEMP, t));
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t h, unsigned int *pct)
{
    ENTER("nvmlDeviceGetFanSpeed"); DEV(h, 0); OUT(pct);
    if (!has(g, S_FAN)) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *pct = u32(gv(g, S_FAN, t));
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t h, unsigned int type, unsigned int *temp)
{
    ENTER("nvmlDeviceGetTemperatureThreshold"); DEV(h, 0); OUT(temp);
    if (type > 7) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (type > 3 || !g->temp_threshold[type]) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *temp = g->temp_threshold[type];
    LEAVE(NVML_SUCCESS);
}

static nvmlReturn_t codec(const char *fn, nvmlDevice_t h, int series, unsigned int *util, unsigned int *period_us)
{
    ENTER(fn); DEV(h, 0); OUT(util); OUT(period_us);
    *util = u32(gv(g, series, t));      /* unset: an idle NVENC/NVDEC, 0 % */
    *period_us = 167000;                /* what R550 drivers report for a busy GPU (about 1/6 s) */
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t h, unsigned int *u, unsigned int *p) { return codec("nvmlDeviceGetEncoderUtilization", h, S_ENC_UTIL, u, p); }
API nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t h, unsigned int *u, unsigned int *p) { return codec("nvmlDeviceGetDecoderUtilization", h, S_DEC_UTIL, u, p); }

static nvmlReturn_t reasons(const char *fn, nvmlDevice_t h, unsigned long long *r)
{
    ENTER(fn); DEV(h, 0); OUT(r);
    *r = u64(gv(g, S_REASONS, t));
    LEAVE(NVML_SUCCESS);
}
API nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t h, unsigned long long *r) { return reasons("nvmlDeviceGetCurrentClocksEventReasons", h, r); }
API nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t h, unsigned long long *r) { return reasons("nvmlDeviceGetCurrentClocksThrottleReasons", h, r); }

API nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t h, unsigned int *v)
{ ENTER("nvmlDeviceGetCurrPcieLinkGeneration"); DEV(h, 0); OUT(v); *v = g->pcie_gen; LEAVE(NVML_SUCCESS); }
API nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t h, unsigned int *v)
{ ENTER("nvmlDeviceGetMaxPcieLinkGeneration"); DEV(h, 0); OUT(v); *v = g->pcie_max_gen; LEAVE(NVML_SUCCESS); }
API nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t h, unsigned int *v)
{ ENTER("nvmlDeviceGetCurrPcieLinkWidth"); DEV(h, 0); OUT(v); *v = g->pcie_width; LEAVE(NVML_SUCCESS); }
API nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t h, unsigned int *v)
{ ENTER("nvmlDeviceGetMaxPcieLinkWidth"); DEV(h, 0); OUT(v); *v = g->pcie_max_width; LEAVE(NVML_SUCCESS); }


/* nvml.h: INVALID_ARGUMENT for an invalid device or NULL pathInfo, NOT_SUPPORTED "if the device or OS
 * does not support this feature", UNKNOWN on a topology discovery error (inject with `error`). Two
 * GPUs with the same `pcie_switch` meet at a switch: SINGLE, or MULTIPLE when either is more than one
 * switch below it (`pcie_switch_hops`); else at the CPU (NODE) on one `cpu_socket`, else SYSTEM. */
API nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t h, nvmlDevice_t h2, unsigned int *level)
{
    ENTER("nvmlDeviceGetTopologyCommonAncestor"); DEV(h, 0); OUT(level);
    gpu_t *g2; int mig2; double t2;
    nvmlReturn_t r2 = dev_check(h2, FN, 0, &g2, &mig2, &t2);
    if (r2) LEAVE(r2);
    if (g2 == g) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (g->pcie_switch == g2->pcie_switch)
        *level = (g->pcie_switch_hops > 1 || g2->pcie_switch_hops > 1) ? 20 : 10;   /* MULTIPLE : SINGLE */
    else
        *level = g->cpu_socket == g2->cpu_socket ? 40 : 50;                        /* NODE : SYSTEM */
    LEAVE(NVML_SUCCESS);
}

/* ---------------------------------------------------------------- ECC and remapped rows */
API nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t h, unsigned int type, unsigned int counter,
                                             unsigned long long *count)
{
    ENTER("nvmlDeviceGetTotalEccErrors"); DEV(h, 0); OUT(count);
    if (type > 1 || counter > 1) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (!g->ecc_mode) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    int vol = type == 0 ? S_ECC_SBE_VOL : S_ECC_DBE_VOL, agg = type == 0 ? S_ECC_SBE_AGG : S_ECC_DBE_AGG;
    int id = counter == 0 ? vol : has(g, agg) ? agg : vol;
    *count = u64(gv(g, id, t));
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t h, unsigned int *cor, unsigned int *unc,
                                           unsigned int *pending, unsigned int *failure)
{
    ENTER("nvmlDeviceGetRemappedRows"); DEV(h, 0); OUT(cor); OUT(unc); OUT(pending); OUT(failure);
    *cor = u32(gv(g, S_REMAP_COR, t)); *unc = u32(gv(g, S_REMAP_UNC, t));
    *pending = gv(g, S_REMAP_PEND, t) != 0; *failure = gv(g, S_REMAP_FAIL, t) != 0;
    LEAVE(NVML_SUCCESS);
}

/* ---------------------------------------------------------------- NVLink */
API nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t h, unsigned int link, unsigned int *active)
{
    ENTER("nvmlDeviceGetNvLinkState"); DEV(h, 0); OUT(active);
    if (g->nvlink_max_links == 0) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    if (link >= g->nvlink_max_links) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *active = link < g->nvlink_links;
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t h, unsigned int link, unsigned int *version)
{
    ENTER("nvmlDeviceGetNvLinkVersion"); DEV(h, 0); OUT(version);
    if (g->nvlink_max_links == 0) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    if (link >= g->nvlink_max_links) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *version = g->nvlink_version;
    LEAVE(NVML_SUCCESS);
}

/* Cumulative NVLink data in KiB over all links: the integral of the MiB/s rate x 1024. */
static double nvlink_kib(const gpu_t *g, int sid, double t) { return gi_(g, sid, t) * 1024.0; }

static void field_one(const gpu_t *g, int mig, double t, nvmlFieldValue_t *v)
{
    unsigned id = v->fieldId, scope = v->scopeId;
    v->nvmlReturn = NVML_SUCCESS;
    v->latencyUsec = 0;
    memset(&v->value, 0, sizeof v->value);
    if (mig >= 0 || id_in(g->unsup_fields, g->n_unsup_fields, id)) { v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED; return; }
#define UI(x) do { v->valueType = VT_UINT; v->value.uiVal = (x); } while (0)
#define ULL(x) do { v->valueType = VT_ULL; v->value.ullVal = (x); } while (0)
    switch (id) {
    case 1: UI(g->ecc_mode); return;                                          /* ECC_CURRENT */
    case 3: case 4: case 5: case 6: {                                          /* ECC totals */
        if (!g->ecc_mode) break;
        int vol = (id == 3 || id == 5) ? S_ECC_SBE_VOL : S_ECC_DBE_VOL;
        int agg = (id == 3 || id == 5) ? S_ECC_SBE_AGG : S_ECC_DBE_AGG;
        ULL(u64(gv(g, (id >= 5 && has(g, agg)) ? agg : vol, t)));
        return;
    }
    case 45: case 52: case 59:                                                 /* NVLink error totals */
        if (!g->nvlink_links) break;
        ULL(u64(gv(g, id == 45 ? S_NVL_CRC : id == 52 ? S_NVL_REPLAY : S_NVL_RECOVERY, t)));
        return;
    case 82: if (!has(g, S_MEM_TEMP)) break; UI(u32(gv(g, S_MEM_TEMP, t))); return;   /* MEMORY_TEMP */
    case 83: ULL(energy_mj(g, t)); return;                                     /* TOTAL_ENERGY mJ */
    case 90: if (!g->nvlink_links) break; UI(g->nvlink_speed_mbps); return;    /* SPEED_MBPS_COMMON */
    case 91: UI(g->nvlink_links); return;                                      /* LINK_COUNT */
    case 138: case 139: case 140: case 141: {                                  /* THROUGHPUT KiB */
        if (!g->nvlink_links) break;
        double kib = nvlink_kib(g, (id == 138 || id == 140) ? S_NVL_TX : S_NVL_RX, t);
        if (id >= 140) kib *= 1.0625;                                          /* + protocol overhead */
        if (scope == SCOPE_ALL_LINKS) { ULL(u64(kib)); return; }
        if (scope >= NVML_NVLINK_MAX_LINKS) { v->nvmlReturn = NVML_ERROR_INVALID_ARGUMENT; return; }
        ULL(scope < g->nvlink_links ? u64(kib / g->nvlink_links) : 0);
        return;
    }
    case 142: UI(u32(gv(g, S_REMAP_COR, t))); return;
    case 143: UI(u32(gv(g, S_REMAP_UNC, t))); return;
    case 144: UI(gv(g, S_REMAP_PEND, t) != 0); return;
    case 145: UI(gv(g, S_REMAP_FAIL, t) != 0); return;
    case 185: case 186: UI(u32(gv(g, S_POWER, t))); return;                    /* POWER_AVERAGE/INSTANT mW */
    case 197: ULL(u64(gi_(g, S_PCIE_TX, t) * 1024.0)); return;                 /* PCIE_COUNT_TX_BYTES */
    case 198: ULL(u64(gi_(g, S_PCIE_RX, t) * 1024.0)); return;                 /* PCIE_COUNT_RX_BYTES */
    default: break;
    }
#undef UI
#undef ULL
    v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
}

/* field_type: the same value in another union member, as drivers change a field's valueType from
 * one release to the next (the reader must go by valueType, never assume one). */
static void retype(const gpu_t *g, nvmlFieldValue_t *v)
{
    int k = -1;
    for (int i = 0; i < g->n_field_types; i++) if (g->field_type_id[i] == v->fieldId) k = i;
    if (k < 0) return;
    double x = v->valueType == VT_UINT ? (double)v->value.uiVal : (double)v->value.ullVal;
    if (v->valueType == VT_UINT && v->value.uiVal == 0xFFFFFFFFu) x = -1;   /* all-ones stays all-ones */
    memset(&v->value, 0, sizeof v->value);
    v->valueType = g->field_type[k];
    switch (v->valueType) {
    case VT_DOUBLE: v->value.dVal = x; break;
    case VT_UINT: v->value.uiVal = (unsigned)(long long)x; break;
    case VT_ULONG: v->value.ulVal = (unsigned long)(long long)x; break;
    case VT_ULL: v->value.ullVal = (unsigned long long)(long long)x; break;
    case VT_SLL: v->value.sllVal = (long long)x; break;
    case VT_SINT: v->value.siVal = (int)x; break;
    case 6: v->value.usVal = (unsigned short)(long long)x; break;
    default: v->value.ullVal = (unsigned long long)(long long)x; break;   /* a type newer than the reader */
    }
}

API nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t h, int count, nvmlFieldValue_t *values)
{
    ENTER("nvmlDeviceGetFieldValues"); DEV(h, 1);
    if (count <= 0 || !values) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    double wall = t + T0;
    int64_t ts = (int64_t)(wall * 1e6);
    for (int i = 0; i < count; i++) {
        values[i].timestamp = ts;
        field_one(g, mig, t, &values[i]);
        if (values[i].nvmlReturn == NVML_SUCCESS) retype(g, &values[i]);
    }
    LEAVE(NVML_SUCCESS);
}

/* ---------------------------------------------------------------- processes */
static int collect_procs(const gpu_t *g, int gpu_index, int mig, nvmlProcessInfo_t *out, int cap)
{
    int n = 0;
    unsigned want_gi = mig >= 0 ? g->mig[mig].gi : NO_INSTANCE;
    for (int i = 0; i < g->n_procs; i++) {
        if (mig >= 0) continue;   /* static processes belong to the whole GPU */
        if (n < cap) {
            out[n].pid = g->procs[i].pid; out[n].usedGpuMemory = g->procs[i].used;
            out[n].gpuInstanceId = NO_INSTANCE; out[n].computeInstanceId = NO_INSTANCE;
        }
        n++;
    }
    const char *path = getenv("FAKE_NVML_PROCS");
    if (!path || !*path) path = S.procs_file[0] ? S.procs_file : NULL;
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return n;
    char line[512];
    while (fgets(line, sizeof line, f)) {   /* GPU_INDEX PID USED_BYTES [GI [CI]] */
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        long long gi = -1, ci = -1;
        int idx;
        unsigned pid;
        unsigned long long used;
        int k = sscanf(line, "%d %u %llu %lld %lld", &idx, &pid, &used, &gi, &ci);
        if (k < 3 || idx != gpu_index) continue;
        unsigned pgi = gi < 0 ? NO_INSTANCE : (unsigned)gi, pci = ci < 0 ? NO_INSTANCE : (unsigned)ci;
        if (mig >= 0 && pgi != want_gi) continue;
        if (n < cap) {
            out[n].pid = pid; out[n].usedGpuMemory = used;
            out[n].gpuInstanceId = pgi; out[n].computeInstanceId = pci;
        }
        n++;
    }
    fclose(f);
    return n;
}

/* One process entry as a driver generation lays it out: 16 bytes (v1: pid, usedGpuMemory), 24 (v2,
 * and v3 in most drivers: + gpuInstanceId, computeInstanceId) or 32 (v3 in R535.43-535.86, nvml.h
 * 12.2: + usedGpuCcProtectedMemory). pynvml's _v3 reader assumes 24, so a 32-byte driver shifts
 * every entry after the first: pids read as 0 or 4294967295 (nvitop issues 75, 88, PR 89). */
static void put_proc(unsigned char *out, unsigned size, const nvmlProcessInfo_t *p)
{
    memset(out, 0, size);
    memcpy(out, &p->pid, 4);
    memcpy(out + 8, &p->usedGpuMemory, 8);
    if (size >= 24) { memcpy(out + 16, &p->gpuInstanceId, 4); memcpy(out + 20, &p->computeInstanceId, 4); }
    /* size 32: usedGpuCcProtectedMemory (out + 24) = 0, no confidential computing */
}

static nvmlReturn_t procs(const char *fn, nvmlDevice_t h, unsigned int *count, void *infos, int compute,
                          unsigned size)
{
    ENTER(fn); DEV(h, 1); OUT(count);
    if (mig < 0 && mig_on(g, t) && !g->mig_monitor) LEAVE(NVML_ERROR_NO_PERMISSION);
    nvmlProcessInfo_t tmp[256];
    int n = compute ? collect_procs(g, (int)(g - S.gpu), mig, tmp, 256) : 0;
    if (n > 256) n = 256;
    if (!infos || *count < (unsigned)n) {
        *count = (unsigned)n;
        LEAVE(n == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (int i = 0; i < n; i++) put_proc((unsigned char *)infos + (size_t)i * size, size, &tmp[i]);
    *count = (unsigned)n;
    LEAVE(NVML_SUCCESS);
}
#define PROCS(name, compute, size) \
    API nvmlReturn_t name(nvmlDevice_t h, unsigned int *c, void *p) { return procs(#name, h, c, p, compute, size); }
PROCS(nvmlDeviceGetComputeRunningProcesses, 1, 16)
PROCS(nvmlDeviceGetComputeRunningProcesses_v2, 1, 24)
PROCS(nvmlDeviceGetComputeRunningProcesses_v3, 1, S.process_info_size)
PROCS(nvmlDeviceGetGraphicsRunningProcesses_v3, 0, S.process_info_size)
PROCS(nvmlDeviceGetMPSComputeRunningProcesses_v3, 0, S.process_info_size)

typedef struct {                                          /* c_nvmlProcessDetail_v1_t: 32 bytes */
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
    unsigned long long usedGpuCcProtectedMemory;
} nvmlProcessDetail_v1_t;
typedef struct {                                          /* c_nvmlProcessDetailList_v1_t */
    unsigned int version, mode, numProcArrayEntries;
    nvmlProcessDetail_v1_t *procArray;
} nvmlProcessDetailList_v1_t;
#define nvmlProcessDetailList_v1 ((unsigned)(sizeof(nvmlProcessDetailList_v1_t) | (1u << 24)))  /* 0x1000018 */

/* R535.98 and newer: the versioned process call that replaced the 32-byte _v3 entries. */
API nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t h, nvmlProcessDetailList_v1_t *plist)
{
    ENTER("nvmlDeviceGetRunningProcessDetailList"); DEV(h, 1); OUT(plist);
    if (plist->version != nvmlProcessDetailList_v1) LEAVE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (mig < 0 && mig_on(g, t) && !g->mig_monitor) LEAVE(NVML_ERROR_NO_PERMISSION);
    nvmlProcessInfo_t tmp[256];
    int n = plist->mode == 0 ? collect_procs(g, (int)(g - S.gpu), mig, tmp, 256) : 0;
    if (n > 256) n = 256;
    if (!plist->procArray || plist->numProcArrayEntries < (unsigned)n) {
        plist->numProcArrayEntries = (unsigned)n;
        LEAVE(n == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (int i = 0; i < n; i++) {
        nvmlProcessDetail_v1_t *d = &plist->procArray[i];
        d->pid = tmp[i].pid; d->usedGpuMemory = tmp[i].usedGpuMemory;
        d->gpuInstanceId = tmp[i].gpuInstanceId; d->computeInstanceId = tmp[i].computeInstanceId;
        d->usedGpuCcProtectedMemory = 0;
    }
    plist->numProcArrayEntries = (unsigned)n;
    LEAVE(NVML_SUCCESS);
}

/* Present from R535 on (confidential computing); this fake has none: NOT_SUPPORTED, as on GPUs without CC. */
API nvmlReturn_t nvmlDeviceGetConfComputeMemSizeInfo(nvmlDevice_t h, void *info)
{
    ENTER("nvmlDeviceGetConfComputeMemSizeInfo"); DEV(h, 0); OUT(info);
    LEAVE(NVML_ERROR_NOT_SUPPORTED);
}

/* ---------------------------------------------------------------- per-process utilisation */
typedef struct {                                          /* c_nvmlProcessUtilizationSample_t */
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;
typedef struct {                                          /* c_nvmlProcessUtilizationInfo_v1_t */
    unsigned long long timeStamp;
    unsigned int pid, smUtil, memUtil, encUtil, decUtil, jpgUtil, ofaUtil;
} nvmlProcessUtilizationInfo_v1_t;
typedef struct {                                          /* c_nvmlProcessesUtilizationInfo_v1_t */
    unsigned int version, processSamplesCount;
    unsigned long long lastSeenTimeStamp;
    nvmlProcessUtilizationInfo_v1_t *procUtilArray;
} nvmlProcessesUtilizationInfo_t;
#define nvmlProcessesUtilizationInfo_v1 ((unsigned)(sizeof(nvmlProcessesUtilizationInfo_t) | (1u << 24)))  /* 0x1000018 */
_Static_assert(sizeof(nvmlProcessUtilizationSample_t) == 32, "c_nvmlProcessUtilizationSample_t");
_Static_assert(sizeof(nvmlProcessUtilizationInfo_v1_t) == 40, "c_nvmlProcessUtilizationInfo_v1_t");

typedef struct { unsigned pid; unsigned long long ts; unsigned v[6]; } putil_sample_t;

static const putil_t *putil_of(const gpu_t *g, unsigned pid)
{
    for (int i = g->n_putil - 1; i >= 0; i--) if (g->putil[i].pid == pid) return &g->putil[i];
    return NULL;
}

/* The samples newer than last_seen (wall-clock us) of the processes a handle lists. The driver samples
 * every process_util_period_ms (sample k at t = k x period); a process's values come from its
 * process_util line while FROM <= t < TO, else it shares the GPU's gpu_util, mem_util, enc_util and
 * dec_util equally with the handle's other processes without a line. One sample per process (its
 * newest), and only one with some non-zero value, as nvml.h says. */
static int putil_samples(const gpu_t *g, int mig, double t, unsigned long long last_seen, putil_sample_t *out)
{
    nvmlProcessInfo_t procs[256];
    int np = collect_procs(g, (int)(g - S.gpu), mig, procs, 256), shared = 0, n = 0;
    if (np > 256) np = 256;
    for (int i = 0; i < np; i++) shared += putil_of(g, procs[i].pid) == NULL;
    double period = g->putil_period_ms / 1000.0, newest = floor(t / period) * period;
    for (int i = 0; i < np; i++) {
        const putil_t *u = putil_of(g, procs[i].pid);
        double at = newest;
        unsigned v[6] = {0, 0, 0, 0, 0, 0};
        if (u) {
            if (at >= u->to) at = (ceil(u->to / period) - 1) * period;   /* the last sample before TO */
            if (at < u->from) continue;
            memcpy(v, u->v, sizeof v);
        } else {
            static const int ids[4] = {S_GPU_UTIL, S_MEM_UTIL, S_ENC_UTIL, S_DEC_UTIL};
            for (int k = 0; k < 4; k++) v[k] = (unsigned)(gv(g, ids[k], at) / shared);
        }
        unsigned long long ts = (unsigned long long)llround((T0 + at) * 1e6);
        if (ts <= last_seen || !(v[0] | v[1] | v[2] | v[3] | v[4] | v[5])) continue;
        out[n].pid = procs[i].pid; out[n].ts = ts;
        memcpy(out[n].v, v, sizeof v);
        n++;
    }
    return n;
}

/* nvml.h: "On MIG-enabled GPUs, querying process utilization is not currently supported" (both calls);
 * mig_process_util = yes makes a MIG device handle answer for its own instance's processes. */
static int putil_refused(const gpu_t *g, int mig, double t)
{
    return mig_on(g, t) && (mig < 0 || !g->mig_process_util);
}

API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t h, nvmlProcessUtilizationSample_t *utilization,
                                                 unsigned int *processSamplesCount, unsigned long long lastSeenTimeStamp)
{
    ENTER("nvmlDeviceGetProcessUtilization"); DEV(h, 1); OUT(processSamplesCount);
    if (putil_refused(g, mig, t)) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    putil_sample_t tmp[256];
    int n = putil_samples(g, mig, t, lastSeenTimeStamp, tmp);
    if (n == 0) LEAVE(NVML_ERROR_NOT_FOUND);          /* no sample since lastSeenTimeStamp */
    if (!utilization || *processSamplesCount < (unsigned)n) {
        *processSamplesCount = (unsigned)n;
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (int i = 0; i < n; i++) {
        nvmlProcessUtilizationSample_t *o = &utilization[i];
        o->pid = tmp[i].pid; o->timeStamp = tmp[i].ts;
        o->smUtil = tmp[i].v[0]; o->memUtil = tmp[i].v[1]; o->encUtil = tmp[i].v[2]; o->decUtil = tmp[i].v[3];
    }
    *processSamplesCount = (unsigned)n;
    LEAVE(NVML_SUCCESS);
}

/* R550 and newer: the versioned call, with JPEG and OFA utilisation. */
API nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t h, nvmlProcessesUtilizationInfo_t *info)
{
    ENTER("nvmlDeviceGetProcessesUtilizationInfo"); DEV(h, 1); OUT(info);
    if (info->version != nvmlProcessesUtilizationInfo_v1) LEAVE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (putil_refused(g, mig, t)) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    putil_sample_t tmp[256];
    int n = putil_samples(g, mig, t, info->lastSeenTimeStamp, tmp);
    if (n == 0) LEAVE(NVML_ERROR_NOT_FOUND);
    if (!info->procUtilArray || info->processSamplesCount < (unsigned)n) {
        info->processSamplesCount = (unsigned)n;
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (int i = 0; i < n; i++) {
        nvmlProcessUtilizationInfo_v1_t *o = &info->procUtilArray[i];
        o->timeStamp = tmp[i].ts; o->pid = tmp[i].pid;
        o->smUtil = tmp[i].v[0]; o->memUtil = tmp[i].v[1]; o->encUtil = tmp[i].v[2]; o->decUtil = tmp[i].v[3];
        o->jpgUtil = tmp[i].v[4]; o->ofaUtil = tmp[i].v[5];
    }
    info->processSamplesCount = (unsigned)n;
    LEAVE(NVML_SUCCESS);
}

/* ---------------------------------------------------------------- GPM */
#define GPM_MAGIC 0x67706d31u
struct nvmlGpmSample_st { unsigned magic; int filled, gpu, mig_gi; double t; };

API nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t h, nvmlGpmSupport_t *sup)
{
    ENTER("nvmlGpmQueryDeviceSupport"); DEV(h, 0); OUT(sup);
    if (sup->version != 1) LEAVE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    sup->isSupportedDevice = g->gpm ? 1 : 0;
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *out)
{
    ENTER("nvmlGpmSampleAlloc"); REQUIRE_INIT(); OUT(out);
    struct nvmlGpmSample_st *s = calloc(1, sizeof *s);
    if (!s) LEAVE(NVML_ERROR_MEMORY);
    s->magic = GPM_MAGIC;
    *out = s;
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t s)
{
    ENTER("nvmlGpmSampleFree"); REQUIRE_INIT();
    if (!s || s->magic != GPM_MAGIC) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    s->magic = 0;
    free(s);
    LEAVE(NVML_SUCCESS);
}

static nvmlReturn_t gpm_sample(const char *fn, nvmlDevice_t h, int gi, nvmlGpmSample_t s)
{
    ENTER(fn); DEV(h, 0);
    if (!s || s->magic != GPM_MAGIC) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (!g->gpm) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    if (gi >= 0) {
        if (!mig_on(g, t)) LEAVE(NVML_ERROR_NOT_SUPPORTED);
        int found = -1;
        for (int i = 0; i < g->n_mig; i++) if ((int)g->mig[i].gi == gi) found = i;
        if (found < 0) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
        if (g->mig[found].noci) LEAVE(NVML_ERROR_NOT_FOUND);   /* per-instance GPM needs a compute instance */
    } else if (mig_on(g, t) && !g->mig_monitor) {
        LEAVE(NVML_ERROR_NO_PERMISSION);                         /* the whole GPU's counters: monitor capability */
    }
    s->filled = 1; s->gpu = (int)(g - S.gpu); s->mig_gi = gi; s->t = t;
    LEAVE(NVML_SUCCESS);
}
API nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t h, nvmlGpmSample_t s) { return gpm_sample("nvmlGpmSampleGet", h, -1, s); }
API nvmlReturn_t nvmlGpmMigSampleGet(nvmlDevice_t h, unsigned int gi, nvmlGpmSample_t s) { return gpm_sample("nvmlGpmMigSampleGet", h, (int)gi, s); }

static const struct { unsigned id; int series; double scale; const char *sn, *ln, *unit; } gpm_tab[] = {
    {1, S_GPM_GRAPHICS, 1, "gr_util", "graphics utilization", "%"},
    {2, S_GPM_SM, 1, "sm_util", "SM utilization", "%"},
    {3, S_GPM_SM_OCC, 1, "sm_occupancy", "SM occupancy", "%"},
    {5, S_GPM_TENSOR, 1, "any_tensor_util", "any tensor utilization", "%"},
    {10, S_GPM_DRAM, 1, "dram_bw_util", "DRAM bandwidth utilization", "%"},
    {11, S_GPM_FP64, 1, "fp64_util", "FP64 utilization", "%"},
    {12, S_GPM_FP32, 1, "fp32_util", "FP32 utilization", "%"},
    {13, S_GPM_FP16, 1, "fp16_util", "FP16 utilization", "%"},
    {20, S_PCIE_TX, 1.0 / 1024, "pcie_tx", "PCIe TX", "MiB/s"},
    {21, S_PCIE_RX, 1.0 / 1024, "pcie_rx", "PCIe RX", "MiB/s"},
    {60, S_NVL_RX, 1, "nvlink_total_rx", "NVLink RX all links", "MiB/s"},
    {61, S_NVL_TX, 1, "nvlink_total_tx", "NVLink TX all links", "MiB/s"},
};

API nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *mg)
{
    ENTER("nvmlGpmMetricsGet"); REQUIRE_INIT(); OUT(mg);
    if (mg->version != 1) LEAVE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    struct nvmlGpmSample_st *a = mg->sample1, *b = mg->sample2;
    if (mg->numMetrics > NVML_GPM_METRIC_MAX || !a || !b || a->magic != GPM_MAGIC || b->magic != GPM_MAGIC
        || !a->filled || !b->filled || a->gpu != b->gpu || a->mig_gi != b->mig_gi || b->t < a->t)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    const gpu_t *g = &S.gpu[a->gpu];
    double t = now_t();
    if (t >= g->lost_at) LEAVE(NVML_ERROR_GPU_IS_LOST);
    nvmlReturn_t r = injected(g, FN, t);        /* error = nvmlGpmMetricsGet CODE: the samples' GPU */
    if (r) LEAVE(r);
    if (!g->gpm) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    /* Samples under gpm_min_interval_ms apart: invalid without an error (every metric a made-up value). */
    int too_close = (b->t - a->t) * 1000.0 < g->gpm_min_interval_ms;
    for (unsigned i = 0; i < mg->numMetrics; i++) {
        nvmlGpmMetric_t *m = &mg->metrics[i];
        unsigned id = m->metricId;
        m->value = 0;
        m->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        memset(&m->metricInfo, 0, sizeof m->metricInfo);
        if (id_in(g->unsup_gpm, g->n_unsup_gpm, id)) continue;
        if (too_close) { m->value = g->gpm_short_value; m->nvmlReturn = NVML_SUCCESS; continue; }
        int nan = 0;
        for (int k = 0; k < g->n_gpm_nan; k++)
            if (g->gpm_nan[k].id == id && b->t >= g->gpm_nan[k].from && b->t < g->gpm_nan[k].to) nan = 1;
        if (nan) { m->value = NAN; m->nvmlReturn = NVML_SUCCESS; continue; }
        if (id >= 62 && id <= 97) {                  /* per link: RX = 62 + 2 link, TX = 63 + 2 link */
            if (!g->nvlink_links) continue;
            unsigned link = (id - 62) / 2;
            int sid = (id % 2 == 0) ? S_NVL_RX : S_NVL_TX;
            m->value = link < g->nvlink_links ? gavg(g, sid, a->t, b->t) / g->nvlink_links : 0;
            m->metricInfo.shortName = (id % 2 == 0) ? "nvlink_rx" : "nvlink_tx";
            m->metricInfo.longName = (id % 2 == 0) ? "NVLink RX one link" : "NVLink TX one link";
            m->metricInfo.unit = "MiB/s";
            m->nvmlReturn = NVML_SUCCESS;
            continue;
        }
        for (size_t k = 0; k < sizeof gpm_tab / sizeof gpm_tab[0]; k++) {
            if (gpm_tab[k].id != id) continue;
            int sid = gpm_tab[k].series;
            if ((id == 60 || id == 61) && !g->nvlink_links) break;
            if (id == 1 && !has(g, sid)) sid = S_GPU_UTIL;
            m->value = gavg(g, sid, a->t, b->t) * gpm_tab[k].scale;
            m->metricInfo.shortName = gpm_tab[k].sn;
            m->metricInfo.longName = gpm_tab[k].ln;
            m->metricInfo.unit = gpm_tab[k].unit;
            m->nvmlReturn = NVML_SUCCESS;
            break;
        }
    }
    LEAVE(NVML_SUCCESS);
}

/* ---------------------------------------------------------------- events */
#define SET_MAGIC 0x65767331u
struct nvmlEventSet_st {
    unsigned magic;
    unsigned long long mask[MAX_GPUS];
    double reg_t[MAX_GPUS];
    unsigned char delivered[MAX_EVENTS];
};

API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t h, unsigned long long *types)
{
    ENTER("nvmlDeviceGetSupportedEventTypes"); DEV(h, 0); OUT(types);
    *types = g->event_types;
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    ENTER("nvmlEventSetCreate"); REQUIRE_INIT(); OUT(set);
    struct nvmlEventSet_st *s = calloc(1, sizeof *s);
    if (!s) LEAVE(NVML_ERROR_MEMORY);
    s->magic = SET_MAGIC;
    *set = s;
    LEAVE(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t h, unsigned long long types, nvmlEventSet_t set)
{
    ENTER("nvmlDeviceRegisterEvents"); DEV(h, 0);
    if (!set || set->magic != SET_MAGIC) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (types & ~g->event_types) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    int i = (int)(g - S.gpu);
    if (!set->mask[i]) set->reg_t[i] = t;
    set->mask[i] |= types;
    LEAVE(NVML_SUCCESS);
}

/* Index of the next undelivered event for this set (due or not), or -1. Caller holds mu. */
static int next_event(const struct nvmlEventSet_st *s)
{
    for (int i = 0; i < S.n_events; i++) {
        const event_t *e = &S.events[i];
        if (s->delivered[i] || !(s->mask[e->gpu] & e->type)) continue;
        if (!S.deliver_past_events && e->t < s->reg_t[e->gpu]) continue;
        /* nvml.h: in MIG mode without the required privileges only events that affect the whole
         * device are reported (an instance's XID is then never delivered). */
        const gpu_t *g = &S.gpu[e->gpu];
        if (e->gi != NO_INSTANCE && mig_on(g, e->t) && !g->mig_monitor) continue;
        return i;
    }
    return -1;
}

static nvmlReturn_t event_wait(const char *fn, nvmlEventSet_t set, nvmlEventData_t *data,
                               nvmlEventData_v1_t *data1, unsigned int timeout_ms)
{
    ENTER(fn); REQUIRE_INIT();
    if (!set || set->magic != SET_MAGIC || (!data && !data1)) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    double deadline = wall_now() + timeout_ms / 1000.0;
    for (;;) {
        int i = next_event(set);
        double t = now_t();
        if (i >= 0 && S.events[i].t <= t) {
            const event_t *e = &S.events[i];
            set->delivered[i] = 1;
            if (data) {
                data->device = &dev_handles[e->gpu];
                data->eventType = e->type; data->eventData = e->data;
                data->gpuInstanceId = e->gi; data->computeInstanceId = e->ci;
            } else {
                data1->device = &dev_handles[e->gpu];
                data1->eventType = e->type; data1->eventData = e->data;
            }
            LEAVE(NVML_SUCCESS);
        }
        /* nvml.h: GPU_IS_LOST "if a GPU has fallen off the bus": once a GPU of the set is lost,
         * every wait without a due event answers it at once. */
        for (int k = 0; k < S.gpu_count; k++)
            if (set->mask[k] && t >= S.gpu[k].lost_at) LEAVE(NVML_ERROR_GPU_IS_LOST);
        double now = wall_now();
        if (now >= deadline) LEAVE(NVML_ERROR_TIMEOUT);
        double until = deadline;
        if (i >= 0 && S.events[i].t + T0 < until) until = S.events[i].t + T0;
        for (int k = 0; k < S.gpu_count; k++)
            if (set->mask[k] && S.gpu[k].lost_at + T0 < until) until = S.gpu[k].lost_at + T0;
        /* The driver blocks until something happens: the fake sleeps until the next thing it knows
         * of (an event, a GPU falling off the bus, the deadline) or until nvmlShutdown or
         * nvmlEventSetFree wakes it, not in short polls whose wake-ups the agent's CPU figures would
         * pay for (bench/footprint.py). Other threads keep calling NVML meanwhile (mu is released). */
        if (until < now + 0.0005) until = now + 0.0005;
        struct timespec ts = { (time_t)until, (long)((until - (double)(time_t)until) * 1e9) };
        pthread_cond_timedwait(&waiters, &mu, &ts);
        if (refcount <= 0) LEAVE(NVML_ERROR_UNINITIALIZED);
        if (set->magic != SET_MAGIC) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    }
}
API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *d, unsigned int ms) { return event_wait("nvmlEventSetWait_v2", set, d, NULL, ms); }
API nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_v1_t *d, unsigned int ms) { return event_wait("nvmlEventSetWait", set, NULL, d, ms); }

API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    ENTER("nvmlEventSetFree"); REQUIRE_INIT();
    if (!set || set->magic != SET_MAGIC) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    set->magic = 0;
    free(set);
    pthread_cond_broadcast(&waiters);
    LEAVE(NVML_SUCCESS);
}

/* ---------------------------------------------------------------- test hooks (not NVML) */
/* Calls of one function so far in this process (NULL: all functions), counted before checks. */
API unsigned long long fakeNvmlCallCount(const char *fn)
{
    pthread_mutex_lock(&mu);
    unsigned long long n = 0;
    if (!fn) n = calls_total;
    else for (int i = 0; i < n_calls_fns; i++) if (!strcmp(calls[i].name, fn)) n = calls[i].n;
    pthread_mutex_unlock(&mu);
    return n;
}

API void fakeNvmlResetCallCounts(void)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n_calls_fns; i++) calls[i].n = 0;
    calls_total = 0;
    pthread_mutex_unlock(&mu);
}

/* The scenario time t now (seconds), or NaN before the first nvmlInit fixed t = 0. */
API double fakeNvmlNow(void)
{
    pthread_mutex_lock(&mu);
    double t = t0_set ? now_t() : NAN;
    pthread_mutex_unlock(&mu);
    return t;
}
