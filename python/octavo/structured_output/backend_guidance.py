"""llguidance, the second backend: used where xgrammar refuses a constraint that llguidance can
compile (vLLM's "auto" policy), e.g. JSON schema keywords or regex syntax xgrammar does not
support. Same contract as backend_xgrammar."""

from __future__ import annotations

import torch

from ..sampling_params import StructuredOutputsParams
from .backend_xgrammar import MAX_JSON_WHITESPACE, choice_grammar, json_schema_text


def _grammar(p: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar; ValueError where it has no such form."""
    import llguidance

    kind = p.kind
    options = {"whitespace_flexible": not p.disable_any_whitespace}
    if not p.disable_any_whitespace:  # bounded as xgrammar's (MAX_JSON_WHITESPACE says why)
        options["whitespace_pattern"] = f"[\\n\\t ]{{0,{MAX_JSON_WHITESPACE}}}"
    if kind in ("json", "json_object"):
        schema = json_schema_text(p) if kind == "json" else '{"type": "object"}'
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(p.regex)
    if kind in ("choice", "grammar"):  # GBNF, or Lark
        return llguidance.grammar_from("grammar", choice_grammar(p.choice) if kind == "choice" else p.grammar)
    raise ValueError(f"llguidance does not take {kind} constraints here")


def validate_guidance(p: StructuredOutputsParams) -> None:
    """ValueError with llguidance's message when it cannot compile the constraint."""
    import llguidance

    try:
        error = llguidance.LLMatcher.validate_grammar(_grammar(p))
    except (ValueError, TypeError, RuntimeError) as e:
        error = str(e)
    if error:
        raise ValueError(f"llguidance cannot compile the {p.kind} constraint: {error}")


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile(self, p: StructuredOutputsParams) -> GuidanceState:
        grammar = _grammar(p)
        state = GuidanceState(self.tokenizer, grammar)
        if state.matcher.is_error():
            raise ValueError(f"llguidance cannot compile the {p.kind} constraint: {state.matcher.get_error()}")
        return state


class GuidanceState:
    """One request's position in its grammar (an LLMatcher)."""

    def __init__(self, tokenizer, grammar: str):
        import llguidance

        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self.ended = False

    def accept_token(self, token: int) -> bool:
        # is_stopped() already holds while the grammar allows nothing but EOS: the grammar has
        # ended (as xgrammar's is_terminated()) once that EOS is taken.
        forced_eos = self.matcher.is_stopped()
        accepted = self.matcher.consume_token(token) and not self.matcher.is_error()
        self.ended = forced_eos and accepted
        return accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.ended = False

    def is_terminated(self) -> bool:
        return self.ended
