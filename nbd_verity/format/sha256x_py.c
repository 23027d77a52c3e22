/* The module-level face of sha256x for Python: which SHA-256 path a new Hasher takes,
 * whether the CPU could take the fast one, and how many messages it hashed (sha256x.h).
 * _native.c adds these functions to its module with sha256x_add_functions. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "sha256x.h"
#include "sha256x_py.h"

static PyObject *default_lanes(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    return PyLong_FromLong(sha256x_default_lanes());
}

static PyObject *cpu_has_sha(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    return PyBool_FromLong(sha256x_cpu_has_sha());
}

static PyObject *counts(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    unsigned long long c[SHA256X_MAX_LANES];
    sha256x_counts(c);
    return Py_BuildValue("(KKK)", c[0], c[1], c[2]);
}

static PyObject *set_counting(PyObject *Py_UNUSED(module), PyObject *on)
{
    int value = PyObject_IsTrue(on);
    if (value < 0)
        return NULL;
    sha256x_set_counting(value);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"sha256_default_lanes", default_lanes, METH_NOARGS,
     "sha256_default_lanes() -> int: SHA-256 messages a new Hasher hashes at once on the\n"
     "SHA extensions (2), or 0: OpenSSL's EVP (no SHA extensions, or "
     SHA256X_NO_SHANI_ENV "=1)."},
    {"cpu_has_sha", cpu_has_sha, METH_NOARGS,
     "cpu_has_sha() -> bool: whether CPUID reports the SHA extensions and SSE4.1."},
    {"sha256x_counts", counts, METH_NOARGS,
     "sha256x_counts() -> (x1, x2, x3): messages hashed so far on the SHA extensions by\n"
     "calls of one, two and three streams, in this process (while counting is on)."},
    {"sha256x_count", set_counting, METH_O,
     "sha256x_count(on): count messages for sha256x_counts (off by default: a counter\n"
     "shared by every thread costs a cache line's journey between cores per call)."},
    {NULL, NULL, 0, NULL},
};

int sha256x_add_functions(PyObject *module)
{
    sha256x_default_lanes();  /* read the CPU and the switch once, under the GIL */
    if (PyModule_AddFunctions(module, methods) < 0)
        return -1;
    return PyModule_AddIntConstant(module, "SHA256_MAX_LANES", SHA256X_MAX_LANES);
}
