/*
 * Reed-Solomon RS(255, 255 - roots) over GF(2^8) for dm-verity FEC, columns at a time.
 *
 * The code is the one the kernel's lib/reed_solomon builds with init_rs(8, 0x11d, 0, 1,
 * roots) and cryptsetup with init_rs_char(8, 0x11d, 0, 1, roots, 0): field polynomial
 * x^8+x^4+x^3+x^2+1, generator roots alpha^0 .. alpha^(roots-1), systematic, message
 * byte 0 the highest-degree coefficient. dm-verity interleaves codewords so that byte b
 * of row i (a whole block) is message symbol i of codeword b; both functions here take
 * the rows as buffers and work on every column at once, with the GIL released.
 *
 *   encode(roots, rows, width) -> bytes
 *       rows: 255 - roots buffers of at least width bytes. Returns width * roots parity
 *       bytes, codeword c's parity at [c * roots, (c + 1) * roots): the on-disk order.
 *   decode(roots, rows, parity, erasures, target) -> (corrected, failed, row | None)
 *       Decodes every column (errors and the given erasure positions, Berlekamp-Massey
 *       and Forney as lib/reed_solomon/decode_rs.c does) and returns the symbols it
 *       corrected in columns that decoded, the number of columns that did not, and the
 *       repaired row `target` (-1: none; a failed column keeps its received byte).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NN 255
#define MAX_ROOTS 24
#define TILE 2048 /* columns per pass: roots * TILE bytes of state stay in L1/L2 */

static uint8_t gf_exp[2 * NN];
static uint8_t gf_log[256];
static uint8_t gf_mul[256][256]; /* gf_mul[a][b] = a * b: one row per constant */
static uint8_t nib_lo[256][16], nib_hi[256][16]; /* c * x and c * (x << 4), x < 16 */

static void init_tables(void)
{
    unsigned x = 1;
    for (int i = 0; i < NN; i++) {
        gf_exp[i] = gf_exp[i + NN] = (uint8_t)x;
        gf_log[x] = (uint8_t)i;
        x <<= 1;
        if (x & 0x100)
            x ^= 0x11d;
    }
    for (int a = 0; a < 256; a++)
        for (int b = 0; b < 256; b++)
            gf_mul[a][b] = (a && b) ? gf_exp[gf_log[a] + gf_log[b]] : 0;
    for (int a = 0; a < 256; a++)
        for (int x = 0; x < 16; x++) {
            nib_lo[a][x] = gf_mul[a][x];
            nib_hi[a][x] = gf_mul[a][x << 4];
        }
}

/*
 * Row operations of the encoder. A table lookup per byte does not vectorise; with AVX2
 * a product c * x is two 16-entry lookups (low and high nibble, vpshufb) and an XOR, 32
 * bytes at a time: the split-table method of ISA-L and gf-complete. Chosen once at
 * import by what the CPU supports.
 */
static void mul_xor_scalar(uint8_t *dst, const uint8_t *src, uint8_t c, size_t w)
{
    const uint8_t *t = gf_mul[c];
    for (size_t b = 0; b < w; b++)
        dst[b] ^= t[src[b]];
}

static void mul_scalar(uint8_t *buf, uint8_t c, size_t w)
{
    const uint8_t *t = gf_mul[c];
    for (size_t b = 0; b < w; b++)
        buf[b] = t[buf[b]];
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1

__attribute__((target("avx2"))) static inline __m256i mul32(__m256i v, __m256i lo, __m256i hi)
{
    __m256i mask = _mm256_set1_epi8(0x0f);
    __m256i l = _mm256_shuffle_epi8(lo, _mm256_and_si256(v, mask));
    __m256i h = _mm256_shuffle_epi8(hi, _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
    return _mm256_xor_si256(l, h);
}

__attribute__((target("avx2"))) static void mul_xor_avx2(uint8_t *dst, const uint8_t *src,
                                                         uint8_t c, size_t w)
{
    __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)nib_lo[c]));
    __m256i hi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)nib_hi[c]));
    size_t b = 0;
    for (; b + 32 <= w; b += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(src + b));
        __m256i d = _mm256_loadu_si256((const __m256i *)(dst + b));
        _mm256_storeu_si256((__m256i *)(dst + b), _mm256_xor_si256(d, mul32(v, lo, hi)));
    }
    mul_xor_scalar(dst + b, src + b, c, w - b);
}

__attribute__((target("avx2"))) static void mul_avx2(uint8_t *buf, uint8_t c, size_t w)
{
    __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)nib_lo[c]));
    __m256i hi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)nib_hi[c]));
    size_t b = 0;
    for (; b + 32 <= w; b += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(buf + b));
        _mm256_storeu_si256((__m256i *)(buf + b), mul32(v, lo, hi));
    }
    mul_scalar(buf + b, c, w - b);
}
#endif

static void (*row_mul_xor)(uint8_t *, const uint8_t *, uint8_t, size_t) = mul_xor_scalar;
static void (*row_mul)(uint8_t *, uint8_t, size_t) = mul_scalar;

static void choose_row_ops(void)
{
#ifdef HAVE_AVX2_PATH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && !getenv("NBD_VERITY_RS_SCALAR")) {
        row_mul_xor = mul_xor_avx2;
        row_mul = mul_avx2;
    }
#endif
}

static inline uint8_t mul(uint8_t a, uint8_t b) { return gf_mul[a][b]; }

static inline uint8_t inv(uint8_t a) { return gf_exp[NN - gf_log[a]]; }

/* Generator prod_{i<roots} (x + alpha^i); gen[j] is the coefficient of x^j, gen[roots] = 1. */
static void generator(int roots, uint8_t *gen)
{
    memset(gen, 0, MAX_ROOTS + 1);
    gen[0] = 1;
    for (int i = 0; i < roots; i++) {
        uint8_t root = gf_exp[i];
        for (int j = i + 1; j > 0; j--)
            gen[j] = gen[j - 1] ^ mul(gen[j], root);
        gen[0] = mul(gen[0], root);
    }
}

/*
 * The LFSR of encode_rs.c, run on TILE columns side by side. The parity registers are a
 * ring of rows: the register shifted out each step becomes the feedback row, then the
 * new last register, so nothing is ever moved.
 */
static void encode_columns(int roots, const uint8_t *const *rows, size_t width, uint8_t *out)
{
    uint8_t gen[MAX_ROOTS + 1];
    static __thread uint8_t state[MAX_ROOTS][TILE];
    int rsn = NN - roots;

    generator(roots, gen);
    for (size_t c0 = 0; c0 < width; c0 += TILE) {
        size_t w = width - c0 < TILE ? width - c0 : TILE;
        int head = 0;
        for (int j = 0; j < roots; j++)
            memset(state[j], 0, w);
        for (int i = 0; i < rsn; i++) {
            const uint8_t *row = rows[i] + c0;
            uint8_t *fb = state[head];
            for (size_t b = 0; b < w; b++)
                fb[b] ^= row[b];
            for (int j = 1; j < roots; j++)
                row_mul_xor(state[(head + j) % roots], fb, gen[roots - j], w);
            row_mul(fb, gen[0], w);
            head = (head + 1) % roots;
        }
        for (int j = 0; j < roots; j++) {
            const uint8_t *reg = state[(head + j) % roots];
            for (size_t b = 0; b < w; b++)
                out[(c0 + b) * roots + j] = reg[b];
        }
    }
}

/*
 * Decode one codeword in place (cw[0..254], message first). Returns the number of symbols
 * corrected, or -1 when it cannot be decoded (more errors than the code corrects).
 */
static int decode_codeword(int roots, uint8_t *cw, const int *eras, int neras)
{
    uint8_t s[MAX_ROOTS], lambda[MAX_ROOTS + 1], b[MAX_ROOTS + 1], t[MAX_ROOTS + 1];
    uint8_t omega[MAX_ROOTS];
    int loc[MAX_ROOTS], any = 0;

    if (neras > roots)
        return -1;
    for (int i = 0; i < roots; i++) { /* syndromes: the word at alpha^i, Horner */
        uint8_t acc = 0, a = gf_exp[i];
        const uint8_t *m = gf_mul[a];
        for (int j = 0; j < NN; j++)
            acc = m[acc] ^ cw[j];
        s[i] = acc;
        any |= acc;
    }
    if (!any)
        return 0;
    memset(lambda, 0, sizeof(lambda));
    lambda[0] = 1;
    for (int e = 0; e < neras; e++) { /* erasure locator: prod (1 + X x) */
        uint8_t x = gf_exp[NN - 1 - eras[e]];
        for (int j = e + 1; j > 0; j--)
            lambda[j] ^= mul(x, lambda[j - 1]);
    }
    memcpy(b, lambda, sizeof(b));
    int el = neras;
    for (int r = neras + 1; r <= roots; r++) { /* Berlekamp-Massey */
        uint8_t d = 0;
        for (int i = 0; i < r; i++)
            d ^= mul(lambda[i], s[r - i - 1]);
        if (!d) {
            memmove(b + 1, b, roots);
            b[0] = 0;
            continue;
        }
        t[0] = lambda[0];
        for (int i = 0; i < roots; i++)
            t[i + 1] = lambda[i + 1] ^ mul(d, b[i]);
        if (2 * el <= r + neras - 1) {
            el = r + neras - el;
            uint8_t di = inv(d);
            for (int i = 0; i <= roots; i++)
                b[i] = mul(lambda[i], di);
        } else {
            memmove(b + 1, b, roots);
            b[0] = 0;
        }
        memcpy(lambda, t, sizeof(lambda));
    }
    int deg = 0;
    for (int i = 0; i <= roots; i++)
        if (lambda[i])
            deg = i;
    if (deg == 0 || deg > roots)
        return -1;
    int count = 0;
    for (int i = 1; i <= NN && count < deg; i++) { /* Chien search: roots alpha^i */
        uint8_t acc = 0;
        for (int j = 0; j <= deg; j++)
            if (lambda[j])
                acc ^= gf_exp[(gf_log[lambda[j]] + (i * j) % NN) % NN];
        if (!acc)
            loc[count++] = i;
    }
    if (count != deg)
        return -1;
    for (int i = 0; i < roots; i++) { /* omega = s * lambda mod x^roots */
        uint8_t acc = 0;
        for (int j = 0; j <= i && j <= deg; j++)
            acc ^= mul(s[i - j], lambda[j]);
        omega[i] = acc;
    }
    for (int k = 0; k < count; k++) { /* Forney, fcr 0: e = X omega(1/X) / lambda'(1/X) */
        int i = loc[k];
        uint8_t xinv = gf_exp[i % NN], num = 0, den = 0, p = 1;
        for (int j = 0; j < roots; j++) {
            num ^= mul(omega[j], p);
            p = mul(p, xinv);
        }
        p = 1;
        for (int j = 1; j <= deg; j += 2) { /* odd terms of lambda, derivative */
            den ^= mul(lambda[j], p);
            p = mul(p, mul(xinv, xinv));
        }
        if (!den)
            return -1;
        uint8_t x = gf_exp[(NN - i) % NN];
        cw[i - 1] ^= mul(mul(num, x), inv(den));
    }
    return count;
}

/* Borrow buffers from a sequence; each must hold at least min_len bytes. */
static int get_rows(PyObject *seq, Py_ssize_t want, Py_ssize_t min_len, Py_buffer *views)
{
    if (PySequence_Size(seq) != want) {
        PyErr_Format(PyExc_ValueError, "rs: %zd rows needed", want);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        int r = item ? PyObject_GetBuffer(item, &views[i], PyBUF_SIMPLE) : -1;
        Py_XDECREF(item);
        if (r == 0 && views[i].len < min_len) {
            PyBuffer_Release(&views[i]);
            PyErr_Format(PyExc_ValueError, "rs: row %zd is shorter than %zd bytes", i, min_len);
            r = -1;
        }
        if (r < 0) {
            while (i--)
                PyBuffer_Release(&views[i]);
            return -1;
        }
    }
    return 0;
}

static int check_roots(int roots)
{
    if (roots < 2 || roots > MAX_ROOTS) {
        PyErr_Format(PyExc_ValueError, "rs: roots %d is outside 2..24", roots);
        return -1;
    }
    return 0;
}

static PyObject *rs_encode(PyObject *Py_UNUSED(self), PyObject *args)
{
    int roots;
    PyObject *seq;
    Py_ssize_t width;

    if (!PyArg_ParseTuple(args, "iOn", &roots, &seq, &width) || check_roots(roots) < 0)
        return NULL;
    if (width < 0 || width > PY_SSIZE_T_MAX / MAX_ROOTS)
        return PyErr_Format(PyExc_ValueError, "rs: width %zd is out of range", width);
    Py_buffer views[NN];
    const uint8_t *rows[NN];
    if (get_rows(seq, NN - roots, width, views) < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, width * roots);
    if (out) {
        uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
        for (int i = 0; i < NN - roots; i++)
            rows[i] = views[i].buf;
        Py_BEGIN_ALLOW_THREADS /* pure table arithmetic on borrowed buffers */
        encode_columns(roots, rows, (size_t)width, dst);
        Py_END_ALLOW_THREADS
    }
    for (int i = 0; i < NN - roots; i++)
        PyBuffer_Release(&views[i]);
    return out;
}

static PyObject *rs_decode(PyObject *Py_UNUSED(self), PyObject *args)
{
    int roots, target, neras = 0, eras[NN];
    PyObject *seq, *erasures, *row = NULL;
    Py_buffer parity, views[NN];

    if (!PyArg_ParseTuple(args, "iOy*Oi", &roots, &seq, &parity, &erasures, &target))
        return NULL;
    int rsn = NN - roots;
    Py_ssize_t width = roots >= 2 && roots <= MAX_ROOTS ? parity.len / roots : 0;
    PyObject *fast = check_roots(roots) < 0 ? NULL : PySequence_Fast(erasures, "rs: erasures");
    if (!fast)
        goto out_parity;
    /* Every erasure is refused rather than dropped: a list longer than a codeword, a
     * position outside the message, or one given twice (which would double its root in
     * the erasure locator) is the caller's mistake. */
    if (PySequence_Fast_GET_SIZE(fast) > NN) {
        PyErr_Format(PyExc_ValueError, "rs: %zd erasures, at most %d",
                     PySequence_Fast_GET_SIZE(fast), NN);
        Py_DECREF(fast);
        goto out_parity;
    }
    uint8_t seen[NN] = {0};
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
        long p = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        int outside = p < 0 || p >= rsn;
        if (outside || seen[p]) {
            if (!PyErr_Occurred() && outside)
                PyErr_Format(PyExc_ValueError, "rs: erasure %ld is outside 0..%d", p, rsn - 1);
            else if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "rs: erasure %ld is given twice", p);
            Py_DECREF(fast);
            goto out_parity;
        }
        seen[p] = 1;
        eras[neras++] = (int)p;
    }
    Py_DECREF(fast);
    if (target < -1 || target >= rsn || parity.len != width * roots) {
        PyErr_SetString(PyExc_ValueError, "rs: target or parity length out of range");
        goto out_parity;
    }
    if (get_rows(seq, rsn, width, views) < 0)
        goto out_parity;
    uint8_t *dst = NULL;
    if (target >= 0) {
        row = PyBytes_FromStringAndSize(NULL, width);
        if (!row)
            goto out_rows;
        dst = (uint8_t *)PyBytes_AS_STRING(row);
    }
    long long corrected = 0, failed = 0;
    Py_BEGIN_ALLOW_THREADS
    uint8_t cw[NN];
    const uint8_t *par = parity.buf;
    for (Py_ssize_t c = 0; c < width; c++) {
        for (int i = 0; i < rsn; i++)
            cw[i] = ((const uint8_t *)views[i].buf)[c];
        memcpy(cw + rsn, par + c * roots, roots);
        int n = decode_codeword(roots, cw, eras, neras);
        if (n < 0) {
            failed++;
            if (dst)
                dst[c] = ((const uint8_t *)views[target].buf)[c];
        } else {
            corrected += n;
            if (dst)
                dst[c] = cw[target];
        }
    }
    Py_END_ALLOW_THREADS
    PyObject *result = Py_BuildValue("LLO", corrected, failed, row ? row : Py_None);
    Py_XDECREF(row);
    for (int i = 0; i < rsn; i++)
        PyBuffer_Release(&views[i]);
    PyBuffer_Release(&parity);
    return result;
out_rows:
    for (int i = 0; i < rsn; i++)
        PyBuffer_Release(&views[i]);
out_parity:
    PyBuffer_Release(&parity);
    return NULL;
}

static PyMethodDef methods[] = {
    {"encode", rs_encode, METH_VARARGS, "encode(roots, rows, width) -> parity bytes"},
    {"decode", rs_decode, METH_VARARGS,
     "decode(roots, rows, parity, erasures, target) -> (corrected, failed, row or None)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_rs", "Reed-Solomon codec for dm-verity FEC.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rs(void)
{
    init_tables();
    choose_row_ops();
    return PyModule_Create(&module);
}
