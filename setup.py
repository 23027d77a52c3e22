"""Build the optional C codec; every other setting lives in pyproject.toml.

nbd_verity.fec._rs is the Reed-Solomon encoder and decoder of FEC (nbd_verity/fec/). It is
optional: without a compiler the package installs and uses its pure-Python codec.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("nbd_verity.fec._rs", ["nbd_verity/fec/_rs.c"], optional=True,
                             extra_compile_args=["-O3", "-std=c11", "-Wall"])])
