"""Workers: one rank each, owning its device, model shard, KV cache, CUDA graphs and sampler; the
model runner turns the scheduler's step layout into a forward pass, the sampler into tokens."""
