"""The unit tests."""
