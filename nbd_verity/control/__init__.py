"""The control socket: its protocol (server and the one client), and tune, which measures
thresholds through it."""
