"""Forward error correction, as `veritysetup --fec-device` and the kernel's dm-verity-fec.

layout.py: where parity sits and which blocks form a codeword (FecGeometry), encoding a
parity image and rebuilding one block (FecRepairer); image.py: format and verify whole
images with FEC; rs.py: the Reed-Solomon codec (GF(2^8), 0x11d, fcr 0), in C (_rs.c)
when it was built, else in Python. FEC runs only on the error path: a rebuilt block is
used only if it then matches its trusted digest.
"""
