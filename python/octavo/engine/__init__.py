"""The engine: requests in, tokens stepped through the scheduler and model, text and outputs out."""
