"""Files: atomic writes, checkpoints, weights, and TorchLean's formats."""
