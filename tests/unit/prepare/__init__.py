"""Unit tests: preparation (nbd_verity/prepare/)."""
