"""The server tests."""
