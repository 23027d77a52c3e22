"""Tests of nbd-verity (pytest imports them as the package tests)."""
