"""Real-kernel end-to-end tests: a user-mode-linux guest reads nbd-verity through /dev/nbd0."""
