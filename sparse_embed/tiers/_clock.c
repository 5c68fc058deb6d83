/* The two passes of an offloaded table's cache admission (sparse_embed.tiers.cache) that touch every id of a
 * batch or every row the CLOCK hand sweeps: the same results as cache.py's numpy path, in one pass each.
 *
 * `lookup`: each id's cache row, the batch's distinct cached rows (marked in `pinned`) and where its misses are.
 * `sweep`: CLOCK's victims, clearing reference bits as the hand goes, and the bits it found on its first turn
 * (what undoing the admission puts back). Arrays arrive through the buffer protocol (no numpy headers at build
 * time), C-contiguous; the loops run without the GIL. Every index is checked: no input reads or writes out of
 * bounds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef long long i64;

/* A C-contiguous buffer of `obj` with items of `size` bytes and a format in `formats`; a TypeError naming `what`
   otherwise. */
static int get(PyObject *obj, Py_buffer *view, Py_ssize_t size, const char *formats, int writable, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '@')
        f++;
    if (view->itemsize != size || !f[0] || f[1] || !strchr(formats, f[0])) {
        PyErr_Format(PyExc_TypeError, "%s: unexpected buffer format '%s' (itemsize %zd)", what,
                     view->format ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void release(Py_buffer *views, int n)
{
    for (int i = 0; i < n; i++)
        if (views[i].obj)
            PyBuffer_Release(&views[i]);
}

/* lookup(rows int64 [n], slot_of int32 [V], pinned bool [C], mapped int32 [n], cached int64 [n],
          miss_at int64 [n]) -> (hits, cached rows, misses) */
static PyObject *py_lookup(PyObject *self, PyObject *args)
{
    PyObject *o[6];
    Py_buffer v[6] = {{0}};
    static const char *what[6] = {"rows", "slot_of", "pinned", "mapped", "cached", "miss_at"};
    static const Py_ssize_t size[6] = {8, 4, 1, 4, 8, 8};
    static const char *fmt[6] = {"lq", "i", "?B", "i", "lq", "lq"};
    if (!PyArg_ParseTuple(args, "OOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5]))
        return NULL;
    for (int i = 0; i < 6; i++)
        if (get(o[i], &v[i], size[i], fmt[i], i >= 2, what[i]) < 0) {
            release(v, i);
            return NULL;
        }
    i64 n = v[0].len / 8, vocab = v[1].len / 4, rows = v[2].len;
    if (v[3].len / 4 < n || v[4].len / 8 < n || v[5].len / 8 < n) {
        release(v, 6);
        return PyErr_Format(PyExc_ValueError, "lookup: outputs shorter than the %lld rows", n);
    }
    const i64 *id = v[0].buf;
    const int32_t *slot_of = v[1].buf;
    uint8_t *pinned = v[2].buf;
    int32_t *mapped = v[3].buf;
    i64 *cached = v[4].buf, *miss_at = v[5].buf;
    i64 hits = 0, c = 0, m = 0, bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (i64 i = 0; i < n; i++) {
        i64 r = id[i];
        if (i + 16 < n && (uint64_t)id[i + 16] < (uint64_t)vocab)  /* the map is far larger than the caches */
            __builtin_prefetch(&slot_of[id[i + 16]]);
        if (r < 0) {
            mapped[i] = -1;
            continue;
        }
        int32_t s = r < vocab ? slot_of[r] : -2;
        if (s >= rows || s < -1) {
            bad = i;
            break;
        }
        mapped[i] = s;
        if (s < 0) {
            miss_at[m++] = i;
        } else {
            hits++;
            if (!pinned[s]) {
                pinned[s] = 1;
                cached[c++] = s;
            }
        }
    }
    Py_END_ALLOW_THREADS
    release(v, 6);
    if (bad >= 0)
        return PyErr_Format(PyExc_IndexError, "lookup: row %lld (entry %lld) outside the table or its map", id[bad],
                            bad);
    return Py_BuildValue("LLL", hits, c, m);
}

/* sweep(referenced bool [C], keep bool [C], hand, m, victims int64 [m], first_bits bool [C]) -> (hand, swept):
   CLOCK from `hand` until `m` rows are taken (neither kept nor referenced; each then kept); every row passed has
   its bit cleared; `first_bits[i]` is the bit row (hand + i) % C had, for i < min(swept, C). swept = -1: no m
   rows to take within two turns. */
static PyObject *py_sweep(PyObject *self, PyObject *args)
{
    PyObject *o[4];
    i64 hand, m;
    Py_buffer v[4] = {{0}};
    static const char *what[4] = {"referenced", "keep", "victims", "first_bits"};
    static const Py_ssize_t size[4] = {1, 1, 8, 1};
    static const char *fmt[4] = {"?B", "?B", "lq", "?B"};
    if (!PyArg_ParseTuple(args, "OOLLOO", &o[0], &o[1], &hand, &m, &o[2], &o[3]))
        return NULL;
    for (int i = 0; i < 4; i++)
        if (get(o[i], &v[i], size[i], fmt[i], 1, what[i]) < 0) {
            release(v, i);
            return NULL;
        }
    i64 rows = v[0].len;
    if (v[1].len != rows || v[3].len < rows || v[2].len / 8 < m || m < 0 || rows <= 0 || hand < 0 || hand >= rows) {
        release(v, 4);
        return PyErr_Format(PyExc_ValueError, "sweep: bad sizes (cache %lld rows, hand %lld, %lld victims)", rows,
                            hand, m);
    }
    uint8_t *ref = v[0].buf, *keep = v[1].buf, *first = v[3].buf;
    i64 *victims = v[2].buf;
    i64 taken = 0, swept = 0, p = hand, limit = 2 * rows + m;
    Py_BEGIN_ALLOW_THREADS
    while (taken < m && swept < limit) {
        if (swept < rows)
            first[swept] = ref[p];
        if (!keep[p] && !ref[p]) {
            victims[taken++] = p;
            keep[p] = 1;
        }
        ref[p] = 0;
        swept++;
        p = p + 1 == rows ? 0 : p + 1;
    }
    Py_END_ALLOW_THREADS
    release(v, 4);
    return Py_BuildValue("LL", p, taken < m ? -1 : swept);
}

static PyMethodDef methods[] = {
    {"lookup", py_lookup, METH_VARARGS,
     "lookup(rows, slot_of, pinned, mapped, cached, miss_at) -> (hits, cached rows, misses): one batch's ids"},
    {"sweep", py_sweep, METH_VARARGS,
     "sweep(referenced, keep, hand, m, victims, first_bits) -> (hand, swept): CLOCK's m victims"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_clock",
    .m_doc = "C passes of an offloaded table's cache admission (see _clock.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__clock(void) { return PyModule_Create(&module); }
