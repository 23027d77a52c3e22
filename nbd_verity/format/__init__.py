"""The on-disk format: superblock, parameters, tree geometry, digests (and the native
engine), root hashes, request blocks, and the builder that formats and verifies offline."""
