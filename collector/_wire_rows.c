/* The (series_ref, time_unix_nano, value) of each sample of a Batch, read from the Batch's wire
 * bytes, as rows (`rows`) or as columns (`columns`): what collector/batch_rows.py otherwise reads
 * through protobuf's Python objects (a wrapper object per sample, a lookup per field), in one pass
 * over the bytes the agent sent.
 *
 * The bytes have been parsed by protobuf already (the stream's request deserializer), so they are
 * a valid Batch; this reader still checks every bound, and gives up (returns None: the caller reads
 * the samples the slow way) on anything it does not read exactly as protobuf does: a group, a field
 * number 0, a varint of more than 10 bytes, a length past the end.
 *
 * As protobuf reads them (telemetry.proto): Batch.samples is field 4 (length-delimited), each
 * occurrence one more sample; in a Sample, value is field 5 (fixed64, a double), time_unix_nano
 * field 6 (varint, int64) and series_ref field 8 (varint, uint32: a longer varint is cut to its low
 * 32 bits); a field given twice takes its last value; a field absent is 0; a known field with
 * another wire type is an unknown field, skipped, as is every other field.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BATCH_SAMPLES 4
#define SAMPLE_VALUE 5
#define SAMPLE_TIME 6
#define SAMPLE_REF 8
#define WT_VARINT 0
#define WT_FIXED64 1
#define WT_LEN 2
#define WT_FIXED32 5

static int read_varint(const uint8_t **p, const uint8_t *end, uint64_t *out)
{
    uint64_t v = 0;
    for (int i = 0; i < 10; i++) {
        if (*p >= end)
            return -1;
        uint8_t b = *(*p)++;
        v |= (uint64_t)(b & 0x7f) << (7 * i);   /* i <= 9: a shift of at most 63 */
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

/* Past one field's value of wire type `wt`; -1 for a wire type not skipped here or a short read. */
static int skip(const uint8_t **p, const uint8_t *end, unsigned wt)
{
    uint64_t n;
    switch (wt) {
    case WT_VARINT:
        return read_varint(p, end, &n);
    case WT_FIXED64:
        n = 8;
        break;
    case WT_LEN:
        if (read_varint(p, end, &n) < 0)
            return -1;
        break;
    case WT_FIXED32:
        n = 4;
        break;
    default:   /* groups (3, 4) and the wire types that do not exist (6, 7) */
        return -1;
    }
    if (n > (uint64_t)(end - *p))
        return -1;
    *p += n;
    return 0;
}

static int read_tag(const uint8_t **p, const uint8_t *end, uint64_t *field, unsigned *wt)
{
    uint64_t tag;
    if (read_varint(p, end, &tag) < 0 || (tag >> 3) == 0 || tag > 0xffffffffu)
        return -1;
    *field = tag >> 3;
    *wt = (unsigned)(tag & 7);
    return 0;
}

/* The samples read from a Batch, in C arrays (grown as needed). */
typedef struct {
    Py_ssize_t n, cap;
    uint32_t *ref;
    int64_t *t;
    double *v;
} samples;

static void samples_free(samples *s)
{
    PyMem_Free(s->ref);
    PyMem_Free(s->t);
    PyMem_Free(s->v);
}

static int samples_add(samples *s, uint32_t ref, int64_t t, double v)
{
    if (s->n == s->cap) {
        Py_ssize_t cap = s->cap ? 2 * s->cap : 256;
        uint32_t *r2 = PyMem_Realloc(s->ref, cap * sizeof *r2);
        if (r2 != NULL)
            s->ref = r2;
        int64_t *t2 = r2 ? PyMem_Realloc(s->t, cap * sizeof *t2) : NULL;
        if (t2 != NULL)
            s->t = t2;
        double *v2 = t2 ? PyMem_Realloc(s->v, cap * sizeof *v2) : NULL;
        if (v2 == NULL) {
            PyErr_NoMemory();
            return -2;
        }
        s->v = v2;
        s->cap = cap;
    }
    s->ref[s->n] = ref;
    s->t[s->n] = t;
    s->v[s->n] = v;
    s->n++;
    return 0;
}

/* One sample's fields into `out`: 0, -1 for bytes not read (no Python error set), -2 for a Python
 * error (memory). */
static int read_sample(const uint8_t *p, const uint8_t *end, samples *out)
{
    uint32_t ref = 0;
    int64_t t = 0;
    double v = 0.0;
    while (p < end) {
        uint64_t field, n;
        unsigned wt;
        if (read_tag(&p, end, &field, &wt) < 0)
            return -1;
        if (field == SAMPLE_VALUE && wt == WT_FIXED64) {
            if (end - p < 8)
                return -1;
            uint64_t bits = 0;
            for (int i = 7; i >= 0; i--)   /* little-endian on the wire, whatever this machine is */
                bits = (bits << 8) | p[i];
            memcpy(&v, &bits, 8);
            p += 8;
        } else if (field == SAMPLE_TIME && wt == WT_VARINT) {
            if (read_varint(&p, end, &n) < 0)
                return -1;
            t = (int64_t)n;
        } else if (field == SAMPLE_REF && wt == WT_VARINT) {
            if (read_varint(&p, end, &n) < 0)
                return -1;
            ref = (uint32_t)n;
        } else if (skip(&p, end, wt) < 0) {
            return -1;
        }
    }
    return samples_add(out, ref, t, v);
}

/* The Batch's samples from the bytes in `arg` into `out`: 0, -1 for bytes not read here, -2 for a
 * Python error. */
static int read_batch(PyObject *arg, samples *out)
{
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0)
        return -2;
    const uint8_t *p = buf.buf, *end = p + buf.len;
    int r = 0;
    while (p < end && r == 0) {
        uint64_t field, n;
        unsigned wt;
        if (read_tag(&p, end, &field, &wt) < 0) {
            r = -1;
        } else if (field == BATCH_SAMPLES && wt == WT_LEN) {
            if (read_varint(&p, end, &n) < 0 || n > (uint64_t)(end - p))
                r = -1;
            else
                r = read_sample(p, p + n, out);
            p += r == 0 ? n : 0;
        } else if (skip(&p, end, wt) < 0) {
            r = -1;
        }
    }
    PyBuffer_Release(&buf);
    return r;
}

/* (ref, time, value) of sample i; `time` is the int of that time (the samples of a batch mostly
 * share one time, a round of a tier, and so share its int). */
static PyObject *row(const samples *s, Py_ssize_t i, PyObject *time)
{
    PyObject *ref = PyLong_FromUnsignedLong(s->ref[i]);
    PyObject *value = PyFloat_FromDouble(s->v[i]);
    PyObject *r = (ref && value) ? PyTuple_New(3) : NULL;
    if (r == NULL) {
        Py_XDECREF(ref);
        Py_XDECREF(value);
        return NULL;
    }
    Py_INCREF(time);
    PyTuple_SET_ITEM(r, 0, ref);
    PyTuple_SET_ITEM(r, 1, time);
    PyTuple_SET_ITEM(r, 2, value);
    return r;
}

static PyObject *rows(PyObject *self, PyObject *arg)
{
    samples s = {0};
    int r = read_batch(arg, &s);
    PyObject *out = r == 0 ? PyList_New(s.n) : NULL, *time = NULL;
    for (Py_ssize_t i = 0; out != NULL && i < s.n; i++) {
        if (time == NULL || s.t[i] != s.t[i - 1]) {
            Py_XDECREF(time);
            time = PyLong_FromLongLong(s.t[i]);
        }
        PyObject *item = time ? row(&s, i, time) : NULL;
        if (item == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, item);
    }
    Py_XDECREF(time);
    samples_free(&s);
    if (r == -1)
        Py_RETURN_NONE;
    return out;   /* NULL with the error set where r == -2 or a row was not made */
}

static PyObject *columns(PyObject *self, PyObject *arg)
{
    samples s = {0};
    int r = read_batch(arg, &s);
    if (r != 0) {
        samples_free(&s);
        if (r == -1)
            Py_RETURN_NONE;
        return NULL;
    }
    int one_time = 1, ascending = 1;
    for (Py_ssize_t i = 1; i < s.n; i++) {
        one_time &= s.t[i] == s.t[0];
        ascending &= s.ref[i] > s.ref[i - 1];
    }
    PyObject *refs = PyTuple_New(s.n);
    for (Py_ssize_t i = 0; refs != NULL && i < s.n; i++) {
        PyObject *ref = PyLong_FromUnsignedLong(s.ref[i]);
        if (ref == NULL)
            Py_CLEAR(refs);
        else
            PyTuple_SET_ITEM(refs, i, ref);
    }
    PyObject *time = NULL;
    if (one_time && s.n) {
        time = PyLong_FromLongLong(s.t[0]);
    } else {
        time = Py_None;
        Py_INCREF(time);
    }
    PyObject *values = PyBytes_FromStringAndSize((const char *)s.v, s.n * (Py_ssize_t)sizeof(double));
    PyObject *out = (refs && time && values) ? PyTuple_Pack(4, refs, time, values, ascending ? Py_True : Py_False) : NULL;
    Py_XDECREF(refs);
    Py_XDECREF(time);
    Py_XDECREF(values);
    samples_free(&s);
    return out;
}

static PyMethodDef methods[] = {
    {"rows", rows, METH_O,
     "rows(batch_wire) -> [(series_ref, time_unix_nano, value), ...] of the Batch encoded in "
     "batch_wire, in order; None where the bytes are not read here (read them with protobuf)."},
    {"columns", columns, METH_O,
     "columns(batch_wire) -> (refs, time, values, ascending): the samples' series_refs (a tuple), "
     "their one time (None when they have several, or there are none), their values as the bytes of "
     "an array('d'), and whether the refs rise strictly; None where rows() gives None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire_rows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wire_rows(void)
{
    return PyModule_Create(&module);
}
