"""Unit tests: the root of trust (nbd_verity/trust/)."""
