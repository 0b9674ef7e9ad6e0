"""Incremental detokenization and stop-string matching.

Decoding the whole output after every step costs O(length) per token. ``IncrementalDetokenizer``
instead decodes a small window of recent token ids twice per step:

    ids:   ... | prefix window | new tokens |
               ^prefix_offset  ^read_offset ^end

The text of ``ids[prefix_offset:end]`` minus the text of ``ids[prefix_offset:read_offset]`` is the
new text. The prefix window gives the new tokens their left context, which matters for decoders
that treat the first token specially (SentencePiece/Metaspace drop its leading space). When the
window's text ends in U+FFFD the last character is still incomplete (a byte-level or byte-fallback
token carried only part of its UTF-8 bytes): nothing is emitted past the last complete character
until the next token finishes it.

Streaming with stop strings: a stop string may arrive split over several steps, and, unless
``include_stop_str_in_output``, none of it may reach the client. So while a request runs, a
streaming consumer holds back the last ``max(len(s) for s in stop) - 1`` characters
(``SamplingParams.output_text_buffer_length``) and releases them once it finishes; see
``streamable_text``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded ahead of the output so its first token is decoded in context.
_PROMPT_CONTEXT_TOKENS = 6
# How far back the prompt context may reach for a start that decodes cleanly.
_MAX_PROMPT_CONTEXT_TOKENS = 24
# Valid text may go a few tokens without a token boundary on a character boundary (every token
# holding the end of one multi-byte character and the start of the next); this many tokens
# without one means invalid bytes, which are emitted anyway so the window stays bounded.
_MAX_PENDING_TOKENS = 32
# Ids before the prefix window are dropped once this many have accumulated.
_TRIM_AT = 64

_special_ids_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class IncrementalDetokenizer:
    """Turns a request's output token ids into text, one step at a time.

    ``add_tokens(ids)`` returns the text the new ids add; ``text`` holds all output text so far.
    With an empty prompt, after every step that ends on a complete character,
    ``text == tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``.
    With a prompt, the output is decoded in the context of the prompt's last tokens, so text equals
    ``decode(prompt + output)[len(decode(prompt)):]``, i.e. a SentencePiece output keeps the leading
    space it has after the prompt (as in vLLM). ``flush()`` emits a trailing incomplete character as
    U+FFFD when the request ends.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._decode = _make_decode(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        # Skipped special tokens never enter the window: a window holding only skipped tokens
        # would decode to "" and give the next token no context.
        self._skip_ids = special_token_ids(tokenizer) if skip_special_tokens else frozenset()

        self._ids: list[int] = self._prompt_context(prompt_token_ids or ())
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # text of the prefix window, once decoded
        self.text = ""

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Appends output token ids; returns the text they complete (possibly "")."""
        new = self._keep(token_ids)
        if not new:
            return ""
        self._ids.extend(new)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emits any text held back for an incomplete character (as U+FFFD); call when finished."""
        return self._advance(final=True)

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The last few prompt tokens, starting and ending on character boundaries.

        Windows must start on a character boundary: byte-fallback decoders turn a whole run of
        byte tokens into U+FFFD when the run starts mid-character, so a context cut inside a
        character would garble output bytes that continue the run.
        """
        ids = self._keep(list(prompt_token_ids[-_MAX_PROMPT_CONTEXT_TOKENS - 8:]))
        # Dropping up to 3 tokens at the end handles a prompt that ends mid-character.
        for trim in range(4):
            end = len(ids) - trim
            for start in range(max(end - _PROMPT_CONTEXT_TOKENS, 0),
                               max(end - _MAX_PROMPT_CONTEXT_TOKENS, 0) - 1, -1):
                text = self._decode(ids[start:end])
                if not text.startswith(REPLACEMENT_CHAR) and not text.endswith(REPLACEMENT_CHAR):
                    return ids[start:end]
        return []

    def _keep(self, token_ids: Iterable[int]) -> list[int]:
        if self._skip_ids:
            return [int(t) for t in token_ids if t not in self._skip_ids]
        return [int(t) for t in token_ids]

    def _advance(self, final: bool) -> str:
        ids = self._ids
        start, read, end = self._prefix_offset, self._read_offset, len(ids)
        if read == end:
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(ids[start:read])
        new_text = self._decode(ids[start:end])
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            cut = self._complete_end()
            if cut is None:
                return ""
            end, new_text = cut
        delta = new_text[len(self._prefix_text):]
        # The next prefix window starts where this step's text started: a character boundary.
        self._prefix_offset = read
        self._read_offset = end
        self._prefix_text = None
        self.text += delta
        if self._prefix_offset >= _TRIM_AT:
            del ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def _complete_end(self) -> tuple[int, str] | None:
        """Where the emitted text may end when the window's last character looks incomplete.

        Returns the largest token boundary past read_offset, among the last 3, whose window text
        ends on a complete character, with that text; None to wait for more tokens.
        """
        ids, start, read = self._ids, self._prefix_offset, self._read_offset
        for end in range(len(ids) - 1, max(read, len(ids) - 4), -1):
            text = self._decode(ids[start:end])
            if not text.endswith(REPLACEMENT_CHAR):
                return end, text
        if len(ids) - read >= _MAX_PENDING_TOKENS:
            # Invalid bytes: emit all but the last 3 tokens, which may still begin a character.
            return len(ids) - 3, self._decode(ids[start:len(ids) - 3])
        return None


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops, cached per tokenizer."""
    size = _vocab_size(tokenizer)
    try:
        cached = _special_ids_cache.get(tokenizer)
    except TypeError:  # not weak-referenceable / hashable
        cached = None
    if cached is not None and cached[0] == size:
        return cached[1]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
        # Fast tokenizers skip exactly the added tokens flagged special.
        ids = frozenset(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
    else:
        ids = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
    try:
        _special_ids_cache[tokenizer] = (size, ids)
    except TypeError:
        pass
    return ids


def _vocab_size(tokenizer: Any) -> int:
    try:
        return len(tokenizer)
    except TypeError:
        return -1


def _make_decode(tokenizer: Any, skip_special_tokens: bool,
                 spaces_between_special_tokens: bool) -> Callable[[list[int]], str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        # Hugging Face fast tokenizer: its decode is the Rust decode plus an optional cleanup
        # pass, which detokenization leaves off (vLLM does too). Calling Rust directly skips
        # the Python overhead of tokenizer.decode.
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        clean_up_tokenization_spaces=False)


def check_stop_strings(text: str, new_len: int, stop: Sequence[str],
                       include_stop_str_in_output: bool) -> tuple[str, str | None]:
    """Finds the first stop string completed by the last ``new_len`` characters of ``text``.

    Only matches that end within the new characters count (earlier text was checked in earlier
    steps); they may begin up to ``len(stop_str) - 1`` characters before them. When several stop
    strings match, the one that ends first wins (it would have stopped generation first); on a tie
    the longer one. Returns ``(text, None)`` when none matches, else the text truncated before the
    stop string (after it with ``include_stop_str_in_output``) and the matched stop string.
    """
    if new_len <= 0 or not stop:
        return text, None
    first_new = len(text) - new_len
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for stop_str in stop:
        start = text.find(stop_str, max(0, first_new - len(stop_str) + 1))
        if start < 0:
            continue
        candidate = (start + len(stop_str), start, stop_str)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    if best is None:
        return text, None
    end, start, stop_str = best
    return (text[:end] if include_stop_str_in_output else text[:start]), stop_str


def streamable_text(text: str, num_sent: int, hold_back: int, finished: bool) -> str:
    """The part of ``text`` a streaming client may be sent now, given ``num_sent`` characters sent.

    While running, the last ``hold_back`` characters (``SamplingParams.output_text_buffer_length``)
    stay back in case they begin a stop string; once finished (text already truncated by
    ``check_stop_strings``) everything goes. Truncation never cuts into text already sent, because a
    stop string found in a step starts at most ``hold_back`` characters before that step's text.
    """
    end = len(text) if finished else max(num_sent, len(text) - hold_back)
    return text[num_sent:end]
