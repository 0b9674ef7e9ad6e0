"""The engine core's side of structured output: grammars compiled off the step loop, one grammar
state per running constrained request, each step's bitmask, and the states' advance."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ..sampling_params import StructuredOutputsParams

# Compiled grammars the backends keep for requests that repeat a constraint (xgrammar's cache,
# keyed by the grammar text): bounded so that a stream of distinct schemas cannot grow it forever.
CACHE_BYTES = 512 << 20
# Compiles run beside the step loop; with two cores, more threads would only take the loop's.
COMPILE_THREADS = 2


class StructuredOutputManager:
    """Created by the engine core at its first constrained request. The tokenizer is loaded, and
    each backend built, on the compile threads too: nothing here blocks a step."""

    def __init__(self, tokenizer_path: str, vocab_size: int):
        self.tokenizer_path, self.vocab_size = tokenizer_path, vocab_size
        self.words = -(-vocab_size // 32)
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="octavo-grammar")
        self._lock = threading.Lock()
        self._tokenizer = None
        self._backends: dict[str, object] = {}
        self._states: dict[int, object] = {}  # by scheduler handle
        self._reasoning: dict[int, int] = {}  # handle -> the </think> token its grammar waits for

    # ---- compiling (on the pool) ------------------------------------------------------------

    def compile(self, p: StructuredOutputsParams) -> Future:
        """A future of the request's grammar state; it raises ValueError when the backend
        cannot compile the constraint."""
        return self._pool.submit(self._compile, p)

    def _compile(self, p: StructuredOutputsParams):
        if p._backend is None:  # a caller that skipped the front end's check
            from . import validate

            validate(p)
        return self._backend(p._backend).compile(p)

    def _backend(self, name: str):
        with self._lock:  # one tokenizer and one backend of each kind, however many threads ask
            if name not in self._backends:
                if self._tokenizer is None:
                    from ..loader import load_tokenizer

                    self._tokenizer = load_tokenizer(self.tokenizer_path)
                self._backends[name] = self._make_backend(name)
            return self._backends[name]

    def _make_backend(self, name: str):
        if name == "guidance":
            from .backend_guidance import GuidanceBackend

            return GuidanceBackend(self._tokenizer, self.vocab_size)
        from .backend_xgrammar import XgrammarBackend

        return XgrammarBackend(self._tokenizer, self.vocab_size, CACHE_BYTES, COMPILE_THREADS)

    # ---- running requests (on the step loop) -------------------------------------------------

    def add(self, handle: int, state, reasoning_end: int | None = None) -> None:
        """reasoning_end: the grammar applies after the first output token equal to it."""
        self._states[handle] = state
        if reasoning_end is not None:
            self._reasoning[handle] = reasoning_end

    def remove(self, handle: int) -> None:
        self._states.pop(handle, None)
        self._reasoning.pop(handle, None)

    def __contains__(self, handle: int) -> bool:
        return handle in self._states

    def bitmask(self, handles: list[int],
                drafts: list[list[int]] | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """The step's mask for the logits rows whose request follows a grammar: ([G, words]
        int32, [G] int32 logits rows), or None when no row is constrained. A request verifying
        drafts (speculative decoding) has one row per draft plus one, each masked for the
        grammar's state after the drafts before it. A grammar that has ended (its stop token
        accepted, the request kept going with ignore_eos) constrains nothing, nor does one whose
        request is still reasoning."""
        masks, rows, row = [], [], 0
        for i, handle in enumerate(handles):
            draft = drafts[i] if drafts else []
            state = self._states.get(handle)
            if state is not None and not state.is_terminated() and handle not in self._reasoning:
                masks += self._draft_masks(state, draft)
                rows += range(row, row + len(masks) - len(rows))
            row += len(draft) + 1
        if not masks:
            return None
        return torch.stack(masks).numpy(), np.array(rows, dtype=np.int32)

    def _draft_masks(self, state, draft: list[int]) -> list[torch.Tensor]:
        """Masks for the grammar's state now and after each draft token in turn (taken back
        after). Rows after a token the grammar refuses, or past its end, need none: their draft
        cannot be accepted."""
        masks, taken = [], 0
        for j in range(len(draft) + 1):
            mask = torch.full((1, self.words), -1, dtype=torch.int32)
            state.fill_bitmask(mask, 0)
            masks.append(mask[0])
            if j == len(draft) or not state.accept_token(draft[j]):
                break
            taken += 1
            if state.is_terminated():
                break
        state.rollback(taken)
        return masks

    def num_valid_draft_tokens(self, handle: int, draft: list[int]) -> int:
        """How many of the draft's tokens in a row the request's grammar takes (it takes them
        back after). While the request reasons, the drafts before its reasoning end: the row
        after that token must be masked, which a reasoning request's rows are not."""
        state = self._states.get(handle)
        if state is None or state.is_terminated():
            return len(draft)
        if handle in self._reasoning:
            end = self._reasoning[handle]
            return draft.index(end) if end in draft else len(draft)
        taken = 0
        for token in draft:
            if state.is_terminated() or not state.accept_token(token):
                break
            taken += 1
        state.rollback(taken)
        return taken

    def accept(self, handle: int, tokens: list[int]) -> bool:
        """Advances the request's grammar by its new tokens; False when the grammar refuses one
        (the request then fails: its output would no longer follow the constraint)."""
        state = self._states.get(handle)
        if state is None:
            return True
        if handle in self._reasoning:  # still thinking: the grammar starts after </think>
            end = self._reasoning[handle]
            if end not in tokens:
                return True
            del self._reasoning[handle]
            tokens = tokens[tokens.index(end) + 1:]
        for token in tokens:
            if state.is_terminated():  # ended: ignore_eos generates on, unconstrained
                return True
            if not state.accept_token(token):
                return False
        return True

    def rollback(self, handle: int, num_tokens: int) -> None:
        """Takes back the request's last num_tokens accepted tokens (drafts a verifier rejected)."""
        state = self._states.get(handle)
        if state is not None and num_tokens > 0:
            state.rollback(num_tokens)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
