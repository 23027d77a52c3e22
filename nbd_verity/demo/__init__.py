"""`make demo`: a walkthrough of nbd-verity, run step by step with the installed CLI.

Usage: python -m nbd_verity.demo WORKDIR

walkthrough.py runs the steps and holds what they share; offline.py has the steps that
need no server (format, dump, verify), serving.py those that serve the image over NBD.
To extend the demo, add a step function to one of them and to its STEPS tuple.
"""
