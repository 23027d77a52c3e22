/* sha256x: salted SHA-256 of equal-sized blocks, one to three messages interleaved, on
 * the x86 SHA extensions (FIPS 180-4 sections 4.2.2, 5.3.3, 6.2; Intel's SHA extensions).
 *
 * Why interleave: each sha256rnds2 depends on the one before, so one stream leaves the
 * SHA unit idle between dependent instructions; two independent messages fill it (the
 * kernel's sha256_finup_2x for dm-verity and fs-verity, 6.19). Verity blocks are that
 * workload: many messages of one length behind one salted prefix.
 *
 * Every message is head || block || suffix: format 1 absorbs the salt's whole 64-byte
 * blocks once into the state (the kernel's pre-salted state) and keeps the rest as
 * head; format 0 has no head and the salt as suffix. Lanes of one call have the same
 * length, so their 64-byte boundaries coincide and one schedule of blocks serves all.
 *
 * The code is compiled with target("sha,sse4.1") and only runs where CPUID says the CPU
 * has those (sha256x_new refuses otherwise, and under NBD_VERITY_NO_SHANI=1, which makes
 * the process behave as on a CPU without them), so the module builds and loads anywhere.
 */

#include "sha256x.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define SHA256X_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

#define TAIL_MAX (64 + SHA256X_MAX_SALT + 64)  /* rest (< 64) + suffix + padding, rounded */

struct sha256x {
    uint32_t h[8];                          /* the state after prefix_size bytes of salt */
    uint64_t prefix_size;                   /* salt bytes absorbed in h (a multiple of 64) */
    unsigned char head[64];                 /* format 1: the salt's bytes past its whole blocks */
    size_t head_size;
    unsigned char suffix[SHA256X_MAX_SALT];  /* format 0: the salt, hashed after the block */
    size_t suffix_size;
    int lanes;                              /* messages hashed at once: 1, 2 or 3 */
};

/* Counting is off unless asked for (tests): one shared counter bumped by every call
 * would move its cache line between the cores of the pool's threads on every request. */
static int counting;
static unsigned long long counts[SHA256X_MAX_LANES];

void sha256x_set_counting(int on)
{
    counting = on;
}

void sha256x_counts(unsigned long long out[SHA256X_MAX_LANES])
{
    for (int i = 0; i < SHA256X_MAX_LANES; i++)
        out[i] = __atomic_load_n(&counts[i], __ATOMIC_RELAXED);
}

static void count(int lanes, size_t messages)
{
    if (counting && messages > 0)
        __atomic_fetch_add(&counts[lanes - 1], (unsigned long long)messages, __ATOMIC_RELAXED);
}

int sha256x_lanes(const sha256x *s)
{
    return s->lanes;
}

void sha256x_free(sha256x *s)
{
    free(s);
}

int sha256x_default_lanes(void)
{
    static int lanes = -1;  /* first computed at module init, under the GIL */
    if (lanes < 0) {
        const char *off = getenv(SHA256X_NO_SHANI_ENV);
        int disabled = off != NULL && off[0] != '\0' && strcmp(off, "0") != 0;
        lanes = !disabled && sha256x_cpu_has_sha() ? 2 : 0;
    }
    return lanes;
}

#ifdef SHA256X_X86

#define SHANI __attribute__((target("sha,sse4.1")))
#define INLINE static inline __attribute__((always_inline)) SHANI

int sha256x_cpu_has_sha(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 9)) || !(c & (1u << 19)))
        return 0;  /* SSSE3 (pshufb, palignr) and SSE4.1 (pblendw) */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    return (b >> 29) & 1;
}

/* FIPS 180-4 4.2.2: the round constants. */
static const uint32_t K[64] __attribute__((aligned(16))) = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
};

/* FIPS 180-4 5.3.3: the initial hash value. */
static const uint32_t IV[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

/* One message's working state: sha256rnds2 wants the words as ABEF and CDGH; w holds
 * the last 16 words of the message schedule, four to a register. */
typedef struct {
    __m128i abef, cdgh, w[4];
} lane;

INLINE __m128i bswap_mask(void)
{
    return _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
}

/* H0..H7 into ABEF and CDGH. */
INLINE void load_state(lane *l, const uint32_t h[8])
{
    __m128i dcba = _mm_loadu_si128((const __m128i *)&h[0]);
    __m128i hgfe = _mm_loadu_si128((const __m128i *)&h[4]);
    __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
    __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
    l->abef = _mm_alignr_epi8(cdab, efgh, 8);
    l->cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
}

/* ABEF and CDGH back to the digest's bytes (each word big-endian). */
INLINE void store_digest(const lane *l, unsigned char *out)
{
    __m128i feba = _mm_shuffle_epi32(l->abef, 0x1B);
    __m128i dchg = _mm_shuffle_epi32(l->cdgh, 0xB1);
    __m128i dcba = _mm_blend_epi16(feba, dchg, 0xF0);
    __m128i hgfe = _mm_alignr_epi8(dchg, feba, 8);
    _mm_storeu_si128((__m128i *)out, _mm_shuffle_epi8(dcba, bswap_mask()));
    _mm_storeu_si128((__m128i *)(out + 16), _mm_shuffle_epi8(hgfe, bswap_mask()));
}

/* Rounds 4q..4q+3 (6.2.2 steps 1-3): words 0-15 from the block (big-endian), the
 * others W[t] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16] by msg1 (the s0 and W[t-16]
 * terms), palignr (W[t-7]) and msg2 (the s1 terms). Two rounds per sha256rnds2. */
INLINE void quad(lane *l, const unsigned char *block, int q)
{
    __m128i *w = l->w;
    if (q < 4)
        w[q] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(block + 16 * q)),
                                bswap_mask());
    else
        w[q & 3] = _mm_sha256msg2_epu32(
            _mm_add_epi32(_mm_sha256msg1_epu32(w[q & 3], w[(q + 1) & 3]),
                          _mm_alignr_epi8(w[(q + 3) & 3], w[(q + 2) & 3], 4)),
            w[(q + 3) & 3]);
    __m128i m = _mm_add_epi32(w[q & 3], _mm_load_si128((const __m128i *)&K[4 * q]));
    l->cdgh = _mm_sha256rnds2_epu32(l->cdgh, l->abef, m);
    l->abef = _mm_sha256rnds2_epu32(l->abef, l->cdgh, _mm_shuffle_epi32(m, 0x0E));
}

/* Compress `blocks` 64-byte blocks of each of n messages (6.2.2), the lanes' rounds
 * interleaved so that independent sha256rnds2 fill the unit. */
INLINE void compress(lane *l, int n, const unsigned char *const *p, size_t blocks)
{
    for (size_t b = 0; b < blocks; b++) {
        __m128i abef[SHA256X_MAX_LANES], cdgh[SHA256X_MAX_LANES];
        for (int j = 0; j < n; j++) {
            abef[j] = l[j].abef;
            cdgh[j] = l[j].cdgh;
        }
#pragma GCC unroll 16
        for (int q = 0; q < 16; q++)
#pragma GCC unroll 3
            for (int j = 0; j < n; j++)
                quad(&l[j], p[j] + 64 * b, q);
        for (int j = 0; j < n; j++) {
            l[j].abef = _mm_add_epi32(l[j].abef, abef[j]);
            l[j].cdgh = _mm_add_epi32(l[j].cdgh, cdgh[j]);
        }
    }
}

/* The digests of n messages head || data[j] || suffix, each data[j] size bytes. */
INLINE void hash_lanes(const sha256x *s, int n, const unsigned char *const *data, size_t size,
                       unsigned char *const *out)
{
    lane l[SHA256X_MAX_LANES];
    const unsigned char *p[SHA256X_MAX_LANES];
    unsigned char buf[SHA256X_MAX_LANES][TAIL_MAX];
    size_t off = 0, pending = 0;  /* data bytes consumed; head bytes left for the tail */
    for (int j = 0; j < n; j++)
        load_state(&l[j], s->h);
    if (s->head_size > 0 && s->head_size + size >= 64) {  /* head || the block's start */
        off = 64 - s->head_size;
        for (int j = 0; j < n; j++) {
            memcpy(buf[j], s->head, s->head_size);
            memcpy(buf[j] + s->head_size, data[j], off);
            p[j] = buf[j];
        }
        compress(l, n, p, 1);
    } else {
        pending = s->head_size;  /* a block shorter than what the head leaves of 64 bytes */
    }
    size_t whole = (size - off) / 64;
    for (int j = 0; j < n; j++)
        p[j] = data[j] + off;
    compress(l, n, p, whole);
    off += whole * 64;
    /* 5.1.1: the rest, the suffix, 0x80, zeros, and the length in bits, big-endian. */
    size_t rest = size - off, used = pending + rest + s->suffix_size;
    size_t tail = (used + 9 + 63) & ~(size_t)63;
    uint64_t bits = (s->prefix_size + s->head_size + size + s->suffix_size) * 8;
    for (int j = 0; j < n; j++) {
        unsigned char *t = buf[j];
        memcpy(t, s->head, pending);
        memcpy(t + pending, data[j] + off, rest);
        memcpy(t + pending + rest, s->suffix, s->suffix_size);
        t[used] = 0x80;
        memset(t + used + 1, 0, tail - used - 1 - 8);
        for (int k = 0; k < 8; k++)
            t[tail - 1 - k] = (unsigned char)(bits >> (8 * k));
        p[j] = t;
    }
    compress(l, n, p, tail / 64);
    for (int j = 0; j < n; j++)
        store_digest(&l[j], out[j]);
}

/* One specialised copy per number of lanes, so that each keeps its lanes in registers. */
static SHANI void hash1(const sha256x *s, const unsigned char *const *d, size_t size,
                        unsigned char *const *o)
{
    hash_lanes(s, 1, d, size, o);
}

static SHANI void hash2(const sha256x *s, const unsigned char *const *d, size_t size,
                        unsigned char *const *o)
{
    hash_lanes(s, 2, d, size, o);
}

static SHANI void hash3(const sha256x *s, const unsigned char *const *d, size_t size,
                        unsigned char *const *o)
{
    hash_lanes(s, 3, d, size, o);
}

typedef void (*hash_fn)(const sha256x *, const unsigned char *const *, size_t,
                        unsigned char *const *);
static const hash_fn HASH[SHA256X_MAX_LANES + 1] = {NULL, hash1, hash2, hash3};

/* The state after the salt's whole blocks (format 1); the state of an empty prefix is IV. */
static SHANI void absorb(uint32_t h[8], const unsigned char *salt, size_t blocks)
{
    lane l;
    load_state(&l, IV);
    const unsigned char *p = salt;
    compress(&l, 1, &p, blocks);
    unsigned char md[32];
    store_digest(&l, md);
    for (int i = 0; i < 8; i++)
        h[i] = (uint32_t)md[4 * i] << 24 | (uint32_t)md[4 * i + 1] << 16 |
               (uint32_t)md[4 * i + 2] << 8 | md[4 * i + 3];
}

sha256x *sha256x_new(const unsigned char *salt, size_t salt_size, int salt_first, int lanes)
{
    if (sha256x_default_lanes() == 0 || lanes < 1 || lanes > SHA256X_MAX_LANES ||
        salt_size > SHA256X_MAX_SALT)
        return NULL;
    sha256x *s = calloc(1, sizeof *s);
    if (s == NULL)
        return NULL;
    s->lanes = lanes;
    if (salt_first) {
        size_t whole = salt_size / 64;
        absorb(s->h, salt, whole);
        s->prefix_size = whole * 64;
        s->head_size = salt_size - s->prefix_size;
        memcpy(s->head, salt + s->prefix_size, s->head_size);
    } else {
        memcpy(s->h, IV, sizeof IV);
        memcpy(s->suffix, salt, salt_size);
        s->suffix_size = salt_size;
    }
    return s;
}

/* The widest group of lanes that fits in what is left (the last blocks of a run). */
static int group(const sha256x *s, size_t left)
{
    return left < (size_t)s->lanes ? (int)left : s->lanes;
}

void sha256x_slots(const sha256x *s, const unsigned char *data, size_t blocks,
                   size_t block_size, unsigned char *out, size_t slot_size)
{
    size_t done[SHA256X_MAX_LANES + 1] = {0};
    for (size_t i = 0; i < blocks;) {
        int n = group(s, blocks - i);
        const unsigned char *d[SHA256X_MAX_LANES];
        unsigned char *o[SHA256X_MAX_LANES];
        for (int j = 0; j < n; j++) {
            d[j] = data + (i + j) * block_size;
            o[j] = out + (i + j) * slot_size;
            memset(o[j] + SHA256X_DIGEST_SIZE, 0, slot_size - SHA256X_DIGEST_SIZE);
        }
        HASH[n](s, d, block_size, o);
        done[n] += (size_t)n;
        i += (size_t)n;
    }
    for (int n = 1; n <= SHA256X_MAX_LANES; n++)
        count(n, done[n]);
}

ssize_t sha256x_verify(const sha256x *s, const unsigned char *data, size_t blocks,
                       size_t block_size, const unsigned char *expected, size_t slot_size)
{
    size_t done[SHA256X_MAX_LANES + 1] = {0};
    ssize_t verdict = -1;
    unsigned char md[SHA256X_MAX_LANES][SHA256X_DIGEST_SIZE];
    unsigned char *o[SHA256X_MAX_LANES] = {md[0], md[1], md[2]};
    for (size_t i = 0; i < blocks && verdict < 0;) {
        int n = group(s, blocks - i);
        const unsigned char *d[SHA256X_MAX_LANES];
        for (int j = 0; j < n; j++)
            d[j] = data + (i + j) * block_size;
        HASH[n](s, d, block_size, o);
        done[n] += (size_t)n;
        for (int j = 0; j < n && verdict < 0; j++)
            if (memcmp(md[j], expected + (i + j) * slot_size, SHA256X_DIGEST_SIZE) != 0)
                verdict = (ssize_t)(i + j);
        i += (size_t)n;
    }
    for (int n = 1; n <= SHA256X_MAX_LANES; n++)
        count(n, done[n]);
    return verdict;
}

#else  /* not x86: no SHA extensions, sha256x_new refuses and nothing else is reached */

int sha256x_cpu_has_sha(void)
{
    return 0;
}

sha256x *sha256x_new(const unsigned char *salt, size_t salt_size, int salt_first, int lanes)
{
    (void)salt, (void)salt_size, (void)salt_first, (void)lanes;
    return NULL;
}

void sha256x_slots(const sha256x *s, const unsigned char *data, size_t blocks,
                   size_t block_size, unsigned char *out, size_t slot_size)
{
    (void)s, (void)data, (void)blocks, (void)block_size, (void)out, (void)slot_size;
    abort();
}

ssize_t sha256x_verify(const sha256x *s, const unsigned char *data, size_t blocks,
                       size_t block_size, const unsigned char *expected, size_t slot_size)
{
    (void)s, (void)data, (void)blocks, (void)block_size, (void)expected, (void)slot_size;
    abort();
}

#endif
