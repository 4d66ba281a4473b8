"""Training (seed 2, "Runtime Supervised Training"): the runner, one update, the loops."""
