/* Fused CPU reductions of one big float32 gradient, for lightning_gradhooks.stats.
 *
 * torch needs about eight passes over a gradient for its statistics and histogram (minimum and
 * maximum, sum, row norms, non-zeros; shift, scale, convert, count). Here it is two: one for
 * the moments and one for the histogram, each split over a few threads, with the GIL released.
 * The histogram bin of an element is computed exactly as the torch path computes it, in
 * float32, so both paths give the same counts.
 *
 * The functions take the address of contiguous float32 data (Tensor.data_ptr()); the Python
 * side (stats.py) checks dtype, layout and sizes before it calls them. Built by setup.py as an
 * optional extension: where it cannot be built, stats.py reduces with torch ops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Elements summed in float32 before the partial sums move to float64. */
#define BLOCK 1024
/* Elements counted into int32 tables before they are folded into int64: no overflow. */
#define CHUNK ((int64_t)1 << 28)
/* Up to this many bins, neighbours are counted by pairs in a PAIRS x PAIRS table. */
#define PAIRS 64
#define MAX_THREADS 64

/* Builds for AVX2 and for the baseline, chosen at load time, where the toolchain can. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

typedef struct {
    const float *x;
    int64_t n;
    double low, high, sum, squares;
    int64_t zeros, nonfinite;
} Moments;

VECTOR_CLONES static void moments_of(Moments *m) {
    const float *x = m->x;
    double low = INFINITY, high = -INFINITY, sum = 0.0, squares = 0.0;
    int64_t zeros = 0, nonfinite = 0;
    for (int64_t b = 0; b < m->n; b += BLOCK) {
        int64_t e = b + BLOCK < m->n ? b + BLOCK : m->n;
        float mn = INFINITY, mx = -INFINITY, s = 0.0f, q = 0.0f;
        int32_t z = 0, bad = 0;
#pragma omp simd reduction(min : mn) reduction(max : mx) reduction(+ : s, q, z, bad)
        for (int64_t i = b; i < e; i++) {
            float v = x[i];
            mn = v < mn ? v : mn;
            mx = v > mx ? v : mx;
            s += v;
            q += v * v;
            z += v == 0.0f;
            bad += !(v - v == 0.0f); /* NaN and +-Inf */
        }
        low = mn < low ? mn : low;
        high = mx > high ? mx : high;
        sum += s;
        squares += q;
        zeros += z;
        nonfinite += bad;
    }
    m->low = low;
    m->high = high;
    m->sum = sum;
    m->squares = squares;
    m->zeros = zeros;
    m->nonfinite = nonfinite;
}

typedef struct {
    const float *x;
    int64_t n;
    float low, step, scale;
    int32_t bins;
    int64_t *counts; /* bins entries, zeroed by the caller */
    int failed;
} Histogram;

/* Bins of x[0..m) into index[0..m): ((x - low) * step) * scale in float32, as torch computes
 * it (step only where it is not 1), truncated and clamped to [0, bins); NaN lands in bin 0. */
VECTOR_CLONES static void bins_of(const float *x, int64_t m, float low, float step, float scale, int32_t bins,
                                  int32_t *index) {
    const float top = (float)bins, last = (float)(bins - 1);
    if (step != 1.0f) {
#pragma omp simd
        for (int64_t i = 0; i < m; i++) {
            float f = ((x[i] - low) * step) * scale;
            index[i] = (int32_t)(f >= 0.0f ? (f < top ? f : last) : 0.0f);
        }
    } else {
#pragma omp simd
        for (int64_t i = 0; i < m; i++) {
            float f = (x[i] - low) * scale;
            index[i] = (int32_t)(f >= 0.0f ? (f < top ? f : last) : 0.0f);
        }
    }
}

/* Counting is the slow part: a run of one bin (ReLU zeros) makes each counter update wait on
 * the one before. Up to PAIRS bins, a pair of neighbours is one update of a PAIRS x PAIRS
 * table, and pairs go to two tables in turn; above, elements go to four tables in turn. */
static void histogram_of(Histogram *h) {
    const int pairs = h->bins <= PAIRS;
    const int64_t size = pairs ? 2 * PAIRS * PAIRS : 4 * (int64_t)h->bins;
    int32_t *table = malloc(size * sizeof(int32_t));
    int64_t *total = calloc(size, sizeof(int64_t));
    int32_t index[BLOCK];
    if (table == NULL || total == NULL) {
        free(table);
        free(total);
        h->failed = 1;
        return;
    }
    for (int64_t c = 0; c < h->n; c += CHUNK) {
        int64_t end = c + CHUNK < h->n ? c + CHUNK : h->n;
        memset(table, 0, size * sizeof(int32_t));
        for (int64_t b = c; b < end; b += BLOCK) {
            int64_t m = (b + BLOCK < end ? b + BLOCK : end) - b, i = 0;
            bins_of(h->x + b, m, h->low, h->step, h->scale, h->bins, index);
            if (pairs) {
                for (; i + 4 <= m; i += 4) {
                    table[index[i] * PAIRS + index[i + 1]]++;
                    table[PAIRS * PAIRS + index[i + 2] * PAIRS + index[i + 3]]++;
                }
                for (; i < m; i++) h->counts[index[i]]++; /* at most 3 of a block */
            } else {
                for (; i + 4 <= m; i += 4) {
                    table[index[i]]++;
                    table[h->bins + index[i + 1]]++;
                    table[2 * h->bins + index[i + 2]]++;
                    table[3 * h->bins + index[i + 3]]++;
                }
                for (; i < m; i++) table[index[i]]++;
            }
        }
        for (int64_t k = 0; k < size; k++) total[k] += table[k];
    }
    for (int32_t r = 0; r < h->bins; r++) {
        int64_t sum = 0;
        if (pairs) {
            for (int32_t k = 0; k < h->bins; k++)
                for (int t = 0; t < 2; t++) sum += total[t * PAIRS * PAIRS + r * PAIRS + k] + total[t * PAIRS * PAIRS + k * PAIRS + r];
        } else {
            for (int t = 0; t < 4; t++) sum += total[t * h->bins + r];
        }
        h->counts[r] += sum;
    }
    free(table);
    free(total);
}

/* Runs work(job k) for k < count: job 0 on the calling thread, the others on threads of their
 * own (or on the calling thread, where a thread cannot be started). */
static void run_jobs(void *(*work)(void *), char *jobs, size_t size, int count) {
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int k = 1; k < count; k++) started[k] = pthread_create(&threads[k], NULL, work, jobs + k * size) == 0;
    work(jobs);
    for (int k = 1; k < count; k++) {
        if (started[k])
            pthread_join(threads[k], NULL);
        else
            work(jobs + k * size);
    }
}

static void *moments_job(void *job) {
    moments_of(job);
    return NULL;
}

static void *histogram_job(void *job) {
    histogram_of(job);
    return NULL;
}

/* Splits n elements into `count` ranges that start on BLOCK boundaries. */
static int split(int64_t n, int threads, int64_t *starts) {
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
    int count = threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads);
    if (count > blocks) count = blocks > 0 ? (int)blocks : 1;
    for (int k = 0; k <= count; k++) {
        int64_t start = blocks * k / count * BLOCK;
        starts[k] = start < n ? start : n;
    }
    return count;
}

static PyObject *moments(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t n;
    int threads;
    Moments jobs[MAX_THREADS];
    int64_t starts[MAX_THREADS + 1];
    if (!PyArg_ParseTuple(args, "Kni", &address, &n, &threads)) return NULL;
    int count = split(n, threads, starts);
    for (int k = 0; k < count; k++) jobs[k] = (Moments){.x = (const float *)(uintptr_t)address + starts[k], .n = starts[k + 1] - starts[k]};
    Py_BEGIN_ALLOW_THREADS;
    run_jobs(moments_job, (char *)jobs, sizeof(Moments), count);
    for (int k = 1; k < count; k++) {
        jobs[0].low = jobs[k].low < jobs[0].low ? jobs[k].low : jobs[0].low;
        jobs[0].high = jobs[k].high > jobs[0].high ? jobs[k].high : jobs[0].high;
        jobs[0].sum += jobs[k].sum;
        jobs[0].squares += jobs[k].squares;
        jobs[0].zeros += jobs[k].zeros;
        jobs[0].nonfinite += jobs[k].nonfinite;
    }
    Py_END_ALLOW_THREADS;
    return Py_BuildValue("ddddLL", jobs[0].low, jobs[0].high, jobs[0].sum, jobs[0].squares, (long long)jobs[0].zeros,
                         (long long)jobs[0].nonfinite);
}

static PyObject *histogram(PyObject *self, PyObject *args) {
    unsigned long long address, out;
    Py_ssize_t n;
    float low, step, scale;
    int bins, threads, failed = 0;
    Histogram jobs[MAX_THREADS];
    int64_t starts[MAX_THREADS + 1];
    if (!PyArg_ParseTuple(args, "KnfffiKi", &address, &n, &low, &step, &scale, &bins, &out, &threads)) return NULL;
    if (bins < 1) {
        PyErr_Format(PyExc_ValueError, "bins must be positive, got %d", bins);
        return NULL;
    }
    int count = split(n, threads, starts);
    int64_t *counts = calloc((size_t)(unsigned)count * (unsigned)bins, sizeof(int64_t));
    if (counts == NULL) return PyErr_NoMemory();
    for (int k = 0; k < count; k++)
        jobs[k] = (Histogram){(const float *)(uintptr_t)address + starts[k], starts[k + 1] - starts[k], low, step, scale, bins,
                              counts + (size_t)k * bins, 0};
    Py_BEGIN_ALLOW_THREADS;
    run_jobs(histogram_job, (char *)jobs, sizeof(Histogram), count);
    double *result = (double *)(uintptr_t)out;
    for (int r = 0; r < bins; r++) {
        int64_t sum = 0;
        for (int k = 0; k < count; k++) sum += jobs[k].counts[r];
        result[r] = (double)sum;
    }
    for (int k = 0; k < count; k++) failed |= jobs[k].failed;
    Py_END_ALLOW_THREADS;
    free(counts);
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"moments", moments, METH_VARARGS,
     "moments(address, n, threads) -> (low, high, sum, squares, zeros, nonfinite) of n float32 at address."},
    {"histogram", histogram, METH_VARARGS,
     "histogram(address, n, low, step, scale, bins, out, threads): counts of n float32 at address into bins "
     "float64 at out; an element's bin is int(((x - low) * step) * scale) in float32, clamped."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "Fused CPU reductions (see _kernels.c).", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
