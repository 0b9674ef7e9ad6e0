"""Tensor parallelism: which part of the model each rank holds (shards.py) and the collectives
that join the parts (parallel_state.py), through torch.distributed."""
