/* Native kernels of sparse_embed.preprocess: ids -> partitioned, padded COO buffers.
 *
 * The same results as preprocess.py's numpy path, bit for bit, in a few O(N)
 * passes: `validate` (range of every id, finite weights), `count` (entries and
 * unique rows per (device, shard) partition) and `fill` (a stable counting sort
 * straight into the padded [D, S * cap] outputs). `concat_rows` joins a list of
 * ragged rows. Arrays arrive through the buffer protocol (no numpy headers at
 * build time), C-contiguous. The hot loops run without the GIL, so a
 * background prefetch thread overlaps with the training step.
 *
 * `count` and `fill` re-check every id against its vocabulary although
 * `validate` has run: then no input (not even ids changed by another thread in
 * between) can make them read or write out of bounds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef long long i64;
typedef unsigned long long u64;

/* ------------------------------------------------------------------ buffers */

/* The single format character of a native-order buffer, or 0. */
static char format_char(const Py_buffer *view)
{
    const char *f = view->format ? view->format : "B";
    if (*f == '@')
        f++;
    return f[0] && !f[1] ? f[0] : 0;
}

/* Gets a C-contiguous buffer of `obj` with items of `kind`: 'i' int32, 'l' int64,
   'n' int32 or int64, 'f' float32. Sets a TypeError naming `what` otherwise. */
static int get_buffer(PyObject *obj, Py_buffer *view, char kind, int writable, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    char c = format_char(view);
    int is_int = c == 'i' || c == 'l' || c == 'q';
    int ok = kind == 'f' ? c == 'f' && view->itemsize == 4
           : is_int && ((kind != 'l' && view->itemsize == 4) || (kind != 'i' && view->itemsize == 8));
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s: unexpected buffer format '%s' (itemsize %zd)", what,
                     view->format ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static inline i64 id_at(const Py_buffer *ids, i64 k)
{
    return ids->itemsize == 8 ? ((const int64_t *)ids->buf)[k] : ((const int32_t *)ids->buf)[k];
}

/* ------------------------------------------------------------------ features */

/* One feature of a stack, in the form inputs.checked() gives (see preprocess.py). */
typedef struct {
    Py_buffer ids;      /* [n] int32/int64: dense [batch, width] (-1 = padding) or ragged values */
    Py_buffer weights;  /* [n] float32; .buf NULL = all 1 */
    Py_buffer offsets;  /* [batch + 1] int64 row starts of ragged ids; .buf NULL = dense */
    i64 n, batch, width, vocab, table_row_offset, row_offset, samples_per_device, seq_len;
    i64 shard; /* the one shard that holds the feature's table ("table" placement), or -1 (MOD) */
    int combiner;       /* 0 sum, 1 mean, 2 sqrtn */
    /* SparseCore stacks (sc > 0 SparseCores per device, each holding sc_rows rows): MOD over every SparseCore,
       the table rotated by `rotation`; the feature's rows of a device cut into sc slices of slice_rows rows */
    i64 sc, sc_rows, rotation, slice_rows;
} Feature;

/* The output rows of one sample: one, or seq_len for a sequence feature. */
static inline i64 rows_per_sample(const Feature *f) { return f->seq_len > 0 ? f->seq_len : 1; }

/* Runs the statements after the arguments for every id of feature f in samples
   [b0, b1), in input order, with b (sample), k (index into ids), pos (position in
   the sample) and id. Skips dense -1 padding and positions past seq_len. The
   feature's fields are copied to locals first, so they stay in registers. */
#define FOR_EACH_ID(f, b0, b1, ...)                                                          \
    do {                                                                                     \
        const int64_t *off_ = (f)->offsets.buf;                                              \
        const void *ids_ = (f)->ids.buf;                                                     \
        const int wide_ = (f)->ids.itemsize == 8;                                            \
        const i64 width_ = (f)->width, seq_ = (f)->seq_len;                                  \
        for (i64 b = (b0); b < (b1); b++) {                                                  \
            i64 lo_ = off_ ? off_[b] : b * width_, hi_ = off_ ? off_[b + 1] : lo_ + width_;  \
            if (seq_ > 0 && hi_ - lo_ > seq_)                                                \
                hi_ = lo_ + seq_;                                                            \
            for (i64 k = lo_; k < hi_; k++) {                                                \
                i64 id = wide_ ? ((const int64_t *)ids_)[k] : ((const int32_t *)ids_)[k];    \
                i64 pos = k - lo_;                                                           \
                (void)pos;                                                                   \
                if (id == -1 && !off_)                                                       \
                    continue;                                                                \
                __VA_ARGS__                                                                  \
            }                                                                                \
        }                                                                                    \
    } while (0)

static void release_features(Feature *fs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyBuffer_Release(&fs[i].ids);
        PyBuffer_Release(&fs[i].weights);
        PyBuffer_Release(&fs[i].offsets);
    }
    free(fs);
}

/* The shapes that make FOR_EACH_ID stay inside every buffer, or an error message. */
static const char *check_feature(const Feature *f, i64 devices, i64 total_rows)
{
    if (f->batch < 0 || f->width < 0 || f->vocab < 0 || f->table_row_offset < 0 || f->row_offset < 0
        || f->samples_per_device < 0 || f->seq_len < 0 || f->combiner < 0 || f->combiner > 2)
        return "negative size or unknown combiner";
    if (devices * f->samples_per_device > f->batch)
        return "fewer samples than devices * samples_per_device";
    if (f->vocab > total_rows - f->table_row_offset)
        return "the table does not fit in the stack";
    if (f->shard < -1 || f->shard >= devices)
        return "the table's shard is not a device";
    /* SparseCores: the stack's rows are N = total_rows / sc_rows SparseCores' (sc of each shard) */
    if (f->sc < 0 || (f->sc && (f->shard != -1 || f->sc_rows <= 0 || total_rows % f->sc_rows
                                || total_rows / f->sc_rows % f->sc || f->rotation < 0
                                || f->rotation >= total_rows / f->sc_rows || f->slice_rows < 0
                                || f->samples_per_device * rows_per_sample(f) % f->sc)))
        return "bad SparseCore layout";
    if (f->weights.buf && f->weights.len / 4 != f->n)
        return "weights and ids differ in size";
    if (!f->offsets.buf)
        return (f->width ? f->n % f->width == 0 && f->n / f->width == f->batch : f->n == 0)
                   ? NULL : "dense ids are not [batch, width]";
    const int64_t *o = f->offsets.buf;
    if (f->offsets.len / 8 != f->batch + 1 || o[0] != 0 || o[f->batch] != f->n)
        return "offsets are not [batch + 1] from 0 to the number of ids";
    for (i64 b = 0; b < f->batch; b++)
        if (o[b + 1] < o[b])
            return "offsets decrease";
    return NULL;
}

/* Reads a sequence of feature tuples (ids, weights, offsets, batch, width, vocab,
   table_row_offset, row_offset, samples_per_device, seq_len, combiner, shard, sc, sc_rows, rotation, slice_rows). */
static Feature *parse_features(PyObject *seq, Py_ssize_t *count, i64 devices, i64 total_rows)
{
    PyObject *items = PySequence_Tuple(seq); /* a private copy: nothing can resize it under us */
    if (!items)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    Feature *fs = calloc(n ? n : 1, sizeof(Feature));
    if (!fs) {
        Py_DECREF(items);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Feature *f = &fs[i];
        PyObject *ids, *weights, *offsets;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(items, i), "OOOLLLLLLLiLLLLL", &ids, &weights, &offsets,
                              &f->batch, &f->width, &f->vocab, &f->table_row_offset, &f->row_offset,
                              &f->samples_per_device, &f->seq_len, &f->combiner, &f->shard, &f->sc, &f->sc_rows,
                              &f->rotation, &f->slice_rows)
            || get_buffer(ids, &f->ids, 'n', 0, "ids") < 0
            || (weights != Py_None && get_buffer(weights, &f->weights, 'f', 0, "weights") < 0)
            || (offsets != Py_None && get_buffer(offsets, &f->offsets, 'l', 0, "offsets") < 0))
            goto fail;
        f->n = f->ids.len / f->ids.itemsize;
        const char *why = check_feature(f, devices, total_rows);
        if (why) {
            PyErr_Format(PyExc_ValueError, "feature %zd: %s", i, why);
            goto fail;
        }
    }
    Py_DECREF(items);
    *count = n;
    return fs;
fail:
    Py_DECREF(items);
    release_features(fs, n);
    return NULL;
}

/* ------------------------------------------------------------------ stack layout */

typedef struct {
    i64 devices, shards, total_rows;
    int shift; /* log2(shards) when shards is a power of 2, else -1 (then divide) */
} Layout;

static int make_layout(Layout *lay, i64 devices, i64 shards, i64 total_rows)
{
    if (devices < 1 || shards < 1 || total_rows < 0 || total_rows % shards) {
        PyErr_SetString(PyExc_ValueError, "bad stack layout");
        return -1;
    }
    *lay = (Layout){devices, shards, total_rows, -1};
    if ((shards & (shards - 1)) == 0)
        for (lay->shift = 0; (1LL << lay->shift) < shards; lay->shift++) {}
    return 0;
}

/* Stack row r lives on shard r % S at row r / S (MOD sharding), or, when the feature's table is
   whole on one shard ("table" placement), on that shard at row r - shard * rows_per_shard. On
   SparseCores (f->sc = C per device): on SparseCore p = (r % N + rotation) % N of the N = S * C, at its
   row r / N, which is device p / C, local row (p % C) * sc_rows + r / N. */
static inline void split_row(const Layout *lay, const Feature *f, u64 r, i64 *shard, i64 *col)
{
    const i64 fixed = f->shard;
    if (f->sc > 0) {
        const u64 N = (u64)(lay->shards * f->sc), sc = (u64)f->sc;
        if (!(N & (N - 1)) && !(sc & (sc - 1))) { /* powers of 2 (the usual case): no divisions */
            const u64 p = ((r & (N - 1)) + (u64)f->rotation) & (N - 1);
            *shard = (i64)(p >> __builtin_ctzll(sc));
            *col = (i64)((p & (sc - 1)) * (u64)f->sc_rows + (r >> __builtin_ctzll(N)));
        } else {
            const u64 p = (r % N + (u64)f->rotation) % N;
            *shard = (i64)(p / sc);
            *col = (i64)(p % sc * (u64)f->sc_rows + r / N);
        }
    } else if (fixed >= 0) {
        *shard = fixed;
        *col = (i64)r - fixed * (lay->total_rows / lay->shards);
    } else if (lay->shift >= 0) {
        *shard = (i64)(r & (u64)(lay->shards - 1));
        *col = (i64)(r >> lay->shift);
    } else {
        *shard = (i64)(r % (u64)lay->shards);
        *col = (i64)(r / (u64)lay->shards);
    }
}

/* ------------------------------------------------------------------ kernels */

/* Index of the first out-of-range id (-1 padding is fine in dense input), or -1;
   index of the first non-finite weight of a non-padding id, or -1. Blocks are
   first checked branch-free (vectorized): 0 <= id + padding < vocab + padding. */
static void validate_ids(const Py_buffer *ids, const float *w, i64 n, i64 vocab, int padding, i64 *bad_id, i64 *bad_w)
{
    const u64 lim = vocab < 0 ? 1ULL << 63 : (u64)vocab; /* vocab < 0: raw ids, any id in [0, 2**63) */
    const u64 p = padding ? 1 : 0, limit = lim + p;
    *bad_id = *bad_w = -1;
    for (i64 lo = 0; lo < n; lo += 4096) {
        i64 hi = n - lo < 4096 ? n : lo + 4096;
        int bad = 0;
        if (ids->itemsize == 8)
            for (i64 k = lo; k < hi; k++)
                bad |= (u64)((const int64_t *)ids->buf)[k] + p >= limit;
        else
            for (i64 k = lo; k < hi; k++)
                bad |= (u64)(i64)((const int32_t *)ids->buf)[k] + p >= limit;
        if (w && *bad_w < 0)
            for (i64 k = lo; k < hi; k++)
                bad |= !(w[k] - w[k] == 0.0f); /* NaN or inf (maybe a padding id's: the scan below decides) */
        for (i64 k = lo; bad && k < hi; k++) {
            i64 id = id_at(ids, k);
            if (padding && id == -1)
                continue;
            if ((u64)id >= lim) {
                *bad_id = k;
                return;
            }
            if (w && *bad_w < 0 && !isfinite(w[k]))
                *bad_w = k;
        }
    }
}

/* Entries (counts) and distinct stack rows (unique) per partition d * S + shard.
   `seen` is a zeroed bitset over the stack's rows, cleared again after each
   device through `touched` (its nonzero words). With one shard, the counts
   stay in registers. Returns -1 on an out-of-range id. */
static int count_ids(const Feature *fs, Py_ssize_t nf, const Layout *lay, u64 *seen, i64 *touched,
                     int64_t *counts, i64 *unique)
{
    const i64 words = lay->total_rows / 64 + 1;
    for (i64 d = 0; d < lay->devices; d++) {
        i64 nt = 0, n_dev = 0, u_dev = 0;
        for (Py_ssize_t i = 0; i < nf; i++) {
            const Feature *f = &fs[i];
            i64 spd = f->samples_per_device;
            FOR_EACH_ID(f, d * spd, (d + 1) * spd,
                if ((u64)id >= (u64)f->vocab)
                    return -1;
                u64 r = (u64)(id + f->table_row_offset), word = seen[r >> 6], bit = 1ULL << (r & 63);
                i64 shard, col, first = !(word & bit); /* branch-free: these are unpredictable */
                split_row(lay, f, r, &shard, &col);
                seen[r >> 6] = word | bit;
                touched[nt] = (i64)(r >> 6);
                nt += !word;
                n_dev++;
                u_dev += first;
                if (lay->shards > 1) {
                    counts[d * lay->shards + shard]++;
                    unique[d * lay->shards + shard] += first;
                });
        }
        if (lay->shards == 1) {
            counts[d] = n_dev;
            unique[d] = u_dev;
        }
        if (nt * 16 > words) /* dense: a sequential clear beats random writes */
            memset(seen, 0, (size_t)words * sizeof(u64));
        else
            while (nt)
                seen[touched[--nt]] = 0;
    }
    return 0;
}

/* The combiner's denominator per output row of a mean/sqrtn feature, as jax-tpu-embedding computes it
   (host/gains.py): a float32 sum in input order of w (mean) or of w^2 squared in double (sqrtn), then sqrt. */
static void denominators(const Feature *f, i64 devices, float *den)
{
    const float *w = f->weights.buf;
    i64 per = rows_per_sample(f);
    FOR_EACH_ID(f, 0, devices * f->samples_per_device,
        float x = w ? w[k] : 1.0f;
        float *d = &den[b * per + (f->seq_len > 0 ? pos : 0)];
        *d = f->combiner == 2 ? (float)((double)*d + (double)x * (double)x) : *d + x;);
    if (f->combiner == 2)
        for (i64 i = 0; i < f->batch * per; i++)
            den[i] = sqrtf(den[i]);
}

/* Scatters every id to the next free slot of its partition (a stable counting
   sort; ids past `cap` are dropped), then pads each partition's tail. */
static int fill_ids(const Feature *fs, Py_ssize_t nf, const Layout *lay, float *const *dens, i64 cap,
                    i64 rows_per_device, i64 *cursor, int32_t *cols, int32_t *rows, float *vals)
{
    const Layout L = *lay;
    for (i64 d = 0; d < L.devices; d++) {
        i64 run = 0; /* cursor[d] when there is one shard, in a register */
        for (Py_ssize_t i = 0; i < nf; i++) {
            const Feature *f = &fs[i];
            const float *w = f->weights.buf;
            const float *den = dens[i];
            const i64 spd = f->samples_per_device, per = rows_per_sample(f), seq = f->seq_len > 0;
            const i64 vocab = f->vocab, offset = f->table_row_offset, first = d * spd * per;
            const i64 sliced = f->sc > 0, cut = sliced ? spd * per / f->sc : 1; /* a slice's rows of the feature */
            FOR_EACH_ID(f, d * spd, (d + 1) * spd,
                if ((u64)id >= (u64)vocab)
                    return -1;
                i64 shard, col;
                split_row(&L, f, (u64)(id + offset), &shard, &col);
                i64 key = d * L.shards + shard, slot = L.shards > 1 ? cursor[key]++ : run++;
                if (slot >= cap)
                    continue;
                slot += key * cap;
                i64 row = b * per + (seq ? pos : 0), local = row - first; /* the feature's output row */
                float x = w ? w[k] : 1.0f;
                cols[slot] = (int32_t)col;
                rows[slot] = (int32_t)(f->row_offset + (sliced ? local / cut * f->slice_rows + local % cut : local));
                vals[slot] = !den ? x : den[row] != 0 ? x / den[row] : 0.0f;);
        }
        if (L.shards == 1)
            cursor[d] = run;
    }
    i64 rows_per_shard = L.total_rows / L.shards;
    for (i64 key = 0; key < L.devices * L.shards; key++)
        for (i64 s = key * cap + (cursor[key] < cap ? cursor[key] : cap); s < (key + 1) * cap; s++) {
            cols[s] = (int32_t)rows_per_shard;
            rows[s] = (int32_t)rows_per_device;
            vals[s] = 0.0f;
        }
    return 0;
}


/* ------------------------------------------------------------------ raw 64-bit ids */

/* A raw id's owner shard is splitmix64(id) % S: core/raw_keys.py's owner_shards, whose constants these are (the
   numpy definition; tests check this one against it through owner_shards below). */
static inline u64 splitmix64(u64 z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* splitmix64(id) % S without a division when S is a power of 2. */
static inline i64 owner_of(const Layout *lay, u64 h)
{
    return lay->shift >= 0 ? (i64)(h & (u64)(lay->shards - 1)) : (i64)(h % (u64)lay->shards);
}

/* One device's distinct ids: open addressing, key id + 1 (0 = empty) beside its value (one cache line
   per probe), emptied through `used` after each device. */
typedef struct {
    u64 key;
    int32_t val, pad;
} IdSlot;

typedef struct {
    IdSlot *slots;
    i64 *used, mask;
    int shift; /* 64 - log2(size) */
} IdSet;

/* Fibonacci hashing: the top bits of id times 2**64 / golden ratio. */
#define GOLDEN 0x9E3779B97F4A7C15ULL
#define RAW_AHEAD 32                             /* ids between the prefetch of an id's slot and its probe */
#define IDSET_KEEP_BYTES ((size_t)64 << 20)      /* a thread keeps its table up to this size */

/* Each thread's table, kept empty between calls: a call neither allocates nor zeroes one (a fresh table would
   fault in or clear every page, as the ids land all over it). */
static _Thread_local IdSet kept_set;

/* The calling thread's table, empty, of at least 2n slots (load <= 1/2: short probes). */
static int idset_init(IdSet *t, i64 n)
{
    i64 size = 16;
    int shift = 60;
    for (; size < 2 * n; size *= 2)
        shift--;
    IdSet *k = &kept_set;
    if (!k->slots || k->mask + 1 < size) {
        free(k->slots);
        free(k->used);
        *k = (IdSet){calloc((size_t)size, sizeof(IdSlot)), malloc((size_t)(size / 2 + 1) * sizeof(i64)), size - 1,
                     shift};
        if (!k->slots || !k->used) {
            free(k->slots);
            free(k->used);
            *k = (IdSet){0};
            return -1;
        }
    }
    *t = *k;
    return 0;
}

/* After a call (its table empty again): a rare huge table goes back to the system. */
static void idset_done(const IdSet *t)
{
    if (t->slots && (size_t)(t->mask + 1) * sizeof(IdSlot) > IDSET_KEEP_BYTES) {
        free(kept_set.slots);
        free(kept_set.used);
        kept_set = (IdSet){0};
    }
}

/* count_raw's state, in locals (the loops' stores cannot alias them, so they stay in registers): the table, the
   slots it used, the device's distinct ids (one shard: the numbers), the entries so far. */
typedef struct {
    IdSlot *slots;
    i64 *used;
    u64 mask;
    int shift;
    i64 n_used, u_dev, e;
} RawCount;

/* The slot of `id` in a table: its own, or the empty one it would take. */
static inline u64 idset_probe(const IdSlot *slots, u64 mask, int shift, u64 id)
{
    u64 h = id * GOLDEN >> shift;
    while (slots[h].key && slots[h].key != id + 1)
        h = (h + 1) & mask;
    return h;
}

/* One entry of partition `key`: its id's number (a new id: the partition's next; one shard: the device's) into
   num[e], the partition into part[e]. */
static inline __attribute__((always_inline)) void raw_entry(RawCount *c, i64 *unique, int32_t *part, int32_t *num,
                                                            u64 id, i64 key, const int one_shard)
{
    const u64 key1 = id + 1, h = idset_probe(c->slots, c->mask, c->shift, id);
    if (!c->slots[h].key) {
        c->slots[h].key = key1;
        c->slots[h].val = (int32_t)(one_shard ? c->u_dev++ : unique[key]++);
        c->used[c->n_used++] = (i64)h;
    }
    part[c->e] = (int32_t)key;
    num[c->e++] = c->slots[h].val;
}

/* raw_entry over the ids [from, to) of a dense int64 feature on one shard (the usual case on one device), with
   few live values, so that they stay in registers; the entries' partition (the device's) is written after. */
static int raw_dense_one_shard(RawCount *c, const int64_t *ids, i64 from, i64 to, int32_t key, int32_t *part,
                               int32_t *num)
{
    IdSlot *const slots = c->slots;
    i64 *const used = c->used;
    const u64 mask = c->mask;
    const int shift = c->shift;
    i64 n_used = c->n_used, u = c->u_dev, e = c->e;
    const i64 e0 = e;
    int status = 0;
    for (i64 k = from; k < to; k++) {
        const i64 id = ids[k];
        if (k + RAW_AHEAD < to) /* the slot of an id a few ahead: its cache miss overlaps this one */
            __builtin_prefetch(&slots[(u64)ids[k + RAW_AHEAD] * GOLDEN >> shift]);
        if (id < 0) {
            if (id == -1)
                continue; /* padding */
            status = -1;
            break;
        }
        const u64 h = idset_probe(slots, mask, shift, (u64)id);
        if (!slots[h].key) {
            slots[h].key = (u64)id + 1;
            slots[h].val = (int32_t)u++;
            used[n_used++] = (i64)h;
        }
        num[e++] = slots[h].val;
    }
    for (i64 x = e0; x < e; x++)
        part[x] = key;
    c->n_used = n_used, c->u_dev = u, c->e = e;
    return status;
}

/* count_raw of one device's ids of one feature. -1 on a negative id. */
static inline __attribute__((always_inline)) int raw_feature(RawCount *c, const Feature *f, const Layout *L, i64 d,
                                                             int64_t *counts, i64 *unique, int32_t *part,
                                                             int32_t *num, const int one_shard)
{
    const i64 S = L->shards, spd = f->samples_per_device;
    if (one_shard && !f->offsets.buf && f->ids.itemsize == 8 && (f->seq_len == 0 || f->width <= f->seq_len))
        return raw_dense_one_shard(c, f->ids.buf, d * spd * f->width, (d + 1) * spd * f->width, (int32_t)d, part,
                                   num);
    FOR_EACH_ID(f, d * spd, (d + 1) * spd,
        if (id < 0)
            return -1;
        if (k + RAW_AHEAD < f->n) /* as in raw_dense_one_shard */
            __builtin_prefetch(&c->slots[(u64)id_at(&f->ids, k + RAW_AHEAD) * GOLDEN >> c->shift]);
        const i64 key = one_shard ? d : d * S + owner_of(L, splitmix64((u64)id));
        if (!one_shard)
            counts[key]++;
        raw_entry(c, unique, part, num, (u64)id, key, one_shard););
    return 0;
}

static inline __attribute__((always_inline)) int count_raw_shards(const Feature *fs, Py_ssize_t nf, const Layout *L,
                                                                  const IdSet *seen, int64_t *counts, i64 *unique,
                                                                  int32_t *part, int32_t *num, const int one_shard)
{
    RawCount c = {seen->slots, seen->used, (u64)seen->mask, seen->shift, 0, 0, 0};
    int status = 0;
    for (i64 d = 0; d < L->devices && status == 0; d++) {
        const i64 e0 = c.e;
        c.u_dev = 0;
        for (Py_ssize_t i = 0; i < nf && status == 0; i++)
            status = raw_feature(&c, &fs[i], L, d, counts, unique, part, num, one_shard);
        if (one_shard) {
            counts[d] = c.e - e0;
            unique[d] = c.u_dev;
        }
        while (c.n_used) /* empty again for the next device (and call), whatever happened */
            c.slots[c.used[--c.n_used]].key = 0;
    }
    return status;
}

/* Entries and distinct ids per partition d * S + owner shard; for every entry (in the order fill_raw
   meets them) its partition and its id's number among the distinct ids of the partition, by first
   occurrence (the numbers of the entries that fit a capacity are their numbers among those entries,
   as they come first). -1 on a negative id. */
static int count_raw(const Feature *fs, Py_ssize_t nf, const Layout *lay, const IdSet *seen, int64_t *counts,
                     i64 *unique, int32_t *part, int32_t *num)
{
    return lay->shards == 1 ? count_raw_shards(fs, nf, lay, seen, counts, unique, part, num, 1)
                            : count_raw_shards(fs, nf, lay, seen, counts, unique, part, num, 0);
}

/* fill_ids for raw ids, from count_raw's partitions and numbers: the column of an entry is its id's
   number; keys[(key * cap + j) * 2] gets the id's (hi, lo), unused keys -1. `named` (zeroed) counts
   each partition's numbers. */
static int fill_raw(const Feature *fs, Py_ssize_t nf, const Layout *lay, float *const *dens, i64 cap,
                    i64 rows_per_device, const int32_t *part, const int32_t *num, i64 n, i64 *cursor, i64 *named,
                    int32_t *cols, int32_t *rows, float *vals, int32_t *keys)
{
    i64 e = 0;
    for (i64 d = 0; d < lay->devices; d++) {
        for (Py_ssize_t i = 0; i < nf; i++) {
            const Feature *f = &fs[i];
            const float *w = f->weights.buf;
            const float *den = dens[i];
            const i64 spd = f->samples_per_device, per = rows_per_sample(f), seq = f->seq_len > 0;
            const i64 row_base = f->row_offset - d * spd * per;
            FOR_EACH_ID(f, d * spd, (d + 1) * spd,
                if (id < 0 || e >= n)
                    return -1;
                i64 key = part[e], j = num[e++], slot = cursor[key]++;
                if (key < 0 || key >= lay->devices * lay->shards || j < 0)
                    return -1;
                if (slot >= cap)
                    continue;
                if (j >= cap) /* kept entries' numbers are below cap, unless the ids changed */
                    return -1;
                named[key] = j + 1 > named[key] ? j + 1 : named[key];
                slot += key * cap;
                keys[(key * cap + j) * 2] = (int32_t)(uint32_t)((u64)id >> 32);
                keys[(key * cap + j) * 2 + 1] = (int32_t)(uint32_t)(u64)id;
                i64 row = b * per + (seq ? pos : 0);
                float x = w ? w[k] : 1.0f;
                cols[slot] = (int32_t)j;
                rows[slot] = (int32_t)(row_base + row);
                vals[slot] = !den ? x : den[row] != 0 ? x / den[row] : 0.0f;);
        }
    }
    for (i64 key = 0; key < lay->devices * lay->shards; key++) {
        for (i64 s = key * cap + (cursor[key] < cap ? cursor[key] : cap); s < (key + 1) * cap; s++) {
            cols[s] = (int32_t)cap;
            rows[s] = (int32_t)rows_per_device;
            vals[s] = 0.0f;
        }
        for (i64 s = key * cap + named[key]; s < (key + 1) * cap; s++)
            keys[2 * s] = keys[2 * s + 1] = -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ Python API */

static PyObject *ids_changed(void)
{
    PyErr_SetString(PyExc_RuntimeError, "an id went out of range after validation (ids changed during preprocess?)");
    return NULL;
}

static PyObject *py_validate(PyObject *self, PyObject *args)
{
    PyObject *ids_obj, *w_obj;
    i64 vocab, bad_id, bad_w;
    int padding;
    Py_buffer ids, w = {0};
    if (!PyArg_ParseTuple(args, "OOLp", &ids_obj, &w_obj, &vocab, &padding)
        || get_buffer(ids_obj, &ids, 'n', 0, "ids") < 0)
        return NULL;
    i64 n = ids.len / ids.itemsize;
    if (w_obj != Py_None && (get_buffer(w_obj, &w, 'f', 0, "weights") < 0 || w.len / 4 != n)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "weights and ids differ in size");
        PyBuffer_Release(&ids);
        PyBuffer_Release(&w);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    validate_ids(&ids, w.buf, n, vocab, padding, &bad_id, &bad_w);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&ids);
    PyBuffer_Release(&w);
    return Py_BuildValue("LL", bad_id, bad_w);
}

/* owner_shards(ids int64 [n], shards, out int64 [n]): each raw id's owner shard, as the partition of raw ids
   computes it (core/raw_keys.py: owner_shards, which tests compare it with). */
static PyObject *py_owner_shards(PyObject *self, PyObject *args)
{
    PyObject *ids_obj, *out_obj;
    i64 shards;
    Layout lay;
    Py_buffer ids, out;
    if (!PyArg_ParseTuple(args, "OLO", &ids_obj, &shards, &out_obj) || make_layout(&lay, 1, shards, 0) < 0
        || get_buffer(ids_obj, &ids, 'l', 0, "ids") < 0)
        return NULL;
    if (get_buffer(out_obj, &out, 'l', 1, "out") < 0) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    if (out.len != ids.len) {
        PyBuffer_Release(&ids);
        PyBuffer_Release(&out);
        return PyErr_Format(PyExc_ValueError, "owner_shards: ids and out differ in size");
    }
    const int64_t *id = ids.buf;
    int64_t *o = out.buf;
    const i64 n = ids.len / 8;
    for (i64 k = 0; k < n; k++)
        o[k] = owner_of(&lay, splitmix64((u64)id[k]));
    PyBuffer_Release(&ids);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyObject *py_count(PyObject *self, PyObject *args)
{
    PyObject *feats, *counts_obj, *scratch_obj[2] = {NULL, NULL}, *result = NULL;
    i64 devices, shards, total_rows, max_unique = 0;
    Layout lay;
    Py_buffer counts = {0}, scratch[2] = {{0}};
    Py_ssize_t nf = 0;
    /* raw 64-bit ids: two int32 [>= number of ids] outputs, each entry's partition and number (fill_raw) */
    if (!PyArg_ParseTuple(args, "OLLLO|OO", &feats, &devices, &shards, &total_rows, &counts_obj, &scratch_obj[0],
                          &scratch_obj[1])
        || make_layout(&lay, devices, shards, total_rows) < 0)
        return NULL;
    Feature *fs = parse_features(feats, &nf, devices, total_rows);
    if (!fs)
        return NULL;
    if (get_buffer(counts_obj, &counts, 'l', 1, "counts") < 0)
        goto done;
    if (counts.len / 8 != devices * shards) {
        PyErr_SetString(PyExc_ValueError, "counts must be [devices * shards]");
        goto done;
    }
    i64 n = 1;
    for (Py_ssize_t i = 0; i < nf; i++)
        n += fs[i].n;
    const int raw = scratch_obj[1] != NULL;
    for (int j = 0; raw && j < 2; j++)
        if (get_buffer(scratch_obj[j], &scratch[j], 'i', 1, "scratch") < 0)
            goto done;
    if (raw && (scratch[0].len / 4 < n - 1 || scratch[1].len / 4 < n - 1)) {
        PyErr_SetString(PyExc_ValueError, "scratch must hold an int32 per id");
        goto done;
    }
    IdSet ids = {0};
    u64 *seen = raw ? NULL : calloc((size_t)(total_rows / 64 + 1), sizeof(u64));
    i64 *touched = raw ? NULL : malloc((size_t)n * sizeof(i64)), *unique = calloc((size_t)(devices * shards), sizeof(i64));
    int status = 0;
    if ((raw ? idset_init(&ids, n) == 0 : seen && touched) && unique) {
        memset(counts.buf, 0, (size_t)counts.len);
        Py_BEGIN_ALLOW_THREADS
        status = raw ? count_raw(fs, nf, &lay, &ids, counts.buf, unique, scratch[0].buf, scratch[1].buf)
                     : count_ids(fs, nf, &lay, seen, touched, counts.buf, unique);
        Py_END_ALLOW_THREADS
        for (i64 key = 0; key < devices * shards; key++)
            max_unique = unique[key] > max_unique ? unique[key] : max_unique;
        result = status < 0 ? ids_changed() : PyLong_FromLongLong(max_unique);
    } else {
        PyErr_NoMemory();
    }
    free(seen);
    free(touched);
    free(unique);
    idset_done(&ids);
done:
    PyBuffer_Release(&counts);
    PyBuffer_Release(&scratch[0]);
    PyBuffer_Release(&scratch[1]);
    release_features(fs, nf);
    return result;
}

static PyObject *py_fill(PyObject *self, PyObject *args)
{
    PyObject *feats, *out_obj[6] = {NULL}, *result = NULL;
    i64 devices, shards, total_rows, cap, rows_per_device;
    Layout lay;
    Py_buffer out[6] = {{0}};
    Py_ssize_t nf = 0;
    /* raw 64-bit ids: keys [devices * shards * cap, 2] int32, and count's two scratch arrays */
    if (!PyArg_ParseTuple(args, "OLLLLLOOO|OOO", &feats, &devices, &shards, &total_rows, &cap, &rows_per_device,
                          &out_obj[0], &out_obj[1], &out_obj[2], &out_obj[3], &out_obj[4], &out_obj[5])
        || make_layout(&lay, devices, shards, total_rows) < 0)
        return NULL;
    Feature *fs = parse_features(feats, &nf, devices, total_rows);
    if (!fs)
        return NULL;
    const int raw = out_obj[5] != NULL, n_out = raw ? 6 : 3;
    for (int j = 0; j < n_out; j++)
        if (get_buffer(out_obj[j], &out[j], j == 2 ? 'f' : 'i', 1, "outputs") < 0)
            goto done;
    if (cap < 0 || out[0].len / 4 != devices * shards * cap || out[1].len != out[0].len || out[2].len != out[0].len
        || (raw && out[3].len != 2 * out[0].len)) {
        PyErr_SetString(PyExc_ValueError, "outputs must be [devices * shards * cap] (keys: [..., 2])");
        goto done;
    }
    i64 n = 0;
    for (Py_ssize_t i = 0; i < nf; i++)
        n += fs[i].n;
    if (raw && (out[4].len / 4 < n || out[5].len / 4 < n)) {
        PyErr_SetString(PyExc_ValueError, "scratch must hold an int32 per id");
        goto done;
    }
    i64 *cursor = calloc((size_t)(2 * devices * shards), sizeof(i64)); /* raw: then `named` */
    float **dens = calloc((size_t)nf + 1, sizeof(float *));
    int ok = cursor && dens, status = 0;
    for (Py_ssize_t i = 0; ok && i < nf; i++)
        if (fs[i].combiner != 0)
            ok = (dens[i] = calloc((size_t)(fs[i].batch * rows_per_sample(&fs[i]) + 1), sizeof(float))) != NULL;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < nf; i++)
            if (dens[i])
                denominators(&fs[i], devices, dens[i]);
        status = raw ? fill_raw(fs, nf, &lay, dens, cap, rows_per_device, out[4].buf, out[5].buf, n, cursor,
                                cursor + devices * shards, out[0].buf, out[1].buf, out[2].buf, out[3].buf)
                     : fill_ids(fs, nf, &lay, dens, cap, rows_per_device, cursor, out[0].buf, out[1].buf, out[2].buf);
        Py_END_ALLOW_THREADS
        result = status < 0 ? ids_changed() : Py_NewRef(Py_None);
    } else {
        PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; dens && i < nf; i++)
        free(dens[i]);
    free(dens);
    free(cursor);
done:
    for (int j = 0; j < 6; j++)
        PyBuffer_Release(&out[j]);
    release_features(fs, nf);
    return result;
}

/* concat_rows(rows: list, formats: str) -> (format, data: bytes, lengths: bytes of int64) | None.
   None unless every row is a C-contiguous 1-D buffer of one format, from `formats`. */
static PyObject *py_concat_rows(PyObject *self, PyObject *args)
{
    PyObject *list, *rows, *result = NULL, *data = NULL, *lengths = NULL;
    const char *formats;
    if (!PyArg_ParseTuple(args, "O!s", &PyList_Type, &list, &formats) || !(rows = PySequence_Tuple(list)))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(rows), got = 0, itemsize = 0, total = 0;
    Py_buffer *views = calloc((size_t)n + 1, sizeof(Py_buffer));
    char fmt = 0;
    if (!views) {
        Py_DECREF(rows);
        return PyErr_NoMemory();
    }
    for (; got < n; got++) {
        Py_buffer *v = &views[got];
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(rows, got), v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            PyErr_Clear();
            break;
        }
        char c = format_char(v);
        if (v->ndim != 1 || !c || !strchr(formats, c) || (got && (c != fmt || v->itemsize != itemsize))) {
            PyBuffer_Release(v);
            break;
        }
        fmt = c;
        itemsize = v->itemsize;
        total += v->len;
    }
    if (got < n) {
        result = Py_NewRef(Py_None);
    } else if ((data = PyBytes_FromStringAndSize(NULL, total)) && (lengths = PyBytes_FromStringAndSize(NULL, n * 8))) {
        char *dst = PyBytes_AS_STRING(data);
        int64_t *len = (int64_t *)PyBytes_AS_STRING(lengths);
        for (Py_ssize_t i = 0; i < n; dst += views[i].len, i++) {
            memcpy(dst, views[i].buf, (size_t)views[i].len);
            len[i] = views[i].shape[0];
        }
        result = Py_BuildValue("(COO)", fmt, data, lengths);
    }
    Py_XDECREF(data);
    Py_XDECREF(lengths);
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    free(views);
    Py_DECREF(rows);
    return result;
}

/* The checksum of sparse_embed.io.integrity: two uint32 sums over words w_i at positions i = start, start+1, ...
   of w_i * (i*K1 | 1) and (w_i ^ w_i >> 15) * ((i ^ K3)*K2 | 1), all mod 2^32. */
#define CHECKSUM_K1 0x9E3779B9u
#define CHECKSUM_K2 0x85EBCA77u
#define CHECKSUM_K3 0x165667B1u
#define CHECKSUM_LOOP(type, from)                                                                    \
    do {                                                                                             \
        const type *w = (const type *)buf;                                                           \
        for (Py_ssize_t i = (from); i < n; i++) {                                                    \
            uint32_t x = (uint32_t)w[i], p = (uint32_t)start + (uint32_t)i;                          \
            a += x * (p * CHECKSUM_K1 | 1u);                                                         \
            b += (x ^ (x >> 15)) * ((p ^ CHECKSUM_K3) * CHECKSUM_K2 | 1u);                           \
        }                                                                                            \
    } while (0)

static int checksum_avx2; /* whether the CPU has AVX2 (set when the module is imported: native_setup) */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
/* The same sums, 8 words at a time (AVX2; the same bits: integer arithmetic mod 2^32), over words 0..n8-1 of
   32-bit values (wide = 1) or 16-bit ones widened (wide = 0); n8 a multiple of 8. */
__attribute__((target("avx2"))) static void checksum_avx2_words(const void *buf, Py_ssize_t n8, int wide,
                                                                 uint32_t start, uint32_t *pa, uint32_t *pb)
{
    const __m256i k1 = _mm256_set1_epi32((int)CHECKSUM_K1), k2 = _mm256_set1_epi32((int)CHECKSUM_K2),
                  k3 = _mm256_set1_epi32((int)CHECKSUM_K3), one = _mm256_set1_epi32(1),
                  eight = _mm256_set1_epi32(8);
    __m256i p = _mm256_add_epi32(_mm256_set1_epi32((int)start), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i va = _mm256_setzero_si256(), vb = _mm256_setzero_si256();
    for (Py_ssize_t i = 0; i < n8; i += 8) {
        __m256i x = wide ? _mm256_loadu_si256((const __m256i *)((const uint32_t *)buf + i))
                         : _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)buf + i)));
        __m256i y = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
        va = _mm256_add_epi32(va, _mm256_mullo_epi32(x, _mm256_or_si256(_mm256_mullo_epi32(p, k1), one)));
        vb = _mm256_add_epi32(vb, _mm256_mullo_epi32(
                                      y, _mm256_or_si256(_mm256_mullo_epi32(_mm256_xor_si256(p, k3), k2), one)));
        p = _mm256_add_epi32(p, eight);
    }
    uint32_t la[8], lb[8];
    _mm256_storeu_si256((__m256i *)la, va);
    _mm256_storeu_si256((__m256i *)lb, vb);
    for (int j = 0; j < 8; j++) {
        *pa += la[j];
        *pb += lb[j];
    }
}
#endif

/* checksum(buffer, itemsize, start) -> (a, b): the checksum's two sums over a C-contiguous buffer of values of
   `itemsize` bytes (1- and 2-byte values widened to a word, 8-byte ones split into two), its first word at
   position `start`. Runs without the GIL; 8 words at a time where the CPU has AVX2. */
static PyObject *py_checksum(PyObject *self, PyObject *args)
{
    Py_buffer v;
    int itemsize;
    unsigned long long start;
    if (!PyArg_ParseTuple(args, "y*iK", &v, &itemsize, &start))
        return NULL;
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) {
        PyBuffer_Release(&v);
        return PyErr_Format(PyExc_ValueError, "checksum: itemsize must be 1, 2, 4 or 8, got %d", itemsize);
    }
    uint32_t a = 0, b = 0;
    const void *buf = v.buf;
    Py_ssize_t n = v.len / (itemsize == 8 ? 4 : itemsize), done = 0;
    Py_BEGIN_ALLOW_THREADS
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (checksum_avx2 && itemsize != 1) {
        done = n / 8 * 8;
        checksum_avx2_words(buf, done, itemsize != 2, (uint32_t)start, &a, &b);
    }
#endif
    if (itemsize == 1)
        CHECKSUM_LOOP(uint8_t, done);
    else if (itemsize == 2)
        CHECKSUM_LOOP(uint16_t, done);
    else
        CHECKSUM_LOOP(uint32_t, done);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    return Py_BuildValue("(kk)", (unsigned long)a, (unsigned long)b);
}

/* ------------------------------------------------------------------ CRC32C (the checkpoint store's chunks) */
/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF): the checksum
   that zarr3's `crc32c` codec appends to every chunk of the table store (sparse_embed/io/store.py). With SSE4.2
   (checked at run time) the CPU's crc32 instruction, three streams of 8 bytes at a time; else slicing-by-8
   tables. */
static uint32_t crc32c_tables[8][256];
static int crc32c_hw_ok; /* whether the CPU has SSE4.2's crc32 (set, with the tables, by native_setup) */

/* The register form (no initial or final xor) over n bytes. */
static uint32_t crc32c_sw(uint32_t c, const unsigned char *p, size_t n)
{
    while (n && ((uintptr_t)p & 7u)) {
        c = crc32c_tables[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
        n--;
    }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        v ^= c; /* the low 4 bytes (the first 4, little-endian) take the register */
        c = crc32c_tables[7][v & 0xFFu] ^ crc32c_tables[6][(v >> 8) & 0xFFu] ^ crc32c_tables[5][(v >> 16) & 0xFFu] ^
            crc32c_tables[4][(v >> 24) & 0xFFu] ^ crc32c_tables[3][(v >> 32) & 0xFFu] ^
            crc32c_tables[2][(v >> 40) & 0xFFu] ^ crc32c_tables[1][(v >> 48) & 0xFFu] ^ crc32c_tables[0][v >> 56];
        p += 8;
        n -= 8;
    }
#endif
    while (n--)
        c = crc32c_tables[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
    return c;
}

/* (a * b) mod P over GF(2), both reflected (bit 31: x^0): zlib's multmodp, for the Castagnoli polynomial. */
static uint32_t crc32c_multmodp(uint32_t a, uint32_t b)
{
    uint32_t m = (uint32_t)1 << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0)
                break;
        }
        m >>= 1;
        b = (b & 1u) ? (b >> 1) ^ 0x82F63B78u : b >> 1;
    }
    return p;
}

static uint32_t crc32c_x2n[32]; /* x^(2^k) mod P */

/* x^(8 n) mod P: what a register form CRC is multiplied by to move it past n more bytes of zeros. */
static uint32_t crc32c_x8n(size_t n)
{
    uint32_t p = (uint32_t)1 << 31; /* x^0 */
    for (int k = 3; n; n >>= 1, k++)
        if (n & 1)
            p = crc32c_multmodp(crc32c_x2n[k & 31], p);
    return p;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
/* The crc32 instruction has a latency of 3 cycles and a throughput of 1: three streams over three thirds of the
   buffer keep it busy, and crc(A B) = crc(A) * x^(8 |B|) ^ crc(B) (register form, B's from 0) joins them. */
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t c, const unsigned char *p, size_t n)
{
    while (n && ((uintptr_t)p & 7u)) {
        c = _mm_crc32_u8(c, *p++);
        n--;
    }
    if (n >= 3 * 256) {
        const size_t third = n / 3 / 8 * 8;
        uint64_t c0 = c, c1 = 0, c2 = 0;
        const unsigned char *q = p + third, *r = p + 2 * third;
        for (size_t i = 0; i < third; i += 8) {
            uint64_t v0, v1, v2;
            memcpy(&v0, p + i, 8);
            memcpy(&v1, q + i, 8);
            memcpy(&v2, r + i, 8);
            c0 = _mm_crc32_u64(c0, v0);
            c1 = _mm_crc32_u64(c1, v1);
            c2 = _mm_crc32_u64(c2, v2);
        }
        const uint32_t shift = crc32c_x8n(third);
        c = crc32c_multmodp(shift, crc32c_multmodp(shift, (uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
        p += 3 * third;
        n -= 3 * third;
    }
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c64 = _mm_crc32_u64(c64, v);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--)
        c = _mm_crc32_u8(c, *p++);
    return c;
}
#endif

/* The CRC tables and the CPU's features: once, when the module is imported. */
static void native_setup(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc32c_tables[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc32c_tables[t][i] = (crc32c_tables[t - 1][i] >> 8) ^ crc32c_tables[0][crc32c_tables[t - 1][i] & 0xFFu];
    crc32c_x2n[0] = (uint32_t)1 << 30; /* x^1 */
    for (int k = 1; k < 32; k++)
        crc32c_x2n[k] = crc32c_multmodp(crc32c_x2n[k - 1], crc32c_x2n[k - 1]);
    /* $SPARSE_EMBED_NATIVE_ISA=baseline (as for the C++ kernel): the portable loops, e.g. to test them */
    const char *isa = getenv("SPARSE_EMBED_NATIVE_ISA");
    int baseline = isa && strcmp(isa, "baseline") == 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    crc32c_hw_ok = !baseline && __builtin_cpu_supports("sse4.2");
    checksum_avx2 = !baseline && __builtin_cpu_supports("avx2");
#else
    (void)baseline;
    crc32c_hw_ok = 0;
#endif
}

/* crc32c(buffer, crc=0) -> the CRC-32C of the buffer's bytes, continuing `crc` (the value of the bytes before
   them, as zlib.crc32 chains). Runs without the GIL. */
static PyObject *py_crc32c(PyObject *self, PyObject *args)
{
    Py_buffer v;
    unsigned long crc = 0;
    if (!PyArg_ParseTuple(args, "y*|k", &v, &crc))
        return NULL;
    uint32_t c = ~(uint32_t)crc;
    const unsigned char *p = (const unsigned char *)v.buf;
    size_t n = (size_t)v.len;
    Py_BEGIN_ALLOW_THREADS
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (crc32c_hw_ok)
        c = crc32c_hw(c, p, n);
    else
#endif
        c = crc32c_sw(c, p, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLong((unsigned long)~c);
}

/* ------------------------------------------------------------------ SparseCore CSR (host/csr.py from_coo) */
typedef struct {
    uint32_t eid, sid; /* embedding_id, sample_id */
    float gain;
} CsrEntry;

/* Stable LSD radix sort of x[0..n) by eid (< 2^bits), 8 bits a pass, through `aux` [n]. Returns the sorted copy. */
static CsrEntry *csr_sort(CsrEntry *x, CsrEntry *aux, i64 n, int bits)
{
    i64 count[257];
    for (int shift = 0; shift < bits; shift += 8) {
        memset(count, 0, sizeof(count));
        for (i64 i = 0; i < n; i++)
            count[((x[i].eid >> shift) & 255) + 1]++;
        for (int d = 0; d < 256; d++)
            count[d + 1] += count[d];
        for (i64 i = 0; i < n; i++)
            aux[count[(x[i].eid >> shift) & 255]++] = x[i];
        CsrEntry *t = x;
        x = aux;
        aux = t;
    }
    return x;
}

/* Entries of one device per (slice, partition) bucket, before merging duplicates, into count [S * N]. */
static void csr_count(const int32_t *cols, const int32_t *rows, const int32_t *ends, i64 G, i64 S, i64 N, i64 R,
                      i64 b, i64 cap, i64 *count)
{
    memset(count, 0, (size_t)(S * N) * sizeof(i64));
    for (i64 e = 0; e < G; e++)
        for (i64 k = e * cap; k < ends[e]; k++)
            count[rows[k] / b * N + e * S + cols[k] / R]++;
}

/* One device's CSR slices from its COO rows (see csr.py `from_coo`): entries bucketed by (slice, partition) in COO
   order, sorted stably by embedding_id, so by (embedding_id, sample_id): a bucket comes from one segment, whose
   entries are by feature then sample, and a slice holds the features' samples in that order. Duplicates merged
   (gains summed in float32, in COO order, as jax-tpu-embedding does). `count` holds its buckets, counted by the
   caller. */
static void csr_device(const int32_t *cols, const int32_t *rows, const float *vals, const int32_t *ends, i64 G,
                       i64 S, i64 N, i64 R, i64 b, i64 cap, i64 limit, const i64 *count, i64 *offset, CsrEntry *tmp,
                       CsrEntry *aux, int32_t *rp, int32_t *eid, int32_t *sid, float *gain)
{
    const i64 rp_len = N > 8 ? N : 8, per_slice = (limit + 7) / 8 * 8 * N;
    int bits = 0;
    while (bits < 32 && (R - 1) >> bits)
        bits += 8;
    for (i64 i = 0, o = 0; i < S * N; o += count[i++])
        offset[i] = o;
    for (i64 e = 0; e < G; e++)
        for (i64 k = e * cap; k < ends[e]; k++) {
            CsrEntry *x = &tmp[offset[rows[k] / b * N + e * S + cols[k] / R]++];
            x->eid = (uint32_t)(cols[k] % R);
            x->sid = (uint32_t)(rows[k] % b);
            x->gain = vals[k];
        }
    for (i64 s = 0; s < S; s++) {
        i64 start = 0, base = s * per_slice;
        for (i64 p = 0; p < N; p++) {
            i64 n = count[s * N + p], end = start, first = offset[s * N + p] - n;
            CsrEntry *x = csr_sort(tmp + first, aux + first, n, bits);
            for (i64 i = 0; i < n;) {
                float g = 0.0f;
                i64 j = i;
                for (; j < n && x[j].eid == x[i].eid && x[j].sid == x[i].sid; j++)
                    g += x[j].gain;
                eid[base + end] = (int32_t)x[i].eid;
                sid[base + end] = (int32_t)x[i].sid;
                gain[base + end++] = g;
                i = j;
            }
            rp[s * rp_len + p] = (int32_t)end;
            start = (end + 7) / 8 * 8;
        }
        for (i64 p = N; p < rp_len; p++)
            rp[s * rp_len + p] = (int32_t)start;
    }
}

/* csr(cols, rows, vals, ends, sparsecores, partitions, shard_rows, slice_rows, cap, limit, rp, eid, sid, gain)
   -> the most entries in a (slice, partition) bucket before merging duplicates. A SparseCore stack's CSR from its
   COO batch of D devices (cols/rows/vals [D, G * cap], ends [D, G]), written into outputs [D * S * max(N, 8)] and
   [D * S * round_up(limit, 8) * N] that hold the padding (PAD / NaN) already, unless a bucket has more than
   `limit` entries (then nothing is written; limit 0 only counts). */
static PyObject *py_csr(PyObject *self, PyObject *args)
{
    PyObject *obj[8];
    Py_buffer v[8] = {{0}};
    i64 S, N, R, b, cap, limit;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "OOOOLLLLLLOOOO", &obj[0], &obj[1], &obj[2], &obj[3], &S, &N, &R, &b, &cap, &limit,
                          &obj[4], &obj[5], &obj[6], &obj[7]))
        return NULL;
    static const char kinds[8] = {'i', 'i', 'f', 'i', 'i', 'i', 'i', 'f'};
    for (int j = 0; j < 8; j++)
        if (get_buffer(obj[j], &v[j], kinds[j], j >= 4, j < 4 ? "coo" : "csr outputs") < 0)
            goto done;
    i64 n = v[0].len / 4, G = N / (S > 0 ? S : 1), D = v[3].len / 4 / (G > 0 ? G : 1);
    i64 rp_len = N > 8 ? N : 8, per_slice = (limit + 7) / 8 * 8 * N;
    if (S <= 0 || N % S || R <= 0 || b <= 0 || cap <= 0 || limit < 0 || n != D * G * cap || v[1].len != v[0].len
        || v[2].len != v[0].len || (limit && (v[4].len / 4 != D * S * rp_len || v[5].len / 4 != D * S * per_slice
                                              || v[6].len != v[5].len || v[7].len != v[5].len))) {
        PyErr_SetString(PyExc_ValueError, "csr: arrays do not fit the sizes");
        goto done;
    }
    /* count [D * S * N]: every device's buckets (counted once, used to check and to fill); then offsets [S * N] */
    i64 *count = malloc((size_t)((D + 1) * S * N) * sizeof(i64)), most = 0;
    CsrEntry *tmp = malloc((size_t)(2 * G * cap + 1) * sizeof(CsrEntry));
    if (count && tmp) {
        Py_BEGIN_ALLOW_THREADS
        for (i64 d = 0; d < D; d++) {
            csr_count((int32_t *)v[0].buf + d * G * cap, (int32_t *)v[1].buf + d * G * cap, (int32_t *)v[3].buf + d * G,
                      G, S, N, R, b, cap, count + d * S * N);
            for (i64 i = d * S * N; i < (d + 1) * S * N; i++)
                most = count[i] > most ? count[i] : most;
        }
        for (i64 d = 0; limit > 0 && most <= limit && d < D; d++)
            csr_device((int32_t *)v[0].buf + d * G * cap, (int32_t *)v[1].buf + d * G * cap,
                       (float *)v[2].buf + d * G * cap, (int32_t *)v[3].buf + d * G, G, S, N, R, b, cap, limit,
                       count + d * S * N, count + D * S * N, tmp, tmp + G * cap, (int32_t *)v[4].buf + d * S * rp_len, (int32_t *)v[5].buf + d * S * per_slice,
                       (int32_t *)v[6].buf + d * S * per_slice, (float *)v[7].buf + d * S * per_slice);
        Py_END_ALLOW_THREADS
        result = PyLong_FromLongLong(most);
    } else {
        PyErr_NoMemory();
    }
    free(count);
    free(tmp);
done:
    for (int j = 0; j < 8; j++)
        PyBuffer_Release(&v[j]);
    return result;
}

/* ------------------------------------------------------------------ Criteo click logs */

static signed char HEX_DIGIT[256]; /* a hex digit's value, -1 for any other byte (hex_setup) */

static void hex_setup(void)
{
    for (int c = 0; c < 256; c++)
        HEX_DIGIT[c] = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                     : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* One line of a Criteo log from p: a label 0/1, 13 decimal integers (optional '-', |x| < 2**63) and 26 hex values
   (1-16 digits, < 2**63, not `missing`), tab-separated, any of the 39 features empty (an integer: 0; a hex value:
   `missing`); the same grammar as host/criteo.py's numpy path. Returns the line's end (its newline, or `end`);
   *ok = 1 if it is well-formed (then its fields are written). One pass: no field loop reads past a newline. */
static const unsigned char *criteo_line(const unsigned char *p, const unsigned char *end, float *label,
                                        int64_t *ints, int64_t *cats, int64_t missing, int *ok)
{
    *ok = 0;
    if (end - p < 2 || (p[0] != '0' && p[0] != '1') || p[1] != '\t')
        goto skip;
    *label = (float)(p[0] - '0');
    p += 2;
    for (int f = 0; f < 13; f++) {
        const int neg = p < end && *p == '-';
        int digits = 0;
        u64 v = 0;
        for (p += neg; p < end && (unsigned)(*p - '0') <= 9; p++, digits++) {
            if (v > ((u64)INT64_MAX - (u64)(*p - '0')) / 10)
                goto skip;
            v = v * 10 + (u64)(*p - '0');
        }
        if (p == end || *p != '\t' || (neg && !digits))
            goto skip;
        ints[f] = neg ? -(int64_t)v : (int64_t)v;
        p++;
    }
    for (int f = 0; f < 26; f++) {
        int digits = 0, d;
        u64 v = 0;
        for (; p < end && (d = HEX_DIGIT[*p]) >= 0; p++) {
            if (digits++ == 16)
                goto skip;
            v = (v << 4) | (u64)d;
        }
        if (v > (u64)INT64_MAX || (digits && v == (u64)missing) ||
            (f < 25 ? p == end || *p != '\t' : p < end && *p != '\n'))
            goto skip; /* (a value equal to `missing` would read as missing) */
        cats[f] = digits ? (int64_t)v : missing;
        p += f < 25;
    }
    *ok = 1;
    return p;
skip: {
        const unsigned char *nl = memchr(p, '\n', (size_t)(end - p));
        return nl ? nl : end;
    }
}

/* criteo_parse(data, missing, table float32 [T], labels float32 [n], ints int64 [n * 13], dense float32 [n * 13],
                cats int64 [n * 26], bad int64 [n]) -> (good lines, bad lines, integers >= T)
   Each well-formed line's fields in order, its integers also as dense = table[max(x, 0)] where x < T (the caller's
   log1p table: numpy's own values; larger x are the caller's to fill); each malformed line's index in `bad`.
   n >= the number of lines (a last line without a newline counts). */
static PyObject *py_criteo_parse(PyObject *self, PyObject *args)
{
    PyObject *objs[7];
    i64 missing;
    Py_buffer v[7] = {{0}};
    const char kinds[7] = {0, 'f', 'f', 'l', 'f', 'l', 'l'};
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "OLOOOOOO", &objs[0], &missing, &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &objs[6]))
        return NULL;
    if (PyObject_GetBuffer(objs[0], &v[0], PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    for (int j = 1; j < 7; j++)
        if (get_buffer(objs[j], &v[j], kinds[j], j > 1, "criteo_parse's arrays") < 0)
            goto done;
    const unsigned char *p = v[0].buf, *end = p + v[0].len;
    const i64 table_size = v[1].len / 4, cap = v[2].len / 4;
    if (v[3].len / 8 < cap * 13 || v[4].len / 4 < cap * 13 || v[5].len / 8 < cap * 26 || v[6].len / 8 < cap) {
        PyErr_SetString(PyExc_ValueError, "criteo_parse: the outputs are smaller than labels' n lines");
        goto done;
    }
    const float *table = v[1].buf;
    float *labels = v[2].buf, *dense = v[4].buf;
    int64_t *ints = v[3].buf, *cats = v[5].buf, *bad = v[6].buf;
    i64 good = 0, nbad = 0, line = 0, large = 0, overflow = 0;
    Py_BEGIN_ALLOW_THREADS
    while (p < end) {
        int ok;
        if (good + nbad >= cap) {
            overflow = 1;
            break;
        }
        const unsigned char *stop = criteo_line(p, end, labels + good, ints + good * 13, cats + good * 26,
                                                missing, &ok);
        if (ok) {
            for (int f = 0; f < 13; f++) {
                const int64_t x = ints[good * 13 + f] < 0 ? 0 : ints[good * 13 + f];
                large += x >= table_size;
                dense[good * 13 + f] = x < table_size ? table[x] : 0.0f;
            }
            good++;
        } else {
            bad[nbad++] = line;
        }
        line++;
        p = stop < end ? stop + 1 : end;
    }
    Py_END_ALLOW_THREADS
    if (overflow)
        PyErr_SetString(PyExc_ValueError, "criteo_parse: more lines than the outputs hold");
    else
        result = Py_BuildValue("LLL", good, nbad, large);
done:
    for (int j = 0; j < 7; j++)
        if (v[j].obj)
            PyBuffer_Release(&v[j]);
    return result;
}

static PyMethodDef methods[] = {
    {"validate", py_validate, METH_VARARGS,
     "validate(ids, weights|None, vocab, padding) -> (first bad id index, first non-finite weight index), -1 = none"},
    {"owner_shards", py_owner_shards, METH_VARARGS,
     "owner_shards(ids int64 [n], shards, out int64 [n]): splitmix64(id) % shards, as raw ids are partitioned"},
    {"count", py_count, METH_VARARGS,
     "count(features, devices, shards, total_rows, counts_out int64 [D*S]) -> max unique rows in a partition"},
    {"fill", py_fill, METH_VARARGS,
     "fill(features, devices, shards, total_rows, cap, rows_per_device, cols, rows, vals): the padded COO buffers"},
    {"concat_rows", py_concat_rows, METH_VARARGS,
     "concat_rows(rows, formats) -> (format, data, int64 lengths) as bytes, or None if a row does not fit"},
    {"csr", py_csr, METH_VARARGS,
     "csr(cols, rows, vals, ends, S, N, R, slice_rows, cap, limit, rp, eid, sid, gain) -> most entries in a partition"},
    {"checksum", py_checksum, METH_VARARGS,
     "checksum(buffer, itemsize, start) -> (a, b): sparse_embed.io.integrity's two sums, first word at start"},
    {"criteo_parse", py_criteo_parse, METH_VARARGS,
     "criteo_parse(data, missing, table, labels, ints, dense, cats, bad) -> (good, bad, large): Criteo log lines"},
    {"crc32c", py_crc32c, METH_VARARGS,
     "crc32c(buffer, crc=0) -> the CRC-32C of the buffer's bytes, continuing crc (zarr3's crc32c codec)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_native",
    .m_doc = "C kernels of sparse_embed.preprocess and of checkpoints' checksums and CRC-32C (see _native.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    native_setup();
    hex_setup();
    return PyModule_Create(&module);
}
