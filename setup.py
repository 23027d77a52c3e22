"""The native verification core (nbd_verity/_native.c); the metadata is in pyproject.toml.

optional=True: without a compiler or OpenSSL's headers the package still installs, and
nbd_verity.digest falls back to hashlib.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("nbd_verity._native", ["nbd_verity/_native.c"],
                             libraries=["crypto"], extra_compile_args=["-O2", "-Wall"],
                             optional=True)])
