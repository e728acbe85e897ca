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
 *
 * `lean_batch` reads a whole AgentMessage that holds a Batch (`lean_batch_wire`: a Batch's own
 * bytes, as a cluster worker reads them from the stream), before protobuf has parsed it (the Ingest
 * stream's request deserializer, collector/wire.py): the Batch's node id, boot id, seq and sent
 * time, its bytes, and its samples' columns, in one pass and with no Python object per sample; of
 * a Batch in the compact encoding (`columns`, field 7, set, and no sample carried whole) the bytes
 * of its compact columns instead, for common/compact.py to decode.
 * It must never accept bytes that protobuf would refuse, so it accepts only what it checks whole:
 * every field of Batch, Sample, the labels' map entries and Histogram with the wire type the
 * schema gives it, every string valid UTF-8 (as proto3 requires), every varint at most 64 bits.
 * Anything else (a batch with events, with both samples and compact columns, an unknown field, a
 * packed field of the wrong length, a message with a second field) gives None, and the caller
 * parses with protobuf, which accepts or refuses as it always did.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MESSAGE_BATCH 2
#define BATCH_NODE_ID 1
#define BATCH_BOOT_ID 2
#define BATCH_SEQ 3
#define BATCH_SAMPLES 4
#define BATCH_SENT 6
#define BATCH_COLUMNS 7
#define SAMPLE_NAME 1
#define SAMPLE_UNIT 2
#define SAMPLE_KIND 3
#define SAMPLE_LABELS 4
#define SAMPLE_VALUE 5
#define SAMPLE_TIME 6
#define SAMPLE_HISTOGRAM 7
#define SAMPLE_REF 8
#define HISTOGRAM_BOUNDS 1
#define HISTOGRAM_COUNTS 2
#define HISTOGRAM_SUM 3
#define HISTOGRAM_COUNT 4
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

/* Strict reading (lean_batch): a tag in its one-byte form (every field read strictly is numbered
 * 1 to 15), so that no longer encoding that protobuf might refuse is taken. */
static int read_tag1(const uint8_t **p, const uint8_t *end, uint64_t *field, unsigned *wt)
{
    if (*p >= end || **p >= 0x80 || (**p >> 3) == 0)
        return -1;
    *field = **p >> 3;
    *wt = **p & 7;
    (*p)++;
    return 0;
}

/* Strict reading: a varint whose tenth byte carries more than the 64th bit is refused. */
static int read_varint64(const uint8_t **p, const uint8_t *end, uint64_t *out)
{
    const uint8_t *start = *p;
    if (read_varint(p, end, out) < 0)
        return -1;
    return (*p - start == 10 && start[9] > 1) ? -1 : 0;
}

/* Whether [p, end) is UTF-8 as proto3 strings must be: no overlong form, no surrogate, nothing
 * past U+10FFFF (RFC 3629). */
static int valid_utf8(const uint8_t *p, const uint8_t *end)
{
    while (p < end) {
        uint64_t eight;
        if (end - p >= 8 && (memcpy(&eight, p, 8), !(eight & 0x8080808080808080ull))) {
            p += 8;   /* eight ASCII bytes */
            continue;
        }
        uint8_t b = *p;
        if (b < 0x80) {
            p++;
            continue;
        }
        int n;
        uint8_t lo = 0x80, hi = 0xbf;
        if (b >= 0xc2 && b <= 0xdf) {
            n = 1;
        } else if (b >= 0xe0 && b <= 0xef) {
            n = 2;
            if (b == 0xe0)
                lo = 0xa0;
            else if (b == 0xed)
                hi = 0x9f;
        } else if (b >= 0xf0 && b <= 0xf4) {
            n = 3;
            if (b == 0xf0)
                lo = 0x90;
            else if (b == 0xf4)
                hi = 0x8f;
        } else {
            return 0;
        }
        if (end - p <= n || p[1] < lo || p[1] > hi)
            return 0;
        for (int i = 2; i <= n; i++)
            if ((p[i] & 0xc0) != 0x80)
                return 0;
        p += n + 1;
    }
    return 1;
}

/* A length-delimited field's bytes: [*p, *p + n) becomes [start, stop), *p moves past it. Protobuf
 * reads a length as a 32-bit size of at most 5 varint bytes and refuses a longer form, so does this. */
static int read_len(const uint8_t **p, const uint8_t *end, const uint8_t **start, const uint8_t **stop)
{
    uint64_t n;
    const uint8_t *first = *p;
    if (read_varint64(p, end, &n) < 0 || *p - first > 5 || n > (uint64_t)(end - *p))
        return -1;
    *start = *p;
    *stop = *p += n;
    return 0;
}

static int read_string(const uint8_t **p, const uint8_t *end)
{
    const uint8_t *a, *b;
    return read_len(p, end, &a, &b) < 0 || !valid_utf8(a, b) ? -1 : 0;
}

/* One map<string, string> entry: key 1 and value 2, strings. */
static int check_label(const uint8_t *p, const uint8_t *end)
{
    while (p < end) {
        uint64_t field;
        unsigned wt;
        if (read_tag1(&p, end, &field, &wt) < 0 || (field != 1 && field != 2) || wt != WT_LEN
                || read_string(&p, end) < 0)
            return -1;
    }
    return 0;
}

/* A Histogram: bounds 1 (doubles), counts 2 (uint64), packed or not; sum 3, count 4. */
static int check_histogram(const uint8_t *p, const uint8_t *end)
{
    while (p < end) {
        uint64_t field, n;
        unsigned wt;
        const uint8_t *a, *b;
        if (read_tag1(&p, end, &field, &wt) < 0)
            return -1;
        if ((field == HISTOGRAM_BOUNDS || field == HISTOGRAM_SUM) && wt == WT_FIXED64) {
            if (end - p < 8)
                return -1;
            p += 8;
        } else if ((field == HISTOGRAM_COUNTS || field == HISTOGRAM_COUNT) && wt == WT_VARINT) {
            if (read_varint64(&p, end, &n) < 0)
                return -1;
        } else if (field == HISTOGRAM_BOUNDS && wt == WT_LEN) {
            if (read_len(&p, end, &a, &b) < 0 || (b - a) % 8 != 0)
                return -1;
        } else if (field == HISTOGRAM_COUNTS && wt == WT_LEN) {
            if (read_len(&p, end, &a, &b) < 0)
                return -1;
            while (a < b)
                if (read_varint64(&a, b, &n) < 0)
                    return -1;
        } else {
            return -1;
        }
    }
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
static int read_sample(const uint8_t *p, const uint8_t *end, samples *out, int strict)
{
    uint32_t ref = 0;
    int64_t t = 0;
    double v = 0.0;
    while (p < end) {
        uint64_t field, n;
        unsigned wt;
        const uint8_t *a, *b;
        if ((strict ? read_tag1(&p, end, &field, &wt) : read_tag(&p, end, &field, &wt)) < 0)
            return -1;
        if (strict && !(field == SAMPLE_VALUE && wt == WT_FIXED64) && !(field == SAMPLE_TIME && wt == WT_VARINT)
                && !(field == SAMPLE_REF && wt == WT_VARINT)) {
            /* every other field checked whole (lean_batch), none skipped */
            int r;
            if ((field == SAMPLE_NAME || field == SAMPLE_UNIT) && wt == WT_LEN)
                r = read_string(&p, end);
            else if (field == SAMPLE_KIND && wt == WT_VARINT)
                r = read_varint64(&p, end, &n);
            else if (field == SAMPLE_LABELS && wt == WT_LEN)
                r = read_len(&p, end, &a, &b) < 0 ? -1 : check_label(a, b);
            else if (field == SAMPLE_HISTOGRAM && wt == WT_LEN)
                r = read_len(&p, end, &a, &b) < 0 ? -1 : check_histogram(a, b);
            else
                r = -1;
            if (r < 0)
                return -1;
            continue;
        }
        if (field == SAMPLE_VALUE && wt == WT_FIXED64) {
            if (end - p < 8)
                return -1;
            uint64_t bits = 0;
            for (int i = 7; i >= 0; i--)   /* little-endian on the wire, whatever this machine is */
                bits = (bits << 8) | p[i];
            memcpy(&v, &bits, 8);
            p += 8;
        } else if (field == SAMPLE_TIME && wt == WT_VARINT) {
            if ((strict ? read_varint64(&p, end, &n) : read_varint(&p, end, &n)) < 0)
                return -1;
            t = (int64_t)n;
        } else if (field == SAMPLE_REF && wt == WT_VARINT) {
            if ((strict ? read_varint64(&p, end, &n) : read_varint(&p, end, &n)) < 0)
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
                r = read_sample(p, p + n, out, 0);
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

/* (refs, time, values, ascending) of the samples read: see columns(). */
static PyObject *make_columns(const samples *sp)
{
    const samples s = *sp;
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
    return out;
}

static PyObject *columns(PyObject *self, PyObject *arg)
{
    samples s = {0};
    int r = read_batch(arg, &s);
    PyObject *out = r == 0 ? make_columns(&s) : NULL;
    samples_free(&s);
    if (r == -1)
        Py_RETURN_NONE;
    return out;
}

/* A Batch read strictly (see the top), from an AgentMessage (`framed`) or from its own bytes: 0, -1
 * for bytes not read here, -2 for a Python error. [*wire, *wire_end) is the Batch's own encoding,
 * [cols[0], cols[1]) its compact columns' bytes (empty: none, as protobuf has an empty bytes field). */
static int read_lean(const uint8_t *p, const uint8_t *end, int framed, const uint8_t **wire,
                     const uint8_t **wire_end, const uint8_t *ids[4], const uint8_t *cols[2], uint64_t *seq,
                     uint64_t *sent, samples *out)
{
    uint64_t field;
    unsigned wt;
    /* the message: one field, the batch, and nothing after it */
    if (framed && (read_tag1(&p, end, &field, &wt) < 0 || field != MESSAGE_BATCH || wt != WT_LEN
                   || read_len(&p, end, wire, wire_end) < 0 || p != end))
        return -1;
    if (!framed) {
        *wire = p;
        *wire_end = end;
    }
    p = *wire;
    end = *wire_end;
    while (p < end) {
        const uint8_t *a, *b;
        if (read_tag1(&p, end, &field, &wt) < 0)
            return -1;
        if ((field == BATCH_NODE_ID || field == BATCH_BOOT_ID) && wt == WT_LEN) {
            if (read_len(&p, end, &a, &b) < 0 || !valid_utf8(a, b))
                return -1;
            ids[2 * (field - 1)] = a;   /* a field given twice: the last one, as protobuf reads it */
            ids[2 * (field - 1) + 1] = b;
        } else if (field == BATCH_SEQ && wt == WT_VARINT) {
            if (read_varint64(&p, end, seq) < 0)
                return -1;
        } else if (field == BATCH_SENT && wt == WT_VARINT) {
            if (read_varint64(&p, end, sent) < 0)
                return -1;
        } else if (field == BATCH_SAMPLES && wt == WT_LEN) {
            int r = read_len(&p, end, &a, &b) < 0 ? -1 : read_sample(a, b, out, 1);
            if (r < 0)
                return r;
        } else if (field == BATCH_COLUMNS && wt == WT_LEN) {
            if (read_len(&p, end, &cols[0], &cols[1]) < 0)   /* given twice: the last one */
                return -1;
        } else {   /* events (5), and any field the schema does not give this wire type */
            return -1;
        }
    }
    /* compact columns beside samples carried whole (refs the agent ran out of): protobuf's reading */
    return cols[1] > cols[0] && out->n > 0 ? -1 : 0;
}

static PyObject *lean(PyObject *arg, int framed)
{
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *start = buf.buf, *wire = NULL, *wire_end = NULL;
    const uint8_t *ids[4] = {start, start, start, start}, *cols[2] = {start, start};
    uint64_t seq = 0, sent = 0;
    samples s = {0};
    int r = read_lean(start, start + buf.len, framed, &wire, &wire_end, ids, cols, &seq, &sent, &s);
    PyObject *out = NULL;
    if (r == 0) {
        PyObject *node = PyUnicode_DecodeUTF8((const char *)ids[0], ids[1] - ids[0], "strict");
        PyObject *boot = node ? PyUnicode_DecodeUTF8((const char *)ids[2], ids[3] - ids[2], "strict") : NULL;
        PyObject *seq_obj = boot ? PyLong_FromUnsignedLongLong(seq) : NULL;
        PyObject *sent_obj = seq_obj ? PyLong_FromLongLong((int64_t)sent) : NULL;
        PyObject *bytes = NULL;
        if (sent_obj && !framed && PyBytes_CheckExact(arg)) {   /* the Batch's own bytes: kept, not copied */
            bytes = arg;
            Py_INCREF(bytes);
        } else if (sent_obj) {
            bytes = PyBytes_FromStringAndSize((const char *)wire, wire_end - wire);
        }
        PyObject *columns = NULL;
        if (bytes && cols[1] > cols[0])   /* the compact encoding: its columns' bytes */
            columns = PyBytes_FromStringAndSize((const char *)cols[0], cols[1] - cols[0]);
        else if (bytes)
            columns = make_columns(&s);
        if (columns != NULL)
            out = PyTuple_Pack(6, node, boot, seq_obj, sent_obj, bytes, columns);
        Py_XDECREF(node);
        Py_XDECREF(boot);
        Py_XDECREF(seq_obj);
        Py_XDECREF(sent_obj);
        Py_XDECREF(bytes);
        Py_XDECREF(columns);
    }
    samples_free(&s);
    PyBuffer_Release(&buf);
    if (r == -1)
        Py_RETURN_NONE;
    return out;   /* NULL with the error set where r == -2 or an object was not made */
}

static PyObject *lean_batch(PyObject *self, PyObject *arg)
{
    return lean(arg, 1);
}

static PyObject *lean_batch_wire(PyObject *self, PyObject *arg)
{
    return lean(arg, 0);
}

static PyMethodDef methods[] = {
    {"rows", rows, METH_O,
     "rows(batch_wire) -> [(series_ref, time_unix_nano, value), ...] of the Batch encoded in "
     "batch_wire, in order; None where the bytes are not read here (read them with protobuf)."},
    {"columns", columns, METH_O,
     "columns(batch_wire) -> (refs, time, values, ascending): the samples' series_refs (a tuple), "
     "their one time (None when they have several, or there are none), their values as the bytes of "
     "an array('d'), and whether the refs rise strictly; None where rows() gives None."},
    {"lean_batch", lean_batch, METH_O,
     "lean_batch(agent_message) -> (node_id, boot_id, seq, sent_unix_nano, batch_wire, columns) of an "
     "AgentMessage that holds a Batch without events, every field of which was checked as protobuf "
     "would (columns as columns() gives them; of a Batch in the compact encoding, the bytes of its "
     "Batch.columns); None for any other bytes (parse them with protobuf)."},
    {"lean_batch_wire", lean_batch_wire, METH_O,
     "lean_batch_wire(batch_wire) -> lean_batch's tuple for a Batch's own bytes (a cluster worker reads "
     "them from the stream); None where lean_batch would give None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire_rows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wire_rows(void)
{
    return PyModule_Create(&module);
}
