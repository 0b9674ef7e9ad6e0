"""Command-line and server entry points."""
