"""xgrammar, the default backend: each constraint kind as an xgrammar grammar, checked without a
tokenizer (validate) and compiled against the model's vocabulary (XgrammarBackend)."""

from __future__ import annotations

import json
import re

import torch

from ..sampling_params import StructuredOutputsParams

# xgrammar's errors start with its C++ log prefix ("[03:39:47] /project/cpp/x.cc:94: "): noise to a user.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


# Whitespace characters allowed between two JSON tokens. Without a bound a model can pad a value
# with whitespace until max_tokens cuts it (the default model does, greedy, on 3 of the 50 test
# schemas), and the output never parses; 32 still fits pretty-printing 7 levels deep.
MAX_JSON_WHITESPACE = 32


def backend_message(error: Exception) -> str:
    return _LOG_PREFIX.sub("", str(error).strip())


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly the choices (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def json_schema_text(p: StructuredOutputsParams) -> str:
    """The schema as JSON text; ValueError for text that is not JSON (vLLM's message)."""
    if isinstance(p.json, dict):
        return json.dumps(p.json)
    try:
        json.loads(p.json)
    except ValueError:
        raise ValueError("Invalid JSON grammar specification.") from None
    return p.json


def _source(p: StructuredOutputsParams) -> tuple[str, tuple, dict, str]:
    """(xgrammar's name for the kind, its arguments, its keyword arguments, what a failure is
    called): Grammar.from_<name> parses it and GrammarCompiler.compile_<name> compiles it."""
    whitespace = {"any_whitespace": not p.disable_any_whitespace, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
    kind = p.kind
    if kind == "json":
        return "json_schema", (json_schema_text(p),), whitespace, "Failed to transform json schema into a grammar"
    if kind == "json_object":  # any JSON object (vLLM's xgrammar backend compiles this schema)
        return "json_schema", ('{"type": "object"}',), whitespace, "Invalid JSON object specification"
    if kind == "regex":
        return "regex", (p.regex,), {}, "Failed to transform regex into a grammar"
    if kind == "choice":
        return "ebnf", (choice_grammar(p.choice),), {}, "Invalid choice specification"
    if kind == "grammar":
        return "ebnf", (p.grammar,), {}, "Invalid grammar specification"
    return "structural_tag", structural_tag_args(p.structural_tag), {}, "Invalid structural tag specification"


def structural_tag_args(text: str) -> tuple:
    """xgrammar's structural tag as it is, or the older form vLLM and OpenAI clients also send
    ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}) as (tags, triggers)."""
    import xgrammar as xgr

    try:
        tag = json.loads(text)
    except ValueError:
        raise ValueError("Invalid structural tag specification: not JSON text") from None
    if not isinstance(tag, dict) or "structures" not in tag:
        return (text,)
    try:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                 for s in tag["structures"]]
        return items, list(tag["triggers"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"Invalid structural tag specification: {e!r}") from None


def validate_xgrammar(p: StructuredOutputsParams) -> None:
    """Parses the constraint as xgrammar would compile it; ValueError with xgrammar's message."""
    import xgrammar as xgr

    name, args, kwargs, failure = _source(p)
    try:
        getattr(xgr.Grammar, f"from_{name}")(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own kinds
        raise ValueError(f"{failure}: {backend_message(e)}") from None


class XgrammarBackend:
    """Compiles constraints for one tokenizer and model vocabulary. GrammarCompiler keeps a cache
    keyed by the grammar text, bounded by ``cache_bytes``; compile() may run on any thread."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, cache_bytes: int, max_threads: int):
        import xgrammar as xgr

        # The model's vocabulary, not the tokenizer's: ids the tokenizer lacks (padding rows of the
        # LM head) become tokens no grammar allows.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=True,
                                            cache_limit_bytes=cache_bytes)

    def compile(self, p: StructuredOutputsParams):
        name, args, kwargs, failure = _source(p)
        try:
            compiled = getattr(self.compiler, "compile_" + ("grammar" if name == "ebnf" else name))(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{failure}: {backend_message(e)}") from None
        return XgrammarState(compiled)


class XgrammarState:
    """One request's position in its grammar (a GrammarMatcher)."""

    def __init__(self, compiled):
        import xgrammar as xgr

        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
