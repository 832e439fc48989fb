/* Fused CPU reductions of float32 gradients, for lightning_gradhooks.stats.
 *
 * torch needs about eight passes over a gradient for its statistics and histogram (minimum and
 * maximum, sum, row norms, non-zeros; shift, scale, convert, count), and a copy into a batch
 * for small ones. Here one call takes a list of tensors, with the GIL released, and reads each
 * twice: once for its moments, once for its histogram. The histogram bin of an element is
 * computed as the torch path computes it, in float32, so both paths give the same counts.
 *
 * One thread. On the 2-vCPU machine of docs/benchmarks.md a second thread gained nothing (the
 * two vCPUs share a core), and right after a torch op torch's OpenMP workers spin for a while:
 * on the encoder of benchmarks/many_modules.py two threads made a 2 M-element gradient's moments
 * take 1.2 ms instead of 0.6.
 *
 * reduce_many takes the addresses of dense float32 tensors (Tensor.data_ptr()); stats.py checks
 * dtype and layout before it calls it. Built by setup.py as an optional extension: where it
 * cannot be built, stats.py reduces with torch ops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Elements binned at a time. */
#define BLOCK 1024
/* Elements summed in float32 (8 or 16 to a SIMD lane) before the partial sums move to float64. */
#define SUMS 128
/* Elements counted into int32 tables before they are folded into int64: no overflow. */
#define CHUNK ((int64_t)1 << 28)
/* Up to this many bins, neighbours are counted by pairs in a PAIRS x PAIRS table. */
#define PAIRS 64
/* ... for tensors of at least this many elements (the table is cleared for each). */
#define PAIRS_FROM 65536

/* Builds for AVX2 and for the baseline, chosen at load time, where the toolchain can. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

typedef struct {
    const float *x;
    int64_t n;
    float centre;                   /* sum and squares are of x - centre */
    double low, high, sum, squares;
    int64_t zeros;
    /* 1 where an element is NaN or Inf (then nothing else is meaningful), read from the sums:
     * NaN and Inf carry through them, so no pass of its own. A square beyond float32's range
     * (|x| > 1.8e19) sets it too; the caller then takes the masked path, which tells. */
    int nonfinite;
} Moments;

VECTOR_CLONES static void moments_of(Moments *m) {
    const float *x = m->x, centre = m->centre;
    double low = INFINITY, high = -INFINITY, sum = 0.0, squares = 0.0;
    int64_t zeros = 0;
    for (int64_t b = 0; b < m->n; b += SUMS) {
        int64_t e = b + SUMS < m->n ? b + SUMS : m->n;
        float mn = INFINITY, mx = -INFINITY, s = 0.0f, q = 0.0f;
        int32_t z = 0;
#pragma omp simd reduction(min : mn) reduction(max : mx) reduction(+ : s, q, z)
        for (int64_t i = b; i < e; i++) {
            float v = x[i], c = v - centre;
            mn = v < mn ? v : mn;
            mx = v > mx ? v : mx;
            s += c;
            q += c * c;
            z += v == 0.0f;
        }
        low = mn < low ? mn : low;
        high = mx > high ? mx : high;
        sum += s;
        squares += q;
        zeros += z;
    }
    m->low = low;
    m->high = high;
    m->sum = sum;
    m->squares = squares;
    m->zeros = zeros;
    m->nonfinite = !(isfinite(sum) && isfinite(squares));
}

/* Bins of x[0..m) into index[0..m): ((x - low) * step) * scale in float32, as torch computes
 * it (step only where it is not 1), truncated. The caller's scale keeps finite x >= low below
 * bins; the index is clamped to bins - 1 all the same (unsigned: NaN's INT_MIN too), so that no
 * input can count outside the tables. */
VECTOR_CLONES static void bins_of(const float *x, int64_t m, float low, float step, float scale, int32_t bins,
                                  int32_t *index) {
    const uint32_t last = (uint32_t)(bins - 1);
    if (step != 1.0f) {
#pragma omp simd
        for (int64_t i = 0; i < m; i++) {
            uint32_t k = (uint32_t)(int32_t)(((x[i] - low) * step) * scale);
            index[i] = (int32_t)(k < last ? k : last);
        }
    } else {
#pragma omp simd
        for (int64_t i = 0; i < m; i++) {
            uint32_t k = (uint32_t)(int32_t)((x[i] - low) * scale);
            index[i] = (int32_t)(k < last ? k : last);
        }
    }
}

/* Counting tables, allocated once per call: int32 counters, folded into int64 every CHUNK. */
typedef struct {
    int32_t *table;
    int64_t *total;
} Tables;

/* Room for the pairs tables or for four tables of `bins`, whichever histogram_of needs. */
static int tables_alloc(Tables *t, int32_t bins) {
    const int64_t size = 4 * (int64_t)bins > 2 * PAIRS * PAIRS ? 4 * (int64_t)bins : 2 * PAIRS * PAIRS;
    t->table = malloc(size * sizeof(int32_t));
    t->total = malloc(size * sizeof(int64_t));
    return t->table != NULL && t->total != NULL;
}

static void tables_free(Tables *t) {
    free(t->table);
    free(t->total);
}

/* Counts of x[0..n) into out[0..bins), as float64. Counting is the slow part: a run of one bin
 * (ReLU zeros) makes each counter update wait on the one before, so updates go to several
 * tables in turn. For a big tensor and up to PAIRS bins, a pair of neighbours is one update of
 * a PAIRS x PAIRS table (half the updates); otherwise elements go to four tables of `bins`. */
static void histogram_of(const float *x, int64_t n, float low, float step, float scale, int32_t bins, Tables *t,
                         double *out) {
    const int pairs = bins <= PAIRS && n >= PAIRS_FROM;
    const int64_t size = pairs ? 2 * PAIRS * PAIRS : 4 * (int64_t)bins;
    int64_t single[PAIRS] = {0};
    int32_t index[BLOCK];
    memset(t->total, 0, size * sizeof(int64_t));
    for (int64_t c = 0; c < n; c += CHUNK) {
        int64_t end = c + CHUNK < n ? c + CHUNK : n;
        memset(t->table, 0, size * sizeof(int32_t));
        for (int64_t b = c; b < end; b += BLOCK) {
            int64_t m = (b + BLOCK < end ? b + BLOCK : end) - b, i = 0;
            int32_t *table = t->table;
            bins_of(x + b, m, low, step, scale, bins, index);
            if (pairs) {
                for (; i + 4 <= m; i += 4) {
                    table[index[i] * PAIRS + index[i + 1]]++;
                    table[PAIRS * PAIRS + index[i + 2] * PAIRS + index[i + 3]]++;
                }
                for (; i < m; i++) single[index[i]]++; /* at most 3 of a block */
            } else {
                for (; i + 4 <= m; i += 4) {
                    table[index[i]]++;
                    table[bins + index[i + 1]]++;
                    table[2 * bins + index[i + 2]]++;
                    table[3 * bins + index[i + 3]]++;
                }
                for (; i < m; i++) table[index[i]]++;
            }
        }
        for (int64_t k = 0; k < size; k++) t->total[k] += t->table[k];
    }
    for (int32_t r = 0; r < bins; r++) {
        int64_t sum = 0;
        if (pairs) {
            sum = single[r];
            for (int32_t k = 0; k < bins; k++)
                for (int64_t u = 0; u < 2 * PAIRS * PAIRS; u += PAIRS * PAIRS)
                    sum += t->total[u + r * PAIRS + k] + t->total[u + k * PAIRS + r];
        } else {
            for (int32_t u = 0; u < 4; u++) sum += t->total[u * bins + r];
        }
        out[r] = (double)sum;
    }
}

/* reduce_many(addresses, lengths, bins, moments_out, counts_out): the stats.MOMENTS of each of
 * k dense float32 tensors into the k x 7 float64 at moments_out, and where bins > 0 their
 * histograms into the k x bins float64 at counts_out: one pass each, two with a histogram. The
 * sums are centred on the tensor's first element, or on its mean (a second pass) where that
 * lies far out. Returns how many tensors hold NaN or Inf (or overflow a square); their rows are
 * not written. */
static PyObject *reduce_many(PyObject *self, PyObject *args) {
    PyObject *addresses, *lengths;
    unsigned long long moments_out, counts_out;
    int bins;
    Py_ssize_t k;
    Tables t = {0};
    int64_t nonfinite = 0;
    if (!PyArg_ParseTuple(args, "O!O!iKK", &PyList_Type, &addresses, &PyList_Type, &lengths, &bins, &moments_out,
                          &counts_out))
        return NULL;
    k = PyList_GET_SIZE(addresses);
    if (PyList_GET_SIZE(lengths) != k)
        return PyErr_Format(PyExc_ValueError, "%zd addresses but %zd lengths", k, PyList_GET_SIZE(lengths));
    if (bins < 0) return PyErr_Format(PyExc_ValueError, "bins must be 0 (none) or positive, got %d", bins);
    const float **xs = malloc((k + 1) * sizeof(float *));
    int64_t *ns = malloc((k + 1) * sizeof(int64_t));
    if (xs == NULL || ns == NULL || (bins > 0 && !tables_alloc(&t, bins))) {
        free(xs);
        free(ns);
        tables_free(&t);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        xs[j] = (const float *)(uintptr_t)PyLong_AsUnsignedLongLong(PyList_GET_ITEM(addresses, j));
        ns[j] = PyLong_AsLongLong(PyList_GET_ITEM(lengths, j));
    }
    if (PyErr_Occurred()) {
        free(xs);
        free(ns);
        tables_free(&t);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS;
    double *rows = (double *)(uintptr_t)moments_out;
    for (Py_ssize_t j = 0; j < k; j++) {
        Moments m = {.x = xs[j], .n = ns[j], .centre = ns[j] ? xs[j][0] : 0.0f};
        double *row = rows + 7 * j;
        moments_of(&m);
        if (m.nonfinite) {
            nonfinite++;
            continue;
        }
        if (m.squares > 0 && m.squares - m.sum * m.sum / m.n <= 0.1 * m.squares) {
            /* the first element lies far from the mean, against the spread: centre on the mean */
            m.centre = (float)(m.centre + m.sum / m.n);
            moments_of(&m);
        }
        row[0] = (double)m.n;
        row[1] = m.n ? (double)m.centre + m.sum / (double)m.n : 0.0;
        row[2] = m.squares;
        row[3] = m.sum;
        row[4] = m.low;
        row[5] = m.high;
        row[6] = (double)m.zeros;
        if (bins > 0) {
            /* stats._bin_scale, in float64, then float32 */
            double span = m.high - m.low, scale = span > 0.0 ? bins * (1 - 1e-6) / span : 0.0;
            double step = scale > FLT_MAX / 18446744073709551616.0 ? 18446744073709551616.0 : 1.0;
            histogram_of(m.x, m.n, (float)m.low, (float)step, (float)(scale / step), bins, &t,
                         (double *)(uintptr_t)counts_out + (int64_t)bins * j);
        }
    }
    Py_END_ALLOW_THREADS;
    free(xs);
    free(ns);
    tables_free(&t);
    return PyLong_FromLongLong(nonfinite);
}

static PyMethodDef methods[] = {
    {"reduce_many", reduce_many, METH_VARARGS,
     "reduce_many(addresses, lengths, bins, moments_out, counts_out) -> count of tensors holding NaN/Inf: the "
     "moments (k x 7 float64 at moments_out) and histograms (k x bins float64 at counts_out, if bins) of k "
     "float32 tensors."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "Fused CPU reductions (see _kernels.c).", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
