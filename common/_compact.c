/* The compact encoding's columns (common/compact.py, docs/design.md "The compact encoding") read
 * in C: inflated with zlib into a buffer bounded as decode_columns bounds it, then read in one pass
 * to the very objects decode_columns gives, without a Python object per step.
 *
 * `decode` accepts only what decode_columns accepts and reads it to an equal result; anything else
 * (bytes that do not inflate, past the bound, short, of another version, a histogram out of bounds,
 * bytes left over, or a bound this reader does not take) gives None, and the caller reads the bytes
 * with decode_columns, which says what is wrong with them.
 *
 * `deflate` compresses as zlib.compress (or a compressobj with a preset dictionary) does, to the same
 * bytes, with one deflate state kept and reset between calls: zlib's 256 KiB of state allocated and
 * cleared for every small block cost more than compressing it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <zlib.h>

#define RAW 255            /* version 2: the tag of a value sent as its 8 bytes (0-9: decimal places) */
#define HEAD 13            /* version (1), samples (4), first time (8) */
#define HIST 12            /* sample index, bounds, counts (4 each) */
#define MAX_BUCKETS 256
/* decode_columns' bound on the inflated bytes: the header, at most 21 bytes a sample (version 2's
 * raw value and its tag), the histograms' count, and a histogram of the most buckets for every sample. */
#define PER_SAMPLE (21 + HIST + 16 * MAX_BUCKETS + 8)
#define EXACT 9007199254740992LL   /* 2**53: digits below it in magnitude are exact as a double */

static const double P10[10] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9};

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t le64(const uint8_t *p)
{
    return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32;
}

static double le_double(const uint8_t *p)
{
    uint64_t bits = le64(p);
    double d;
    memcpy(&d, &bits, 8);
    return d;
}

/* `data` inflated into a PyMem buffer (*out, *len) of at most `limit` bytes: 0, -1 for bytes not
 * inflated here (no Python error set), -2 for a Python error (memory). Refused, never inflated
 * past the bound: a stream whose end is not reached within `limit` bytes, a stream cut short,
 * bytes after its end. */
static int inflate_bounded(const uint8_t *data, Py_ssize_t size, Py_ssize_t limit, uint8_t **out, Py_ssize_t *len)
{
    if (size > (Py_ssize_t)UINT_MAX || limit < 1)
        return -1;
    z_stream z;
    memset(&z, 0, sizeof z);
    int init = inflateInit(&z);
    if (init == Z_MEM_ERROR) {
        PyErr_NoMemory();
        return -2;
    }
    if (init != Z_OK)
        return -1;
    Py_ssize_t cap = 16 * size + 1024;   /* what a block of columns usually inflates to, and room */
    if (cap > limit)
        cap = limit;
    uint8_t *buf = PyMem_Malloc(cap);
    int r = buf == NULL ? (PyErr_NoMemory(), -2) : -1;
    z.next_in = (Bytef *)data;
    z.avail_in = (uInt)size;
    z.next_out = buf;
    z.avail_out = (uInt)(cap > (Py_ssize_t)UINT_MAX ? UINT_MAX : cap);
    while (buf != NULL) {
        int z_r = inflate(&z, Z_FINISH);
        Py_ssize_t got = (Py_ssize_t)((uint8_t *)z.next_out - buf);
        if (z_r == Z_STREAM_END) {
            if (z.avail_in == 0) {   /* nothing after the end */
                r = 0;
                *out = buf;
                *len = got;
                buf = NULL;
            }
            break;
        }
        if (z_r != Z_BUF_ERROR && z_r != Z_OK)
            break;   /* not a zlib stream, a bad checksum, a dictionary asked for, memory */
        if (z.avail_out != 0 || cap == limit)
            break;   /* cut short (no output wanted, no input left), or the bound is reached */
        if (got < cap) {   /* the output's room was capped to UINT_MAX: more of the same buffer */
            Py_ssize_t room = cap - got;
            z.avail_out = (uInt)(room > (Py_ssize_t)UINT_MAX ? UINT_MAX : room);
            continue;
        }
        Py_ssize_t grown = cap > limit / 2 ? limit : 2 * cap;
        uint8_t *b2 = PyMem_Realloc(buf, grown);
        if (b2 == NULL) {
            PyErr_NoMemory();
            r = -2;
            break;
        }
        buf = b2;
        cap = grown;
        z.next_out = buf + got;
        Py_ssize_t room = cap - got;
        z.avail_out = (uInt)(room > (Py_ssize_t)UINT_MAX ? UINT_MAX : room);
    }
    PyMem_Free(buf);
    inflateEnd(&z);
    return r;
}

/* The refs from their deltas: summed modulo 2**32, as a tuple; *rising whether they rise strictly. */
static PyObject *refs_of(const uint8_t *p, uint32_t n, int *rising)
{
    PyObject *refs = PyTuple_New(n);
    uint32_t ref = 0, prev = 0;
    *rising = 1;
    for (uint32_t i = 0; refs != NULL && i < n; i++) {
        ref += le32(p + 4 * (size_t)i);
        if (i && ref <= prev)
            *rising = 0;
        prev = ref;
        PyObject *o = PyLong_FromUnsignedLong(ref);
        if (o == NULL)
            Py_CLEAR(refs);
        else
            PyTuple_SET_ITEM(refs, i, o);
    }
    return refs;
}

/* The times from t0 and their deltas (each added modulo 2**64, read as int64), as a list; *one
 * set to the one time of every sample (a new reference), or left NULL. */
static PyObject *times_of(int64_t t0, const uint8_t *p, uint32_t n, PyObject **one)
{
    PyObject *times = PyList_New(n), *time = NULL;
    int64_t prev = 0;
    int all_same = 1;
    for (uint32_t i = 0; times != NULL && i < n; i++) {
        int64_t t = (int64_t)((uint64_t)t0 + le64(p + 8 * (size_t)i));
        if (time == NULL || t != prev) {
            all_same &= time == NULL;
            Py_XDECREF(time);
            time = PyLong_FromLongLong(t);
            if (time == NULL) {
                Py_CLEAR(times);
                break;
            }
            prev = t;
        }
        Py_INCREF(time);
        PyList_SET_ITEM(times, i, time);
    }
    if (times != NULL && time != NULL && all_same) {
        *one = time;
        time = NULL;
    }
    Py_XDECREF(time);
    return times;
}

static PyObject *doubles_of(const uint8_t *p, uint32_t n)
{
    PyObject *out = PyList_New(n);
    for (uint32_t i = 0; out != NULL && i < n; i++) {
        PyObject *o = PyFloat_FromDouble(le_double(p + 8 * (size_t)i));
        if (o == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, o);
    }
    return out;
}

static PyObject *counts_of(const uint8_t *p, uint32_t n)
{
    PyObject *out = PyList_New(n);
    for (uint32_t i = 0; out != NULL && i < n; i++) {
        PyObject *o = PyLong_FromUnsignedLongLong(le64(p + 8 * (size_t)i));
        if (o == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, o);
    }
    return out;
}

/* Version 2's n values from raw[*at, len) (tags, the raw ones' 8 bytes, the others' digits as
 * zigzag varints of at most 8 bytes, below 2**53 in magnitude) into v, in this machine's order;
 * 0 with *at past them, -1 for bytes not read here. */
static int values_v2(const uint8_t *raw, Py_ssize_t len, Py_ssize_t *at, uint32_t n, char *v)
{
    const uint8_t *tags = raw + *at;
    Py_ssize_t p = *at + n, k = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (tags[i] == RAW)
            k++;
        else if (tags[i] > 9)
            return -1;
    }
    if ((len - p) / 8 < k)
        return -1;
    const uint8_t *raws = raw + p;
    p += 8 * k;
    for (uint32_t i = 0, j = 0; i < n; i++) {
        double x;
        if (tags[i] == RAW) {
            x = le_double(raws + 8 * (size_t)j++);
        } else {
            uint64_t z = 0;
            int shift = 0;
            for (;;) {
                if (p >= len || shift > 49)
                    return -1;   /* cut short, or longer than 8 bytes */
                uint8_t b = raw[p++];
                z |= (uint64_t)(b & 0x7F) << shift;
                shift += 7;
                if (b < 0x80)
                    break;
            }
            int64_t m = (int64_t)(z >> 1) ^ -(int64_t)(z & 1);
            if (m <= -EXACT || m >= EXACT)
                return -1;
            x = (double)m / P10[tags[i]];
        }
        memcpy(v + 8 * (size_t)i, &x, 8);
    }
    *at = p;
    return 0;
}

/* The histograms from raw[*at, len): {index: (bounds, counts)}, each index below n and given once,
 * each within MAX_BUCKETS; 0 with *at past them, -1 for bytes not read here, -2 for a Python error. */
static int histograms_of(const uint8_t *raw, Py_ssize_t len, Py_ssize_t *at, uint32_t n, PyObject *dict)
{
    Py_ssize_t p = *at;
    uint32_t nh = le32(raw + p);
    p += 4;
    for (uint32_t k = 0; k < nh; k++) {
        if (len - p < HIST)
            return -1;
        uint32_t i = le32(raw + p), nb = le32(raw + p + 4), nc = le32(raw + p + 8);
        p += HIST;
        if (nb > MAX_BUCKETS || nc > MAX_BUCKETS + 1 || i >= n)
            return -1;
        if ((len - p) / 8 < (Py_ssize_t)nb + (Py_ssize_t)nc)
            return -1;
        PyObject *key = PyLong_FromUnsignedLong(i);
        if (key == NULL)
            return -2;
        int seen = PyDict_Contains(dict, key);
        PyObject *bounds = seen == 0 ? doubles_of(raw + p, nb) : NULL;
        PyObject *counts = bounds ? counts_of(raw + p + 8 * (Py_ssize_t)nb, nc) : NULL;
        PyObject *pair = counts ? PyTuple_Pack(2, bounds, counts) : NULL;
        int r = pair ? PyDict_SetItem(dict, key, pair) : -1;
        Py_DECREF(key);
        Py_XDECREF(bounds);
        Py_XDECREF(counts);
        Py_XDECREF(pair);
        if (seen == 1)
            return -1;   /* a histogram for a sample given twice */
        if (r < 0)
            return -2;
        p += 8 * ((Py_ssize_t)nb + (Py_ssize_t)nc);
    }
    *at = p;
    return 0;
}

/* decode(data, max_samples, last_ref_deltas): see the method's doc below. */
static PyObject *decode(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t max_samples;
    PyObject *last;
    if (!PyArg_ParseTuple(args, "y*nO:decode", &buf, &max_samples, &last))
        return NULL;
    uint8_t *raw = NULL;
    Py_ssize_t len = 0;
    int r = -1;
    if (max_samples >= 0 && max_samples <= (PY_SSIZE_T_MAX - HEAD - 4) / PER_SAMPLE)
        r = inflate_bounded(buf.buf, buf.len, HEAD + 4 + PER_SAMPLE * max_samples, &raw, &len);
    PyBuffer_Release(&buf);
    PyObject *refs = NULL, *deltas = NULL, *times = NULL, *one = NULL, *values = NULL, *hists = NULL, *out = NULL;
    int rising = 1;
    uint32_t n = 0;
    if (r == 0) {
        r = -1;
        if (len >= HEAD && (raw[0] == 1 || raw[0] == 2) && (n = le32(raw + 1)) <= (uint64_t)max_samples
                && (uint64_t)len >= HEAD + (raw[0] == 1 ? 20 : 13) * (uint64_t)n + 4)
            r = 0;
    }
    if (r == 0) {
        const uint8_t *d = raw + HEAD;
        if (last != Py_None && PyBytes_Check(last) && PyBytes_GET_SIZE(last) == 4 * (Py_ssize_t)n
                && memcmp(PyBytes_AS_STRING(last), d, 4 * (size_t)n) == 0) {
            deltas = last;   /* encoded as the last block's: the caller takes its refs */
            Py_INCREF(deltas);
            refs = Py_None;
            Py_INCREF(refs);
        } else if ((deltas = PyBytes_FromStringAndSize((const char *)d, 4 * (Py_ssize_t)n)) != NULL) {
            refs = refs_of(d, n, &rising);
        }
        times = refs ? times_of((int64_t)le64(raw + 5), d + 4 * (size_t)n, n, &one) : NULL;
        values = times ? PyBytes_FromStringAndSize(NULL, 8 * (Py_ssize_t)n) : NULL;
        Py_ssize_t at = HEAD + 12 * (Py_ssize_t)n;
        r = values == NULL ? -2 : 0;
        if (values != NULL && raw[0] == 1) {   /* in this machine's order, as array('d') holds them */
            char *v = PyBytes_AS_STRING(values);
#if PY_BIG_ENDIAN
            for (uint32_t i = 0; i < n; i++) {
                double x = le_double(d + 12 * (size_t)n + 8 * (size_t)i);
                memcpy(v + 8 * (size_t)i, &x, 8);
            }
#else
            memcpy(v, d + 12 * (size_t)n, 8 * (size_t)n);
#endif
            at += 8 * (Py_ssize_t)n;
        } else if (values != NULL) {
            r = values_v2(raw, len, &at, n, PyBytes_AS_STRING(values));
        }
        if (r == 0 && len - at < 4)
            r = -1;   /* no room for the histograms' count */
        hists = r == 0 ? PyDict_New() : NULL;
        if (r == 0)
            r = hists == NULL ? -2 : histograms_of(raw, len, &at, n, hists);
        if (r == 0 && at != len)
            r = -1;   /* bytes after the histograms */
        if (r == 0) {
            if (one == NULL) {
                one = Py_None;
                Py_INCREF(one);
            }
            PyObject *up = refs == Py_None ? Py_None : rising ? Py_True : Py_False;
            out = PyTuple_Pack(7, refs, one, times, values, up, hists, deltas);
        }
    }
    PyMem_Free(raw);
    Py_XDECREF(refs);
    Py_XDECREF(deltas);
    Py_XDECREF(times);
    Py_XDECREF(one);
    Py_XDECREF(values);
    Py_XDECREF(hists);
    if (r == -1)
        Py_RETURN_NONE;
    return out;   /* NULL with the error set where r == -2 or the tuple was not made */
}

static z_stream deflater;
static int deflater_level = -100;   /* the kept state's level; -100: none made yet */

static PyObject *deflate_block(PyObject *self, PyObject *args)
{
    Py_buffer raw, dict = {0};
    int level;
    if (!PyArg_ParseTuple(args, "y*i|y*:deflate", &raw, &level, &dict))
        return NULL;
    PyObject *out = NULL;
    int z_r = Z_OK;
    if (level != deflater_level) {   /* the GIL is held throughout: one state serves every caller */
        if (deflater_level != -100)
            deflateEnd(&deflater);
        memset(&deflater, 0, sizeof deflater);
        deflater_level = -100;
        z_r = deflateInit2(&deflater, level, Z_DEFLATED, MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
        if (z_r == Z_OK)
            deflater_level = level;
    } else {
        z_r = deflateReset(&deflater);
    }
    if (z_r == Z_OK && dict.buf != NULL && dict.len > 0)   /* zlib keeps its last 32 KiB, as a compressobj's */
        z_r = dict.len <= (Py_ssize_t)UINT32_MAX ? deflateSetDictionary(&deflater, dict.buf, (uInt)dict.len) : Z_BUF_ERROR;
    if (z_r == Z_OK && raw.len <= (Py_ssize_t)UINT32_MAX - 64) {
        uLong cap = deflateBound(&deflater, (uLong)raw.len) + 16;
        out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cap);
        if (out != NULL) {
            deflater.next_in = raw.buf;
            deflater.avail_in = (uInt)raw.len;
            deflater.next_out = (Bytef *)PyBytes_AS_STRING(out);
            deflater.avail_out = (uInt)cap;
            z_r = deflate(&deflater, Z_FINISH);
            if (z_r == Z_STREAM_END)
                _PyBytes_Resize(&out, (Py_ssize_t)(cap - deflater.avail_out));
            else
                Py_CLEAR(out);
        }
    } else if (z_r == Z_OK) {
        z_r = Z_BUF_ERROR;
    }
    PyBuffer_Release(&raw);
    if (dict.buf != NULL)
        PyBuffer_Release(&dict);
    if (out == NULL && !PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "deflate failed (zlib error %d)", z_r);
    return out;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(data, max_samples, last_ref_deltas) -> (refs, time, times, values, rising, histograms, "
     "ref_deltas) of a block that compact.decode_columns reads to the same, or None for any other "
     "(read it with decode_columns). refs and rising are None where the block's refs are encoded as "
     "last_ref_deltas (bytes, or None) are: the last block's refs are its own; ref_deltas is then "
     "last_ref_deltas itself."},
    {"deflate", deflate_block, METH_VARARGS,
     "deflate(raw, level, zdict=b'') -> zlib.compress(raw, level)'s bytes, or with zdict (bytes) as the "
     "preset dictionary those of zlib.compressobj(level, zdict=zdict); one deflate state reused."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_compact", NULL, -1, methods};

PyMODINIT_FUNC PyInit__compact(void)
{
    return PyModule_Create(&module);
}
