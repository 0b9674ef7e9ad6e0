"""Executors: where the workers that run the model live (this process, for now)."""

from .abstract import Executor

__all__ = ["Executor"]
