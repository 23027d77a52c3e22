"""The oracle tests."""
