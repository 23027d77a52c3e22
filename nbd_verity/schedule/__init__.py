"""The scheduling policy: inline or pool, classes ranked, the learner; a layer over the
verifier's read with the same interface."""
