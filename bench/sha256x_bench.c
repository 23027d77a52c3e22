/* bench/sha256x_bench.c: MB/s of salted SHA-256 of 4 KiB blocks on one core, by method.
 *
 * Built and run by bench/sha256x.py (gcc, with nbd_verity/format/sha256x.c and libcrypto).
 * Every method hashes the same buffer of blocks, salt first (format 1), repeatedly for
 * about `seconds`; each prints one line "method MB/s". The methods:
 *   evp-digest  EVP_Digest of the block alone (one call per block, no salt: a reference)
 *   evp-new     EVP_MD_CTX_new, Init, Update salt, Update block, Final, free per block
 *               (a new context each call, as EVP_Digest does)
 *   evp-copy    _native.c's EVP loop: one context per run, EVP_MD_CTX_copy_ex from the
 *               pre-salted base per block
 *   evp-reuse   one reused context: EVP_DigestInit_ex2, Update salt, Update block, Final
 *   shani-x1..3 sha256x_slots with 1, 2 or 3 interleaved streams
 * Usage: sha256x_bench SECONDS BLOCK_SIZE BLOCKS SALT_SIZE
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

static void measure(const char *name, void (*method)(run *), run *r, double seconds,
                    const unsigned char *check)
{
    method(r);  /* warm-up, and the answer must be SHA-256 */
    if (check != NULL && memcmp(r->out, check, 32 * r->blocks) != 0) {
        fprintf(stderr, "%s: digests differ from evp-new\n", name);
        exit(1);
    }
    size_t rounds = 0;
    double start = now(), elapsed;
    do {
        method(r);
        rounds++;
    } while ((elapsed = now() - start) < seconds);
    printf("%s %.1f\n", name, (double)(rounds * r->blocks * r->block_size) / elapsed / 1e6);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: %s SECONDS BLOCK_SIZE BLOCKS SALT_SIZE\n", argv[0]);
        return 2;
    }
    double seconds = atof(argv[1]);
    run r = {.block_size = strtoul(argv[2], NULL, 10), .blocks = strtoul(argv[3], NULL, 10),
             .salt_size = strtoul(argv[4], NULL, 10)};
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
    measure("evp-digest", evp_digest, &r, seconds, NULL);
    measure("evp-new", evp_new, &r, seconds, check);
    measure("evp-copy", evp_copy, &r, seconds, check);
    measure("evp-reuse", evp_reuse, &r, seconds, check);
    for (int lanes = 1; lanes <= SHA256X_MAX_LANES; lanes++) {
        char name[16];
        snprintf(name, sizeof name, "shani-x%d", lanes);
        if ((r.fast = sha256x_new(salt, r.salt_size, 1, lanes)) == NULL) {
            printf("%s -\n", name);  /* no SHA extensions here */
            continue;
        }
        measure(name, shani, &r, seconds, check);
        sha256x_free(r.fast);
    }
    return 0;
}
