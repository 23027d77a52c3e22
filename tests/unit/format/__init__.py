"""Unit tests: the on-disk format (nbd_verity/format/)."""
