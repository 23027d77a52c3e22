/* sha256x: salted SHA-256 of runs of equal-sized blocks on the x86 SHA extensions,
 * one, two or three messages interleaved (sha256x.c; FIPS 180-4).
 *
 * No Python here: _native.c hands a Hasher's run to sha256x_slots or sha256x_verify
 * when the Hasher has a sha256x state, and keeps its OpenSSL EVP loop otherwise.
 * sha256x_py.c adds the module-level switches and counters.
 */

#ifndef NBD_VERITY_SHA256X_H
#define NBD_VERITY_SHA256X_H

#include <stddef.h>
#include <sys/types.h>

#define SHA256X_DIGEST_SIZE 32
#define SHA256X_MAX_SALT 256
#define SHA256X_MAX_LANES 3
#define SHA256X_NO_SHANI_ENV "NBD_VERITY_NO_SHANI"  /* set to 1: every Hasher on EVP */

typedef struct sha256x sha256x;

/* Whether this CPU has the SHA extensions and SSE4.1 (CPUID leaf 7 EBX bit 29, leaf 1
 * ECX bits 9 and 19). */
int sha256x_cpu_has_sha(void);

/* Streams a new sha256x state uses by default: 2 on a CPU with the SHA extensions, 0
 * (OpenSSL's EVP path) without them or when NBD_VERITY_NO_SHANI=1; read once. */
int sha256x_default_lanes(void);

/* The state for one device: the salt absorbed first (format 1, salt_first) or kept to
 * be hashed last (format 0), hashing `lanes` (1..3) messages at once. NULL when the CPU
 * lacks the extensions or NBD_VERITY_NO_SHANI=1 (sha256x_default_lanes() is 0), lanes is
 * out of range, or on out of memory. */
sha256x *sha256x_new(const unsigned char *salt, size_t salt_size, int salt_first, int lanes);
void sha256x_free(sha256x *s);
int sha256x_lanes(const sha256x *s);

/* The salted digests of `blocks` blocks of block_size bytes each, into out at
 * slot_size apart (slot_size >= 32; the bytes of a slot past the digest are zeroed). */
void sha256x_slots(const sha256x *s, const unsigned char *data, size_t blocks,
                   size_t block_size, unsigned char *out, size_t slot_size);

/* The index of the first block whose digest differs from the first 32 bytes of its slot
 * in expected (slot_size apart), or -1 when every block matches. */
ssize_t sha256x_verify(const sha256x *s, const unsigned char *data, size_t blocks,
                       size_t block_size, const unsigned char *expected, size_t slot_size);

/* Messages hashed so far by calls of 1, 2 and 3 streams (counts[0..2]), process-wide:
 * proof that the SHA-extension code ran, not a fallback. Counted only while
 * sha256x_set_counting(1) is in force (off by default: no shared cache line per call). */
void sha256x_counts(unsigned long long counts[SHA256X_MAX_LANES]);
void sha256x_set_counting(int on);

#endif
