"""The scheduling policy: inline or pool, the load, classes ranked; a layer over
the verifier's read with the same interface."""
