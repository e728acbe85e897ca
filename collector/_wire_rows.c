/* The (series_ref, time_unix_nano, value) of each sample of a Batch, read from the Batch's wire
 * bytes: what collector/state.py's `rows` reads through protobuf's Python objects (a wrapper
 * object per sample, a lookup per field), in one pass over the bytes the agent sent.
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

/* The int of the time last read: the samples of a batch mostly share one time (a round of a tier),
 * so they share its int object. */
typedef struct {
    int64_t t;
    PyObject *obj;   /* a new reference, or NULL */
} last_time;

/* One sample's row appended to `out`: 0, -1 for bytes not read (no Python error set), -2 for a
 * Python error (memory). */
static int read_sample(const uint8_t *p, const uint8_t *end, PyObject *out, last_time *last)
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
    PyObject *row = PyTuple_New(3);
    if (row == NULL)
        return -2;
    if (last->obj == NULL || last->t != t) {
        Py_XDECREF(last->obj);
        last->obj = PyLong_FromLongLong(t);
        last->t = t;
        if (last->obj == NULL) {
            Py_DECREF(row);
            return -2;
        }
    }
    Py_INCREF(last->obj);
    PyObject *items[3] = {PyLong_FromUnsignedLong(ref), last->obj, PyFloat_FromDouble(v)};
    for (int i = 0; i < 3; i++) {
        if (items[i] == NULL) {
            for (int j = 0; j < 3; j++)
                Py_XDECREF(items[j]);
            Py_DECREF(row);
            return -2;
        }
    }
    for (int i = 0; i < 3; i++)
        PyTuple_SET_ITEM(row, i, items[i]);
    int r = PyList_Append(out, row);
    Py_DECREF(row);
    return r < 0 ? -2 : 0;
}

static PyObject *rows(PyObject *self, PyObject *arg)
{
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *p = buf.buf, *end = p + buf.len;
    last_time last = {0, NULL};
    PyObject *out = PyList_New(0);
    if (out == NULL)
        goto fail;
    while (p < end) {
        uint64_t field, n;
        unsigned wt;
        if (read_tag(&p, end, &field, &wt) < 0)
            goto give_up;
        if (field == BATCH_SAMPLES && wt == WT_LEN) {
            if (read_varint(&p, end, &n) < 0 || n > (uint64_t)(end - p))
                goto give_up;
            int r = read_sample(p, p + n, out, &last);
            if (r == -1)
                goto give_up;
            if (r < 0)
                goto fail;
            p += n;
        } else if (skip(&p, end, wt) < 0) {
            goto give_up;
        }
    }
    Py_XDECREF(last.obj);
    PyBuffer_Release(&buf);
    return out;
give_up:
    Py_XDECREF(last.obj);
    Py_DECREF(out);
    PyBuffer_Release(&buf);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(last.obj);
    Py_XDECREF(out);
    PyBuffer_Release(&buf);
    return NULL;
}

static PyMethodDef methods[] = {
    {"rows", rows, METH_O,
     "rows(batch_wire) -> [(series_ref, time_unix_nano, value), ...] of the Batch encoded in "
     "batch_wire, in order; None where the bytes are not read here (read them with protobuf)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire_rows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wire_rows(void)
{
    return PyModule_Create(&module);
}
