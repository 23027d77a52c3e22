/* sha256x_py.c: sha256x's module-level functions for nbd_verity.format._native. */

#ifndef NBD_VERITY_SHA256X_PY_H
#define NBD_VERITY_SHA256X_PY_H

#include <Python.h>

/* Add sha256_default_lanes, cpu_has_sha, sha256x_counts and SHA256_MAX_LANES; 0 or -1. */
int sha256x_add_functions(PyObject *module);

#endif
