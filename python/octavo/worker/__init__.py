"""Turning the scheduler's step layout into a forward pass and sampled tokens."""
