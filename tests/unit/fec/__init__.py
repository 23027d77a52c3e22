"""Unit tests: forward error correction (nbd_verity/fec/)."""
