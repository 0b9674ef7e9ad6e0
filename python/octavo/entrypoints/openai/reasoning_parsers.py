"""Reasoning parsers (vLLM's ``--reasoning-parser``): a reasoning model's output as its reasoning
(between ``<think>`` and ``</think>``) and its answer (after ``</think>``).

- ``deepseek_r1``: a leading ``<think>`` is optional (DeepSeek-R1's template puts it in the
  prompt); an output without ``</think>`` is all reasoning (cut off while thinking).
- ``qwen3``: the same, but with ``chat_template_kwargs={"enable_thinking": false}`` the model
  does not think and the whole output is the answer.

Both need ``<think>`` and ``</think>`` to be single tokens of the model's vocabulary, as vLLM's do:
the engine core watches for the ``</think>`` token to start a request's structured output there.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tool_parsers import held_back


class ThinkParser:
    START, END = "<think>", "</think>"

    def __init__(self, tokenizer, name: str):
        vocab = tokenizer.get_vocab()
        if self.START not in vocab or self.END not in vocab:
            raise ValueError(f"the {name} reasoning parser needs {self.START} and {self.END} as single tokens of "
                             "the model's vocabulary; this tokenizer has no such tokens")
        self.start_id, self.end_id = vocab[self.START], vocab[self.END]

    def thinks(self, chat_template_kwargs: dict | None) -> bool:
        """Whether the model reasons before answering in this request."""
        return True

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) of the text so far; while streaming (not final), a trailing piece
        that may begin ``</think>`` is in neither yet."""
        if text.startswith(self.START):
            text = text[len(self.START):]
        elif not final and self.START.startswith(text):
            return "", ""
        reasoning, end, answer = text.partition(self.END)
        if end:
            return reasoning, answer
        return text[:len(text) - (0 if final else held_back(text, self.END))], ""

    def ended_in_prompt(self, prompt_token_ids: list[int]) -> bool:
        """The prompt itself closes the reasoning (a template that turns thinking off writes
        ``<think></think>`` after the generation prompt)."""
        ends = [i for i, t in enumerate(prompt_token_ids) if t == self.end_id]
        starts = [i for i, t in enumerate(prompt_token_ids) if t == self.start_id]
        return bool(ends) and (not starts or ends[-1] > starts[-1])


class Qwen3Parser(ThinkParser):
    def thinks(self, chat_template_kwargs: dict | None) -> bool:
        return (chat_template_kwargs or {}).get("enable_thinking", True) is not False


PARSERS = {"deepseek_r1": ThinkParser, "qwen3": Qwen3Parser}


def make_parser(name: str, tokenizer) -> ThinkParser:
    return PARSERS[name](tokenizer, name)


@dataclass
class ReasoningStream:
    """One streamed choice: what of the reasoning has been sent."""

    parser: ThinkParser
    sent: int = 0

    def advance(self, text: str, final: bool) -> tuple[str, str]:
        """(the reasoning's new text, the whole answer so far)."""
        reasoning, answer = self.parser.split(text, final)
        new, self.sent = reasoning[self.sent:], max(self.sent, len(reasoning))
        return new, answer
