"""The two optional C extensions; every other setting lives in pyproject.toml.

nbd_verity.format._native is the verification core on OpenSSL's EVP API (digest.py uses
it), with SHA-256 on the x86 SHA extensions in sha256x.c (chosen at run time by CPUID);
nbd_verity.fec._rs is the Reed-Solomon codec of FEC (nbd_verity/fec/). Both are
optional=True: without a compiler or OpenSSL's headers the package still installs, and
falls back to hashlib and to the pure-Python codec.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("nbd_verity.format._native",
              ["nbd_verity/format/_native.c", "nbd_verity/format/sha256x.c",
               "nbd_verity/format/sha256x_py.c"],
              depends=["nbd_verity/format/sha256x.h", "nbd_verity/format/sha256x_py.h"],
              libraries=["crypto"],
              extra_compile_args=["-O2", "-Wall", "-Wextra"], optional=True),
    Extension("nbd_verity._threadstate", ["nbd_verity/_threadstate.c"],
              optional=True, extra_compile_args=["-O2", "-Wall", "-Wextra"]),
    Extension("nbd_verity.fec._rs", ["nbd_verity/fec/_rs.c"], optional=True,
              extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra"]),
])
