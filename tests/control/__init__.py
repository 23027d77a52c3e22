"""Per-class dispatch and the control socket, tested against real servers and clients."""
