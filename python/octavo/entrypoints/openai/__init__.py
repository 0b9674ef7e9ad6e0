"""The OpenAI-compatible server (``octavo serve``)."""
