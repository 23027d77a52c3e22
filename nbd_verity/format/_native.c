/* nbd_verity.format._native: the hot loops of verification on OpenSSL's EVP API.
 *
 * Python decides which blocks, which leaf and what an error means; this module only
 * touches every byte: the salted digests of a run of data blocks, their comparison with
 * the trusted slots of a level-0 hash block, and a read straight into the caller's
 * buffer followed by that check. nbd_verity/digest.py is the reference (format 1 hashes
 * salt || block with the salt absorbed once, as the kernel's pre-salted state; format 0
 * hashes block || salt; slots are padded to a power of two in format 1, packed in 0).
 *
 * The GIL is released once per call when the run is at least release_size bytes, and
 * kept below that: for short runs a hand-over costs more than the hashing it lets run
 * elsewhere (DEFAULT_RELEASE_SIZE says where the two meet, as measured).
 *
 * nbd_read_verify does for a read over NBD what read_verify does for a file: the read on
 * a connection of the caller's (libnbd's asynchronous API, on the handle Python's nbd
 * module made), its wait and the check, in one call with the GIL released once. libnbd
 * is the one the nbd module loaded: its functions are looked up there (dlopen with
 * RTLD_NOLOAD), never linked, so the module builds and loads without libnbd.
 *
 * FastRead is the one place where this module does more than touch bytes: the fast path of
 * a local file (serve/fastpath.py) in one native frame, its bookkeeping included, because
 * every bytecode of it held the GIL that the other requests' threads wait for. The Python
 * function it mirrors decides everything it does not (and is the tests' reference).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/uio.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "sha256x.h"     /* SHA-256 on the SHA extensions, interleaved (sha256x.c) */
#include "sha256x_py.h"

#define MAX_SALT_SIZE 256
#define READ_FAILED (-2)     /* read_verify: the read failed or ended early */
#define DIGEST_FAILED (-3)   /* an EVP call failed (out of memory, provider error) */
#define RAISED (-4)          /* verify_buffer: a Python exception is set */
/* Runs of at least this many bytes are hashed with the GIL released. Measured under nbdkit
 * (bench/native_gil.py: fio, 8 jobs x QD1 random reads, 2 cores, MB/s median of 3-4
 * rounds, GIL always released vs never): 4 KiB 37 vs 41, 16 KiB 133 vs 138, 32 KiB 249
 * vs 259, 64 KiB 352-382 vs 350-366, 128 KiB 547 vs 465, 256 KiB 599 vs 500. Holding
 * wins up to 32 KiB, releasing from 64 KiB on. */
#define DEFAULT_RELEASE_SIZE (64 * 1024)
/* A file whose pages are not in the page cache lately (NOWAIT_MISSES RWF_NOWAIT reads in
 * a row came back short) is read for its next NOWAIT_SKIP short reads with the GIL
 * released at once, without asking: a read that misses starts the disk's I/O inside the
 * syscall, GIL held, and every other request waits for it. Measured with 4 KiB random
 * reads from one connection at QD16 on an uncached disk (2 cores): bench/passthrough.py
 * with such a first read added gets 0.45-0.51 of nbdkit's C file plugin, as it is
 * 0.67-0.74. Then it asks once: a cached answer ends the skipping (a page-cached workload
 * keeps its reads under the GIL), a miss skips twice as many reads as the last time, up to
 * NOWAIT_SKIP_MAX. With 4 asks in every 68 reads, those asks held the GIL for about 40% of
 * the time any thread held it (py-spy --gil, the same workload served by nbd-verity). */
#define NOWAIT_MISSES 4
#define NOWAIT_SKIP 64
#define NOWAIT_SKIP_MAX 4096

typedef struct {
    PyObject_HEAD
    EVP_MD *fetched;     /* the digest, fetched once (owned) */
    EVP_MD_CTX *base;    /* format 1: salt absorbed; format 0: freshly initialised */
    unsigned char salt[MAX_SALT_SIZE];
    Py_ssize_t salt_size;
    int hash_type;
    int digest_size;
    int slot_size;       /* digest_size padded to a power of two (format 1) or not (0) */
    Py_ssize_t release_size;
    sha256x *fast;       /* sha256 on the SHA extensions (owned), or NULL: the EVP loops */
    int lanes;           /* messages fast hashes at once; 0 without it */
    int nowait_refused;  /* preadv2 said RWF_NOWAIT is not supported here: never again ask */
    int nowait_misses;   /* RWF_NOWAIT reads in a row that found their pages not cached */
    int nowait_skip;     /* short reads left that go to the disk without asking first */
    int nowait_backoff;  /* the last skip's length while asks keep missing; 0: not skipping */
} Hasher;

static int next_pow2(int n)
{
    int p = 1;
    while (p < n)
        p <<= 1;
    return p;
}

/* The digest of one input of any length into out (digest_size bytes); 0 or -1. */
static int hash_one(const Hasher *self, EVP_MD_CTX *ctx, const unsigned char *data,
                    size_t size, unsigned char *out)
{
    if (!EVP_MD_CTX_copy_ex(ctx, self->base) || !EVP_DigestUpdate(ctx, data, size))
        return -1;
    if (self->hash_type == 0 && self->salt_size > 0 &&
        !EVP_DigestUpdate(ctx, self->salt, (size_t)self->salt_size))
        return -1;
    return EVP_DigestFinal_ex(ctx, out, NULL) ? 0 : -1;
}

/* Slots of `blocks` blocks into out (blocks * slot_size bytes, padding zeroed). */
static int slots_run(const Hasher *self, EVP_MD_CTX *ctx, const unsigned char *data,
                     Py_ssize_t blocks, Py_ssize_t block_size, unsigned char *out)
{
    if (self->fast != NULL) {  /* sha256x hook */
        sha256x_slots(self->fast, data, (size_t)blocks, (size_t)block_size, out,
                      (size_t)self->slot_size);
        return 0;
    }
    for (Py_ssize_t i = 0; i < blocks; i++) {
        unsigned char *slot = out + i * self->slot_size;
        if (hash_one(self, ctx, data + i * block_size, (size_t)block_size, slot) < 0)
            return DIGEST_FAILED;
        memset(slot + self->digest_size, 0, (size_t)(self->slot_size - self->digest_size));
    }
    return 0;
}

/* The index of the first block whose digest differs from the first digest_size bytes of
 * its slot (padding is not compared, as the kernel's memcmp), -1 if none differs. */
static Py_ssize_t verify_run(const Hasher *self, EVP_MD_CTX *ctx, const unsigned char *data,
                             Py_ssize_t blocks, Py_ssize_t block_size,
                             const unsigned char *expected)
{
    if (self->fast != NULL)  /* sha256x hook */
        return sha256x_verify(self->fast, data, (size_t)blocks, (size_t)block_size,
                              expected, (size_t)self->slot_size);
    unsigned char md[EVP_MAX_MD_SIZE];
    for (Py_ssize_t i = 0; i < blocks; i++) {
        if (hash_one(self, ctx, data + i * block_size, (size_t)block_size, md) < 0)
            return DIGEST_FAILED;
        if (memcmp(md, expected + i * self->slot_size, (size_t)self->digest_size) != 0)
            return i;
    }
    return -1;
}

/* Fill size bytes at offset, retrying short reads and EINTR: 0, or -1 (errno or EOF). */
static int read_full(int fd, unsigned char *p, size_t size, off_t offset)
{
    while (size > 0) {
        ssize_t n = pread(fd, p, size, offset);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        size -= (size_t)n;
        offset += n;
    }
    return 0;
}

/* One digest context per thread, made on the thread's first call and freed when the
 * thread ends. nbdkit calls pread from several threads at once, so a context cannot be
 * the Hasher's; making one per call cost an allocation per request. A context belongs
 * to no Hasher: hash_one copies the Hasher's base state into it before every digest.
 * Called with the GIL held (it may set MemoryError). */
static pthread_key_t ctx_key;
static pthread_once_t ctx_once = PTHREAD_ONCE_INIT;
static int ctx_key_made;

static void free_thread_ctx(void *ctx)
{
    EVP_MD_CTX_free(ctx);
}

static void make_ctx_key(void)
{
    ctx_key_made = pthread_key_create(&ctx_key, free_thread_ctx) == 0;
}

static EVP_MD_CTX *thread_ctx(void)
{
    pthread_once(&ctx_once, make_ctx_key);
    EVP_MD_CTX *ctx = ctx_key_made ? pthread_getspecific(ctx_key) : NULL;
    if (ctx != NULL || !ctx_key_made)
        goto out;
    if ((ctx = EVP_MD_CTX_new()) != NULL && pthread_setspecific(ctx_key, ctx) != 0) {
        EVP_MD_CTX_free(ctx);
        ctx = NULL;
    }
out:
    if (ctx == NULL)
        PyErr_NoMemory();
    return ctx;
}

/* Whether a fast call got exactly `want` positional arguments (else TypeError). */
static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
    return -1;
}

static PyObject *digest_error(void)
{
    PyErr_SetString(PyExc_RuntimeError, "OpenSSL digest failed");
    return NULL;
}

/* -- the Hasher type ------------------------------------------------------------------ */

/* Validate every argument and build the digest state in locals; only a call that
 * succeeds sets the object, so a failed __init__ leaves it not ready (check_ready). */
static int Hasher_init(Hasher *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"algorithm", "salt", "hash_type", "lanes", NULL};
    const char *name;
    Py_buffer salt;
    int hash_type, lanes = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sy*i|i", keywords, &name, &salt,
                                     &hash_type, &lanes))
        return -1;
    int ok = -1;
    EVP_MD *fetched = NULL;
    EVP_MD_CTX *base = NULL;
    if (self->base != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Hasher is already initialised");
        goto done;
    }
    /* Python validates the parameters once (params.py); these guard this type's memory. */
    if (hash_type != 0 && hash_type != 1) {
        PyErr_Format(PyExc_ValueError, "hash_type %d: not 0 or 1", hash_type);
        goto done;
    }
    if (salt.len > MAX_SALT_SIZE) {
        PyErr_Format(PyExc_ValueError, "salt of %zd bytes exceeds %d", salt.len, MAX_SALT_SIZE);
        goto done;
    }
    fetched = EVP_MD_fetch(NULL, name, NULL);
    base = EVP_MD_CTX_new();
    /* An algorithm OpenSSL names but cannot run (for example one that needs the legacy
     * provider) fails here, at construction, so Python can fall back to hashlib. */
    if (fetched == NULL || base == NULL || !EVP_DigestInit_ex(base, fetched, NULL) ||
        EVP_MD_get_size(fetched) <= 0 || EVP_MD_get_size(fetched) > EVP_MAX_MD_SIZE) {
        PyErr_Format(PyExc_ValueError, "OpenSSL has no usable digest %s", name);
        goto done;
    }
    if (hash_type == 1 && salt.len > 0 && !EVP_DigestUpdate(base, salt.buf, (size_t)salt.len)) {
        digest_error();
        goto done;
    }
    /* sha256x hook: lanes -1 takes sha256x_default_lanes(), 0 the EVP loops, 1-3 asks
     * for that many streams on the SHA extensions (ValueError if they cannot run). */
    lanes = lanes < 0 && EVP_MD_is_a(fetched, "SHA2-256") ? sha256x_default_lanes() : lanes;
    if (lanes > 0 && (!EVP_MD_is_a(fetched, "SHA2-256") ||
                      (self->fast = sha256x_new(salt.buf, (size_t)salt.len, hash_type == 1,
                                                lanes)) == NULL)) {
        PyErr_Format(PyExc_ValueError, "lanes %d: no SHA-extension path for %s here",
                     lanes, name);
        goto done;
    }
    self->lanes = self->fast != NULL ? lanes : 0;
    memcpy(self->salt, salt.buf, (size_t)salt.len);
    self->salt_size = salt.len;
    self->hash_type = hash_type;
    self->digest_size = EVP_MD_get_size(fetched);
    self->slot_size = hash_type == 1 ? next_pow2(self->digest_size) : self->digest_size;
    self->release_size = DEFAULT_RELEASE_SIZE;
    self->fetched = fetched;  /* the object owns them from here */
    self->base = base;
    fetched = NULL;
    base = NULL;
    ok = 0;
done:
    EVP_MD_CTX_free(base);
    EVP_MD_free(fetched);
    PyBuffer_Release(&salt);
    return ok;
}

static void Hasher_dealloc(Hasher *self)
{
    sha256x_free(self->fast);
    EVP_MD_CTX_free(self->base);
    EVP_MD_free(self->fetched);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_ready(const Hasher *self)
{
    if (self->base == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Hasher is not initialised");
        return -1;
    }
    return 0;
}

/* Number of whole blocks in a buffer, checking the block size and the expected slots. */
static Py_ssize_t run_blocks(const Hasher *self, Py_ssize_t size, Py_ssize_t block_size,
                             const Py_buffer *expected, int whole)
{
    if (block_size <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size %zd: not positive", block_size);
        return -1;
    }
    if (whole && size % block_size) {
        PyErr_Format(PyExc_ValueError, "buffer of %zd bytes is not a multiple of %zd",
                     size, block_size);
        return -1;
    }
    Py_ssize_t blocks = size / block_size;
    if (expected != NULL && expected->len < blocks * self->slot_size) {
        PyErr_Format(PyExc_ValueError, "%zd blocks need %zd bytes of slots, %zd given", blocks,
                     blocks * self->slot_size, expected->len);
        return -1;
    }
    return blocks;
}

PyDoc_STRVAR(digest_doc, "digest(buf) -> bytes: the salted digest of buf, any length.");

static PyObject *Hasher_digest(Hasher *self, PyObject *arg)
{
    Py_buffer buf;
    unsigned char md[EVP_MAX_MD_SIZE];
    if (check_ready(self) < 0 || PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    EVP_MD_CTX *ctx = thread_ctx();
    if (ctx == NULL) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    int rc;
    if (buf.len >= self->release_size) {
        Py_BEGIN_ALLOW_THREADS
        rc = hash_one(self, ctx, buf.buf, (size_t)buf.len, md);
        Py_END_ALLOW_THREADS
    } else {
        rc = hash_one(self, ctx, buf.buf, (size_t)buf.len, md);
    }
    PyBuffer_Release(&buf);
    if (rc < 0)
        return digest_error();
    return PyBytes_FromStringAndSize((const char *)md, self->digest_size);
}

PyDoc_STRVAR(slots_doc,
"slots(buf, block_size) -> bytes: the slots of every whole block of buf, a run of blocks.");

static PyObject *Hasher_slots(Hasher *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer buf;
    Py_ssize_t block_size;
    if (check_ready(self) < 0 || check_nargs("slots", nargs, 2) < 0)
        return NULL;
    if ((block_size = PyLong_AsSsize_t(args[1])) == -1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = NULL;
    EVP_MD_CTX *ctx = NULL;
    Py_ssize_t blocks = run_blocks(self, buf.len, block_size, NULL, 0);
    if (blocks < 0)
        goto done;
    if ((ctx = thread_ctx()) == NULL)
        goto done;
    if ((out = PyBytes_FromStringAndSize(NULL, blocks * self->slot_size)) == NULL)
        goto done;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    int rc;
    if (blocks * block_size >= self->release_size) {
        Py_BEGIN_ALLOW_THREADS
        rc = slots_run(self, ctx, buf.buf, blocks, block_size, dst);
        Py_END_ALLOW_THREADS
    } else {
        rc = slots_run(self, ctx, buf.buf, blocks, block_size, dst);
    }
    if (rc < 0) {
        Py_CLEAR(out);
        digest_error();
    }
done:
    PyBuffer_Release(&buf);
    return out;
}

/* Verify a run held in memory; returns the verdict, or RAISED with an exception set. */
static Py_ssize_t verify_buffer(Hasher *self, const Py_buffer *buf, Py_ssize_t block_size,
                                const Py_buffer *expected)
{
    Py_ssize_t blocks = run_blocks(self, buf->len, block_size, expected, 1);
    if (blocks < 0)
        return RAISED;
    EVP_MD_CTX *ctx = thread_ctx();
    if (ctx == NULL)
        return RAISED;
    Py_ssize_t verdict;
    if (buf->len >= self->release_size) {
        Py_BEGIN_ALLOW_THREADS
        verdict = verify_run(self, ctx, buf->buf, blocks, block_size, expected->buf);
        Py_END_ALLOW_THREADS
    } else {
        verdict = verify_run(self, ctx, buf->buf, blocks, block_size, expected->buf);
    }
    if (verdict == DIGEST_FAILED) {
        digest_error();
        return RAISED;
    }
    return verdict;
}

PyDoc_STRVAR(verify_doc,
"verify(buf, block_size, expected_slots) -> int: -1 if every block of buf matches its\n"
"slot (first digest_size bytes), else the index of the first block that differs.");

static PyObject *Hasher_verify(Hasher *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer buf, expected;
    Py_ssize_t block_size;
    if (check_ready(self) < 0 || check_nargs("verify", nargs, 3) < 0)
        return NULL;
    if ((block_size = PyLong_AsSsize_t(args[1])) == -1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[2], &expected, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    Py_ssize_t verdict = verify_buffer(self, &buf, block_size, &expected);
    PyBuffer_Release(&expected);
    PyBuffer_Release(&buf);
    return verdict == RAISED ? NULL : PyLong_FromSsize_t(verdict);
}

/* A run that a call reads into and verifies: the caller's writable buffer, the slots it
 * is checked against (from slot_offset on) and the digest context hashing it needs. */
typedef struct {
    Py_buffer buf, expected;
    const unsigned char *slots;
    long long offset;
    Py_ssize_t block_size, blocks;
    EVP_MD_CTX *ctx;
} Run;

static void release_run(Run *run)
{
    PyBuffer_Release(&run->expected);
    PyBuffer_Release(&run->buf);
}

/* Take a read-and-verify call's buffer, offset, block size and slots into run: 0, or -1
 * with an exception set and nothing held (release_run() after 0). */
static int take_run(Hasher *self, PyObject *buf, PyObject *offset, PyObject *block_size,
                    PyObject *expected, Py_ssize_t slot_offset, Run *run)
{
    if ((run->offset = PyLong_AsLongLong(offset)) == -1 && PyErr_Occurred())
        return -1;
    if ((run->block_size = PyLong_AsSsize_t(block_size)) == -1 && PyErr_Occurred())
        return -1;
    if (run->offset < 0) {
        PyErr_SetString(PyExc_ValueError, "offset is negative");
        return -1;
    }
    if (PyObject_GetBuffer(buf, &run->buf, PyBUF_WRITABLE) < 0)
        return -1;
    if (PyObject_GetBuffer(expected, &run->expected, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&run->buf);
        return -1;
    }
    run->ctx = NULL;
    if (slot_offset < 0 || slot_offset > run->expected.len) {
        PyErr_Format(PyExc_ValueError, "slot_offset %zd is outside the %zd bytes of slots",
                     slot_offset, run->expected.len);
        goto fail;
    }
    Py_buffer slots = run->expected;  /* the slots from slot_offset on */
    slots.buf = (unsigned char *)run->expected.buf + slot_offset;
    slots.len = run->expected.len - slot_offset;
    run->slots = slots.buf;
    run->blocks = run_blocks(self, run->buf.len, run->block_size, &slots, 1);
    /* The SHA-NI path needs no EVP context: fetch the thread's only for the EVP loops. */
    if (run->blocks < 0 || (self->fast == NULL && (run->ctx = thread_ctx()) == NULL))
        goto fail;
    return 0;
fail:
    release_run(run);
    return -1;
}

PyDoc_STRVAR(read_verify_doc,
"read_verify(fd, buf, offset, block_size, expected_slots[, slot_offset]) -> int\n\n"
"Fill the writable buf from fd at offset, then verify it as verify() does against the\n"
"slots from slot_offset on (default 0: a whole leaf is passed, never a slice). Returns the\n"
"verdict, or READ_FAILED when the read failed or the file ended first (the caller\n"
"reads again itself to report exactly what went wrong).\n"
"A short run whose pages are cached is read with RWF_NOWAIT while the GIL is held; the\n"
"GIL is released for a long run, and for a read that would wait for the disk.");

/* read_verify's read and check of a taken run: the verdict, READ_FAILED or DIGEST_FAILED
 * (no exception set). Called with the GIL held; releases it as read_verify_doc says. */
static Py_ssize_t read_verify_run(Hasher *self, int fd, Run *run)
{
    unsigned char *p = run->buf.buf;
    size_t size = (size_t)run->buf.len, got = 0;
    int release = run->buf.len >= self->release_size;
    Py_ssize_t verdict = -1;
    int ask = !release && !self->nowait_refused;
    if (ask && self->nowait_skip > 0) {  /* the file is not cached lately (NOWAIT_MISSES) */
        self->nowait_skip--;
        ask = 0;
    }
    if (ask) {
        /* Cached pages come back without sleeping; anything else (EAGAIN, a partial read,
         * a file system without RWF_NOWAIT) is read below with the GIL released. A file
         * system that refuses the flag (EOPNOTSUPP) is not asked again by this hasher:
         * one device, one data image, one answer. The GIL is held here, so the counts
         * are not raced. */
        struct iovec iov = {p, size};
        ssize_t n = preadv2(fd, &iov, 1, (off_t)run->offset, RWF_NOWAIT);
        if (n < 0 && errno == EOPNOTSUPP)
            self->nowait_refused = 1;
        got = n > 0 ? (size_t)n : 0;
        if (got == size) {
            self->nowait_misses = 0;
            self->nowait_backoff = 0;
        } else if (self->nowait_backoff > 0) {  /* the one ask after a skip missed too */
            if (self->nowait_backoff < NOWAIT_SKIP_MAX)
                self->nowait_backoff *= 2;
            self->nowait_skip = self->nowait_backoff;
        } else if (++self->nowait_misses >= NOWAIT_MISSES) {
            self->nowait_misses = 0;
            self->nowait_skip = self->nowait_backoff = NOWAIT_SKIP;
        }
    }
    if (release || got < size) {
        /* A long run, or one read from the disk: hashed too while the GIL is released
         * (for the read, it is anyway: holding it again to hash only makes the other
         * requests wait once more). */
        Py_BEGIN_ALLOW_THREADS
        if (read_full(fd, p + got, size - got, (off_t)run->offset + (off_t)got) < 0)
            verdict = READ_FAILED;
        else
            verdict = verify_run(self, run->ctx, p, run->blocks, run->block_size, run->slots);
        Py_END_ALLOW_THREADS
        return verdict;
    }
    /* a short run found in the page cache: hashed with the GIL held */
    return verify_run(self, run->ctx, p, run->blocks, run->block_size, run->slots);
}

/* fd as an int, or -1 with ValueError set. */
static int take_fd(PyObject *arg)
{
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return -1;
    if (fd < 0 || fd > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "fd is not a file descriptor");
        return -1;
    }
    return (int)fd;
}

static PyObject *Hasher_read_verify(Hasher *self, PyObject *const *args, Py_ssize_t nargs)
{
    int fd;
    Py_ssize_t slot_offset = 0;
    Run run;
    if (check_ready(self) < 0)
        return NULL;
    if (nargs != 6 && check_nargs("read_verify", nargs, 5) < 0)
        return NULL;
    if (nargs == 6 && (slot_offset = PyLong_AsSsize_t(args[5])) == -1 && PyErr_Occurred())
        return NULL;
    if ((fd = take_fd(args[0])) < 0)
        return NULL;
    if (take_run(self, args[1], args[2], args[3], args[4], slot_offset, &run) < 0)
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t verdict = read_verify_run(self, fd, &run);
    if (verdict == DIGEST_FAILED)
        digest_error();
    else
        result = PyLong_FromSsize_t(verdict);
    release_run(&run);
    return result;
}


/* -- Reads over NBD ---------------------------------------------------------------------
 * libnbd's functions as its manual declares them (libnbd(3), nbd_aio_pread(3)): a stable
 * ABI since libnbd 1.0. They are found in the libnbd that Python's nbd module loaded. */
typedef struct {
    int (*callback)(void *user_data, int *error);
    void *user_data;
    void (*free)(void *user_data);
} nbd_completion;

struct nbd_handle;
static struct {
    int64_t (*aio_pread)(struct nbd_handle *, void *, size_t, uint64_t, nbd_completion,
                         uint32_t);
    int (*aio_command_completed)(struct nbd_handle *, uint64_t);
    int (*poll)(struct nbd_handle *, int);
    const char *(*get_error)(void);
    int (*get_errno)(void);
} nbd_api;
static int nbd_api_state;  /* 0: not looked up yet, 1: found, -1: not there */

#define NBD_HANDLE_CAPSULE "nbd_handle"  /* the name Python's nbd module gives its handles */

/* Look libnbd's functions up in the copy already loaded (by `import nbd`); 1 or 0.
 * Called with the GIL held: the lookup happens once. */
static int nbd_api_ready(void)
{
    if (nbd_api_state != 0)
        return nbd_api_state > 0;
    nbd_api_state = -1;
    void *lib = dlopen("libnbd.so.0", RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        return 0;
    *(void **)&nbd_api.aio_pread = dlsym(lib, "nbd_aio_pread");
    *(void **)&nbd_api.aio_command_completed = dlsym(lib, "nbd_aio_command_completed");
    *(void **)&nbd_api.poll = dlsym(lib, "nbd_poll");
    *(void **)&nbd_api.get_error = dlsym(lib, "nbd_get_error");
    *(void **)&nbd_api.get_errno = dlsym(lib, "nbd_get_errno");
    /* the library stays loaded: the nbd module holds it, and so does this reference */
    if (nbd_api.aio_pread && nbd_api.aio_command_completed && nbd_api.poll &&
        nbd_api.get_error && nbd_api.get_errno)
        nbd_api_state = 1;
    return nbd_api_state > 0;
}

PyDoc_STRVAR(nbd_ready_doc,
"nbd_ready() -> bool: whether nbd_read_verify can run here (the libnbd that Python's nbd\n"
"module loaded has the functions it calls; import nbd first).");

static PyObject *nbd_ready(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    return PyBool_FromLong(nbd_api_ready());
}

PyDoc_STRVAR(nbd_read_verify_doc,
"nbd_read_verify(handle, buf, offset, block_size, expected_slots, slot_offset, slice_ms)\n"
"-> int | tuple\n\n"
"Read len(buf) bytes at offset into the writable buf on an NBD connection (handle: the\n"
"_o of an nbd.NBD, connected, no command in flight), wait up to slice_ms for the reply,\n"
"then verify buf as verify() does against the slots from slot_offset on, all with the\n"
"GIL released once. Returns the verdict (-1, or the index of the first block that\n"
"differs); (cookie,) when no reply came within slice_ms: the read is in flight, and the\n"
"caller waits for it with the nbd module (the bytes are not verified then); or\n"
"(errno, message) when libnbd failed the read or the wait (the connection may be dead,\n"
"or the read still in flight if the wait failed: ask it).");

static PyObject *Hasher_nbd_read_verify(Hasher *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot_offset;
    long slice_ms;
    Run run;
    if (check_ready(self) < 0 || check_nargs("nbd_read_verify", nargs, 7) < 0)
        return NULL;
    if (!nbd_api_ready()) {
        PyErr_SetString(PyExc_RuntimeError, "libnbd is not loaded: import nbd first");
        return NULL;
    }
    struct nbd_handle *h = PyCapsule_GetPointer(args[0], NBD_HANDLE_CAPSULE);
    if (h == NULL)
        return NULL;
    if ((slot_offset = PyLong_AsSsize_t(args[5])) == -1 && PyErr_Occurred())
        return NULL;
    if ((slice_ms = PyLong_AsLong(args[6])) == -1 && PyErr_Occurred())
        return NULL;
    if (slice_ms < 0 || slice_ms > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "slice_ms out of range");
        return NULL;
    }
    if (take_run(self, args[1], args[2], args[3], args[4], slot_offset, &run) < 0)
        return NULL;
    PyObject *result = NULL;
    int64_t cookie;
    int state = 0;  /* 1: replied, 0: still in flight, -1: libnbd failed it */
    int error = 0;
    char message[256] = "";
    Py_ssize_t verdict = -1;
    nbd_completion none = {NULL, NULL, NULL};
    Py_BEGIN_ALLOW_THREADS
    cookie = nbd_api.aio_pread(h, run.buf.buf, (size_t)run.buf.len, (uint64_t)run.offset,
                               none, 0);
    if (cookie == -1) {
        state = -1;
    } else {
        int waited = 0;  /* a slice passed without a reply: the caller's deadline from here */
        for (;;) {
            int done = nbd_api.aio_command_completed(h, (uint64_t)cookie);
            if (done != 0) {
                state = done > 0 ? 1 : -1;
                break;
            }
            if (waited)
                break;
            int polled = nbd_api.poll(h, (int)slice_ms);
            if (polled < 0 && nbd_api.get_errno() == EINTR)
                continue;  /* a signal for this thread: the read is still in flight */
            if (polled < 0) {
                state = -1;
                break;
            }
            waited = polled == 0;
        }
    }
    if (state < 0) {  /* libnbd's error is the calling thread's: copy it before the GIL */
        const char *text = nbd_api.get_error();
        error = nbd_api.get_errno();
        snprintf(message, sizeof message, "%s", text != NULL ? text : "read failed");
    } else if (state > 0) {
        verdict = verify_run(self, run.ctx, run.buf.buf, run.blocks, run.block_size,
                             run.slots);
    }
    Py_END_ALLOW_THREADS
    if (state < 0)
        result = Py_BuildValue("(is)", error, message);
    else if (state == 0)
        result = Py_BuildValue("(L)", (long long)cookie);
    else if (verdict == DIGEST_FAILED)
        digest_error();
    else
        result = PyLong_FromSsize_t(verdict);
    release_run(&run);
    return result;
}

static PyMethodDef Hasher_methods[] = {
    {"digest", (PyCFunction)Hasher_digest, METH_O, digest_doc},
    {"slots", (PyCFunction)(void (*)(void))Hasher_slots, METH_FASTCALL, slots_doc},
    {"verify", (PyCFunction)(void (*)(void))Hasher_verify, METH_FASTCALL, verify_doc},
    {"read_verify", (PyCFunction)(void (*)(void))Hasher_read_verify, METH_FASTCALL,
     read_verify_doc},
    {"nbd_read_verify", (PyCFunction)(void (*)(void))Hasher_nbd_read_verify, METH_FASTCALL,
     nbd_read_verify_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Hasher_members[] = {
    {"digest_size", T_INT, offsetof(Hasher, digest_size), READONLY, "bytes of a digest"},
    {"slot_size", T_INT, offsetof(Hasher, slot_size), READONLY, "bytes of a slot"},
    {"hash_type", T_INT, offsetof(Hasher, hash_type), READONLY, "verity format, 0 or 1"},
    {"lanes", T_INT, offsetof(Hasher, lanes), READONLY,
     "sha256 messages hashed at once on the SHA extensions, 0 on OpenSSL's EVP"},
    {"release_size", T_PYSSIZET, offsetof(Hasher, release_size), 0,
     "runs of at least this many bytes are hashed with the GIL released"},
    {"nowait_refused", T_INT, offsetof(Hasher, nowait_refused), READONLY,
     "1 once read_verify's file refused RWF_NOWAIT (it is not asked again)"},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(Hasher_doc,
"Hasher(algorithm, salt, hash_type): salted digests of blocks for one verity device.\n\n"
"algorithm is an OpenSSL digest name (ValueError if OpenSSL cannot compute it).");

static PyTypeObject HasherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nbd_verity.format._native.Hasher",
    .tp_basicsize = sizeof(Hasher),
    .tp_dealloc = (destructor)Hasher_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Hasher_doc,
    .tp_methods = Hasher_methods,
    .tp_members = Hasher_members,
    .tp_init = (initproc)Hasher_init,
    .tp_new = PyType_GenericNew,
};

/* -- The fast path in one native frame ---------------------------------------------------
 * FastRead.read is serve/fastpath.py's fast() for an image in a local file, the same steps
 * in the same order without a Python frame of its own: the request's checks, its leaf
 * from the level-0 LRU, the calling thread's counting rows, one read_verify_run, then the
 * LRU order and the counts. The Python function stays the reference (tests compare both
 * with the general path) and answers every request over its class's threshold (the pool's
 * rule, dispatch.py), which this frame hands it unchanged. Every Python object it touches
 * is the one the Python function touches; the GIL is held throughout, except inside
 * read_verify_run as read_verify releases it. */
typedef struct {
    PyObject_HEAD
    Hasher *hasher;
    int fd;
    int shift;             /* log2 of the data block size */
    int hpb_bits;          /* log2 of the slots in a hash block */
    long long mask;        /* data block size - 1 */
    long long hpb_mask;    /* slots in a hash block - 1 */
    long long leaf_start;  /* level 0's first block number */
    long long sample_mask; /* one request in sample_mask + 1 is timed */
    Py_ssize_t slot_size, io_class, slot;
    PyObject *block_size;  /* the data block size as an int, for take_run */
    PyObject *leaves;      /* level 0's LRU: block number -> the verified block */
    PyObject *dispatcher;  /* its table (a tuple, replaced whole) read per request */
    PyObject *latency;     /* the class's inline latency samples (a bounded deque) */
    PyObject *rows_of;     /* thread ident -> (verified, hits, path): lists, one writer */
    PyObject *rows;        /* rows(): the calling thread's rows, made and kept */
    PyObject *beyond;      /* the Python fast(): a request over its class's threshold */
} FastRead;

static PyObject *str_table, *str_move_to_end, *str_append;

static int FastRead_init(FastRead *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"hasher", "fd", "block_size", "hpb_bits", "slot_size",
                            "leaf_start", "leaves", "dispatcher", "io_class", "slot",
                            "latency", "rows_of", "rows", "sample_every", "beyond", NULL};
    Hasher *hasher;
    PyObject *fd, *leaves, *dispatcher, *latency, *rows_of, *rows, *beyond;
    Py_ssize_t block_size, slot_size, io_class, slot;
    int hpb_bits;
    long long leaf_start, sample_every;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OninLO!OnnOO!OLO:FastRead", names,
                                     &HasherType, &hasher, &fd, &block_size, &hpb_bits,
                                     &slot_size, &leaf_start, &PyDict_Type, &leaves,
                                     &dispatcher, &io_class, &slot, &latency,
                                     &PyDict_Type, &rows_of, &rows, &sample_every, &beyond))
        return -1;
    if (self->hasher != NULL) {  /* a thread may be inside read() with the GIL released */
        PyErr_SetString(PyExc_RuntimeError, "FastRead is already initialised");
        return -1;
    }
    if (check_ready(hasher) < 0 || (self->fd = take_fd(fd)) < 0)
        return -1;
    if (block_size <= 0 || (block_size & (block_size - 1)) || hpb_bits < 0 || hpb_bits > 30 ||
        slot_size <= 0 || leaf_start < 0 || io_class < 0 || slot < 0 || sample_every <= 0 ||
        (sample_every & (sample_every - 1))) {
        PyErr_SetString(PyExc_ValueError, "FastRead: a geometry value is out of range");
        return -1;
    }
    self->shift = 0;
    while (((Py_ssize_t)1 << self->shift) < block_size)
        self->shift++;
    self->hpb_bits = hpb_bits;
    self->mask = block_size - 1;
    self->hpb_mask = (1LL << hpb_bits) - 1;
    self->leaf_start = leaf_start;
    self->sample_mask = sample_every - 1;
    self->slot_size = slot_size;
    self->io_class = io_class;
    self->slot = slot;
    if ((self->block_size = PyLong_FromSsize_t(block_size)) == NULL)
        return -1;
    self->leaves = Py_NewRef(leaves);
    self->dispatcher = Py_NewRef(dispatcher);
    self->latency = Py_NewRef(latency);
    self->rows_of = Py_NewRef(rows_of);
    self->rows = Py_NewRef(rows);
    self->beyond = Py_NewRef(beyond);
    self->hasher = (Hasher *)Py_NewRef((PyObject *)hasher);  /* last: it marks it ready */
    return 0;
}

/* It holds Python objects that may hold it back (a connection's closures, the device's
 * dispatcher): the cycle collector sees what it holds. */
static int FastRead_traverse(FastRead *self, visitproc visit, void *arg)
{
    Py_VISIT(self->hasher);
    Py_VISIT(self->block_size);
    Py_VISIT(self->leaves);
    Py_VISIT(self->dispatcher);
    Py_VISIT(self->latency);
    Py_VISIT(self->rows_of);
    Py_VISIT(self->rows);
    Py_VISIT(self->beyond);
    return 0;
}

static int FastRead_clear(FastRead *self)
{
    Py_CLEAR(self->hasher);
    Py_CLEAR(self->block_size);
    Py_CLEAR(self->leaves);
    Py_CLEAR(self->dispatcher);
    Py_CLEAR(self->latency);
    Py_CLEAR(self->rows_of);
    Py_CLEAR(self->rows);
    Py_CLEAR(self->beyond);
    return 0;
}

static void FastRead_dealloc(FastRead *self)
{
    PyObject_GC_UnTrack(self);
    FastRead_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* list[i] += n for a list of ints (a counting row); 0 or -1. */
static int add_to(PyObject *list, Py_ssize_t i, long long n)
{
    if (!PyList_Check(list) || i >= PyList_GET_SIZE(list)) {
        PyErr_SetString(PyExc_TypeError, "FastRead: a counting row is not a long enough list");
        return -1;
    }
    PyObject *old = PyList_GET_ITEM(list, i);
    long long value = PyLong_AsLongLong(old);
    if (value == -1 && PyErr_Occurred())
        return -1;
    PyObject *sum = PyLong_FromLongLong(value + n);
    if (sum == NULL)
        return -1;
    PyList_SET_ITEM(list, i, sum);
    Py_DECREF(old);
    return 0;
}

static double seconds_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);  /* time.perf_counter's clock */
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

PyDoc_STRVAR(FastRead_read_doc,
"read(buf, offset) -> True when it answered the request (buf filled and verified, counted\n"
"as serve/fastpath.py's fast() counts it), None for the general path; a request over its\n"
"class's threshold is answered by beyond(buf, offset).");

static PyObject *FastRead_read(FastRead *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("read", nargs, 2) < 0)
        return NULL;
    if (self->hasher == NULL) {  /* never initialised, or cleared by the collector */
        PyErr_SetString(PyExc_RuntimeError, "FastRead is not initialised");
        return NULL;
    }
    PyObject *buf = args[0];
    long long offset = PyLong_AsLongLong(args[1]);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t size = PyObject_Length(buf);
    if (size < 0)
        return NULL;
    if ((offset & self->mask) || (size & self->mask) || size == 0 || offset < 0)
        Py_RETURN_NONE;
    PyObject *table = PyObject_GetAttr(self->dispatcher, str_table);
    if (table == NULL)
        return NULL;
    PyObject *limit = PySequence_GetItem(table, self->io_class);
    Py_DECREF(table);
    if (limit == NULL)
        return NULL;
    long long threshold = PyLong_AsLongLong(limit);
    Py_DECREF(limit);
    if (threshold == -1 && PyErr_Occurred())
        return NULL;
    if (size > threshold)  /* the pool's, or inline by the pool's rule: the Python frame's */
        return PyObject_Vectorcall(self->beyond, args, nargs, NULL);
    long long first = offset >> self->shift, blocks = (long long)size >> self->shift;
    long long index = first & self->hpb_mask;
    if (index + blocks > self->hpb_mask + 1)  /* the run spans two leaves */
        Py_RETURN_NONE;
    PyObject *result = NULL, *rows = NULL, *leaf;
    PyObject *block = PyLong_FromLongLong(self->leaf_start + (first >> self->hpb_bits));
    if (block == NULL)
        return NULL;
    leaf = PyDict_GetItemWithError(self->leaves, block);  /* borrowed: held for the read */
    if (leaf == NULL) {
        if (!PyErr_Occurred())
            result = Py_NewRef(Py_None);
        goto done;
    }
    Py_INCREF(leaf);
    PyObject *ident = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    if (ident == NULL)
        goto done_leaf;
    rows = PyDict_GetItemWithError(self->rows_of, ident);
    Py_DECREF(ident);
    if (rows != NULL)
        Py_INCREF(rows);
    else if (PyErr_Occurred() || (rows = PyObject_CallNoArgs(self->rows)) == NULL)
        goto done_leaf;
    if (!PyTuple_Check(rows) || PyTuple_GET_SIZE(rows) != 3 ||
        !PyList_Check(PyTuple_GET_ITEM(rows, 2)) ||
        PyList_GET_SIZE(PyTuple_GET_ITEM(rows, 2)) <= self->slot + 1) {
        PyErr_SetString(PyExc_TypeError, "FastRead: rows() is not (verified, hits, path)");
        goto done_leaf;
    }
    PyObject *verified = PyTuple_GET_ITEM(rows, 0), *hits = PyTuple_GET_ITEM(rows, 1);
    PyObject *path = PyTuple_GET_ITEM(rows, 2);
    long long served = PyLong_AsLongLong(PyList_GET_ITEM(path, self->slot));
    if (served == -1 && PyErr_Occurred())
        goto done_leaf;
    int timed = !(served & self->sample_mask);
    double started = timed ? seconds_now() : 0.0;
    Run run;
    Py_ssize_t slot_offset = (Py_ssize_t)(index * (long long)self->slot_size);
    if (take_run(self->hasher, buf, args[1], self->block_size, leaf, slot_offset, &run) < 0)
        goto done_leaf;
    Py_ssize_t verdict = read_verify_run(self->hasher, self->fd, &run);
    release_run(&run);
    if (verdict == DIGEST_FAILED) {
        digest_error();
        goto done_leaf;
    }
    if (verdict != -1) {  /* a mismatch or a failed read: the general path's, from the start */
        result = Py_NewRef(Py_None);
        goto done_leaf;
    }
    if (timed) {
        PyObject *took = PyFloat_FromDouble(seconds_now() - started);
        PyObject *appended =
            took != NULL ? PyObject_CallMethodOneArg(self->latency, str_append, took) : NULL;
        Py_XDECREF(took);
        if (appended == NULL)
            goto done_leaf;
        Py_DECREF(appended);
    }
    /* as HashBlockCache.get: the LRU order; evicted meanwhile (KeyError) is fine */
    PyObject *moved = PyObject_CallMethodOneArg(self->leaves, str_move_to_end, block);
    if (moved != NULL)
        Py_DECREF(moved);
    else if (PyErr_ExceptionMatches(PyExc_KeyError))
        PyErr_Clear();
    else
        goto done_leaf;
    if (add_to(verified, 0, blocks) < 0 || add_to(hits, 0, 1) < 0 ||
        add_to(path, self->slot, 1) < 0 || add_to(path, self->slot + 1, size) < 0)
        goto done_leaf;
    result = Py_NewRef(Py_True);
done_leaf:
    Py_XDECREF(rows);
    Py_DECREF(leaf);
done:
    Py_DECREF(block);
    return result;
}

static PyMethodDef FastRead_methods[] = {
    {"read", (PyCFunction)(void (*)(void))FastRead_read, METH_FASTCALL, FastRead_read_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(FastRead_doc,
"FastRead(hasher, fd, block_size, hpb_bits, slot_size, leaf_start, leaves, dispatcher,\n"
"         io_class, slot, latency, rows_of, rows, sample_every, beyond)\n\n"
"serve/fastpath.py's fast() for a local file in one native frame (its read method).");

static PyTypeObject FastReadType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nbd_verity.format._native.FastRead",
    .tp_basicsize = sizeof(FastRead),
    .tp_dealloc = (destructor)FastRead_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)FastRead_traverse,
    .tp_clear = (inquiry)FastRead_clear,
    .tp_free = PyObject_GC_Del,
    .tp_doc = FastRead_doc,
    .tp_methods = FastRead_methods,
    .tp_init = (initproc)FastRead_init,
    .tp_new = PyType_GenericNew,
};

/* -- the module ----------------------------------------------------------------------- */

static PyObject *openssl_version(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    return PyUnicode_FromString(OpenSSL_version(OPENSSL_VERSION));
}

static PyMethodDef module_methods[] = {
    {"openssl_version", openssl_version, METH_NOARGS,
     "openssl_version() -> str: the version of the libcrypto in use."},
    {"nbd_ready", nbd_ready, METH_NOARGS, nbd_ready_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "nbd_verity.format._native",
    .m_doc = "Hot loops of dm-verity verification on OpenSSL's EVP API.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL)
        return NULL;
    /* PyModule_AddType readies the type and takes its own reference only on success. */
    str_table = PyUnicode_InternFromString("table");
    str_move_to_end = PyUnicode_InternFromString("move_to_end");
    str_append = PyUnicode_InternFromString("append");
    if (str_table == NULL || str_move_to_end == NULL || str_append == NULL || PyModule_AddType(m, &HasherType) < 0 ||
        PyModule_AddType(m, &FastReadType) < 0 ||
        PyModule_AddIntConstant(m, "READ_FAILED", READ_FAILED) < 0 ||
        PyModule_AddIntConstant(m, "DEFAULT_RELEASE_SIZE", DEFAULT_RELEASE_SIZE) < 0 ||
        sha256x_add_functions(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
