"""Unit tests: image sources (nbd_verity/sources/)."""
