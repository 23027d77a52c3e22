/* bench/sha256x_bench.c: MB/s of salted SHA-256 of 4 KiB blocks on one core, by method.
 *
 * Built and run by bench/sha256x.py (gcc, with nbd_verity/format/sha256x.c and libcrypto).
 * Every method hashes the same buffer of blocks, salt first (format 1), for SLICE seconds
 * at a time; the methods take turns for ROUNDS rounds, so that a burst of other work on
 * the shared machine hits one slice, not one method, and each prints one line
 * "method MB/s" with the median of its slices. The methods:
 *   evp-digest  EVP_Digest of the block alone (one call per block, no salt: a reference)
 *   evp-new     EVP_MD_CTX_new, Init, Update salt, Update block, Final, free per block
 *               (a new context each call, as EVP_Digest does)
 *   evp-copy    _native.c's EVP loop: one context per run, EVP_MD_CTX_copy_ex from the
 *               pre-salted base per block
 *   evp-reuse   one reused context: EVP_DigestInit_ex2, Update salt, Update block, Final
 *   shani-x1..3 sha256x_slots with 1, 2 or 3 interleaved streams
 * Usage: sha256x_bench SLICE ROUNDS BLOCK_SIZE BLOCKS SALT_SIZE
 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <openssl/evp.h>

#include "sha256x.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

typedef struct {
    const unsigned char *data, *salt;
    size_t block_size, blocks, salt_size;
    unsigned char *out;  /* blocks * 32 */
    EVP_MD_CTX *ctx, *base;
    const EVP_MD *md;
    sha256x *fast;
} run;

static void evp_digest(run *r)
{
    for (size_t i = 0; i < r->blocks; i++)
        EVP_Digest(r->data + i * r->block_size, r->block_size, r->out + 32 * i, NULL, r->md,
                   NULL);
}

static void evp_new(run *r)
{
    for (size_t i = 0; i < r->blocks; i++) {
        EVP_MD_CTX *c = EVP_MD_CTX_new();
        EVP_DigestInit_ex(c, r->md, NULL);
        EVP_DigestUpdate(c, r->salt, r->salt_size);
        EVP_DigestUpdate(c, r->data + i * r->block_size, r->block_size);
        EVP_DigestFinal_ex(c, r->out + 32 * i, NULL);
        EVP_MD_CTX_free(c);
    }
}

static void evp_copy(run *r)
{
    for (size_t i = 0; i < r->blocks; i++) {
        EVP_MD_CTX_copy_ex(r->ctx, r->base);
        EVP_DigestUpdate(r->ctx, r->data + i * r->block_size, r->block_size);
        EVP_DigestFinal_ex(r->ctx, r->out + 32 * i, NULL);
    }
}

static void evp_reuse(run *r)
{
    for (size_t i = 0; i < r->blocks; i++) {
        EVP_DigestInit_ex2(r->ctx, r->md, NULL);
        EVP_DigestUpdate(r->ctx, r->salt, r->salt_size);
        EVP_DigestUpdate(r->ctx, r->data + i * r->block_size, r->block_size);
        EVP_DigestFinal_ex(r->ctx, r->out + 32 * i, NULL);
    }
}

static void shani(run *r)
{
    sha256x_slots(r->fast, r->data, r->blocks, r->block_size, r->out, 32);
}

#define MAX_ROUNDS 1000

typedef struct {
    const char *name;
    void (*method)(run *);
    sha256x *fast;   /* shani: its state, else NULL */
    double rates[MAX_ROUNDS];
} method;

/* MB/s of one slice of a method; the answer must be SHA-256 (check, when given). */
static double slice(method *m, run *r, double seconds, const unsigned char *check)
{
    r->fast = m->fast;
    m->method(r);
    if (check != NULL && memcmp(r->out, check, 32 * r->blocks) != 0) {
        fprintf(stderr, "%s: digests differ from evp-new\n", m->name);
        exit(1);
    }
    size_t rounds = 0;
    double start = now(), elapsed;
    do {
        m->method(r);
        rounds++;
    } while ((elapsed = now() - start) < seconds);
    return (double)(rounds * r->blocks * r->block_size) / elapsed / 1e6;
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: %s SLICE ROUNDS BLOCK_SIZE BLOCKS SALT_SIZE\n", argv[0]);
        return 2;
    }
    double seconds = atof(argv[1]);
    int rounds = atoi(argv[2]);
    if (rounds < 1 || rounds > MAX_ROUNDS)
        rounds = rounds < 1 ? 1 : MAX_ROUNDS;
    run r = {.block_size = strtoul(argv[3], NULL, 10), .blocks = strtoul(argv[4], NULL, 10),
             .salt_size = strtoul(argv[5], NULL, 10)};
    unsigned char *data = malloc(r.block_size * r.blocks), *salt = malloc(r.salt_size + 1);
    unsigned char *check = malloc(32 * r.blocks);
    r.out = malloc(32 * r.blocks);
    srand(1);
    for (size_t i = 0; i < r.block_size * r.blocks; i++)
        data[i] = (unsigned char)rand();
    for (size_t i = 0; i < r.salt_size; i++)
        salt[i] = (unsigned char)rand();
    r.data = data;
    r.salt = salt;
    r.md = EVP_sha256();
    r.ctx = EVP_MD_CTX_new();
    r.base = EVP_MD_CTX_new();
    EVP_DigestInit_ex(r.base, r.md, NULL);
    EVP_DigestUpdate(r.base, salt, r.salt_size);
    evp_new(&r);
    memcpy(check, r.out, 32 * r.blocks);
    static method methods[] = {
        {"evp-digest", evp_digest, NULL, {0}}, {"evp-new", evp_new, NULL, {0}},
        {"evp-copy", evp_copy, NULL, {0}},     {"evp-reuse", evp_reuse, NULL, {0}},
        {"shani-x1", shani, NULL, {0}},        {"shani-x2", shani, NULL, {0}},
        {"shani-x3", shani, NULL, {0}},
    };
    int count = (int)(sizeof methods / sizeof methods[0]);
    for (int lanes = 1; lanes <= SHA256X_MAX_LANES; lanes++)
        methods[3 + lanes].fast = sha256x_new(salt, r.salt_size, 1, lanes);
    for (int k = 0; k < rounds; k++)
        for (int i = 0; i < count; i++)
            if (methods[i].method != shani || methods[i].fast != NULL)
                methods[i].rates[k] = slice(&methods[i], &r, seconds,
                                            methods[i].method == evp_digest ? NULL : check);
    for (int i = 0; i < count; i++) {
        if (methods[i].method == shani && methods[i].fast == NULL) {
            printf("%s -\n", methods[i].name);  /* no SHA extensions here */
            continue;
        }
        qsort(methods[i].rates, (size_t)rounds, sizeof(double), by_value);
        printf("%s %.1f\n", methods[i].name, methods[i].rates[rounds / 2]);
        sha256x_free(methods[i].fast);
    }
    return 0;
}
