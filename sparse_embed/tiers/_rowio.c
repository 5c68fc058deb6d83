/* Positional I/O of fixed-size rows: the store of an offloaded table (sparse_embed/tiers/store.py).
 *
 * A miss reads one row (its values, slots and checksum: one record) from a random place in the store's file;
 * a write-back writes one. Python's os.preadv costs about a microsecond of interpreter work per call on top of
 * the system call, so the loop over rows runs here, with the GIL released (the prefetch thread reads while the
 * step runs). CPython API only.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <unistd.h>

/* rows_io(fd, rows int64 [n], data uint8 [n * record_bytes], record_bytes, write) -> bytes moved.
 * Record i is at file offset rows[i] * record_bytes. Raises OSError (errno) on a failed or short transfer. */
static PyObject *py_rows_io(PyObject *self, PyObject *args) {
    int fd, write;
    Py_buffer rows, data;
    Py_ssize_t rb;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*w*np", &fd, &rows, &data, &rb, &write)) return NULL;
    Py_ssize_t n = rows.len / (Py_ssize_t)sizeof(int64_t);
    if (rb <= 0 || rows.len % (Py_ssize_t)sizeof(int64_t) || data.len < n * rb) {
        PyBuffer_Release(&rows);
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "rows_io: data must hold len(rows) * record_bytes bytes");
        return NULL;
    }
    const int64_t *r = (const int64_t *)rows.buf;
    char *buf = (char *)data.buf;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && !err; i++) {
        char *p = buf + i * rb;
        off_t off = (off_t)r[i] * (off_t)rb;
        Py_ssize_t left = rb;
        while (left > 0) {
            ssize_t got = write ? pwrite(fd, p, (size_t)left, off) : pread(fd, p, (size_t)left, off);
            if (got < 0 && errno == EINTR) continue;
            if (got <= 0) { err = got < 0 ? errno : EIO; break; }
            p += got; off += got; left -= got;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&rows);
    PyBuffer_Release(&data);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(n * rb);
}

static PyMethodDef methods[] = {
    {"rows_io", py_rows_io, METH_VARARGS,
     "rows_io(fd, rows int64 [n], data [n * record_bytes], record_bytes, write) -> bytes moved (pread/pwrite)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_rowio",
    .m_doc = "Positional row I/O of an offloaded table's store (see _rowio.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__rowio(void) { return PyModule_Create(&module); }
