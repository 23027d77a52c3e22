"""The tune tests."""
