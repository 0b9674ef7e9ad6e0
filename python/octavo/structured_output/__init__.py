"""Structured output (vLLM v1's ``structured_output/``): a request's JSON schema, regex, choice,
grammar or structural tag becomes a grammar over the model's tokens, and each step masks the
tokens the grammar rules out before sampling.

- The front end checks the constraint when the request is added (``validate``: ValueError, HTTP
  400, with the backend's message) and picks its backend.
- The engine core compiles it on a pool of threads (``StructuredOutputManager``); the request
  joins the scheduler once its grammar is ready, so no step waits for a compile.
- Each step, the core fills one bitmask row per constrained request (int32 words, bit set =
  allowed); the driver worker applies it to the logits (``ops.apply_token_bitmask``) before
  ``ops.sample``; the core then advances each grammar by the tokens the step produced.
"""

from __future__ import annotations

from ..sampling_params import StructuredOutputsParams
from .backend_guidance import validate_guidance
from .backend_xgrammar import validate_xgrammar
from .manager import StructuredOutputManager

# vLLM's structured_outputs_config backends: "auto" takes xgrammar, or llguidance where xgrammar
# refuses a constraint that llguidance compiles.
BACKENDS = ("auto", "xgrammar", "guidance")

__all__ = ["BACKENDS", "StructuredOutputManager", "validate"]


def validate(p: StructuredOutputsParams, backend: str = "auto") -> None:
    """Checks that ``backend`` can compile p and records which one will (p._backend); raises
    ValueError with the backend's message otherwise (under "auto", xgrammar's)."""
    if backend not in BACKENDS:
        raise ValueError(f"structured output backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "guidance":
        validate_guidance(p)
        p._backend = "guidance"
        return
    try:
        validate_xgrammar(p)
        p._backend = "xgrammar"
        return
    except ValueError as refused:
        if backend == "xgrammar" or p.disable_fallback:
            raise
        try:
            validate_guidance(p)
        except ValueError:
            raise refused from None
    p._backend = "guidance"
