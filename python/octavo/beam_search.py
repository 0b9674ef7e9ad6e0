"""Beam search as vLLM v1 runs it (``LLM.beam_search``, the server's ``use_beam_search``): each
step runs every live beam as a one-token request asking for the 2 x beam_width most likely next
tokens; the beam_width best extensions over all of a prompt's beams (by cumulative logprob) go
on, those ending in EOS are complete. Beams of a prompt share their KV blocks through the block
pool: every beam's request finds its full blocks (prompt and common prefix) in the prefix cache
and copies its parent's partial last block (the scheduler's partial-block cache), so a step
computes one token per beam.

At the end the complete and live beams are ranked by vLLM's score, cum_logprob / len ** length
_penalty (len counts the prompt and not a final EOS), and the best beam_width are returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .outputs import Logprob
from .sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """A beam: ``tokens`` holds the prompt and the generated tokens."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    length = len(beam.tokens) - (eos_token_id is not None and beam.tokens[-1] == eos_token_id)
    return beam.cum_logprob / (length ** length_penalty)


class BeamSearch:
    """One prompt's search, driven from outside: ``step_requests()`` are the requests to run
    next, ``advance()`` takes their first tokens' logprobs; done once no beam is live."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_id: int | None):
        self.params, self.eos = params, eos_token_id
        self.prompt_len = len(prompt_token_ids)
        self.live = [BeamSearchSequence(list(prompt_token_ids))]
        self.complete: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.live or self.steps == self.params.max_tokens

    def sampling_params(self) -> SamplingParams:
        p = self.params
        return SamplingParams(max_tokens=1, logprobs=2 * p.beam_width, temperature=p.temperature,
                              ignore_eos=p.ignore_eos, detokenize=False)

    def step_requests(self) -> list[list[int]]:
        return [beam.tokens for beam in self.live]

    def advance(self, logprobs: list[dict[int, Logprob]]) -> None:
        """logprobs: each live beam's next-token entries (its request's first output position)."""
        candidates = [BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entry],
                                         beam.cum_logprob + lp.logprob)
                      for beam, entry in zip(self.live, logprobs) for token, lp in entry.items()]
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
        self.live = []
        for beam in candidates[:self.params.beam_width]:
            if beam.tokens[-1] == self.eos and not self.params.ignore_eos:
                beam.finish_reason = "stop"
                self.complete.append(beam)
            else:
                self.live.append(beam)
        self.steps += 1

    def output(self, tokenizer) -> BeamSearchOutput:
        """The best beam_width beams, best first, with their text."""
        for beam in self.live:
            beam.finish_reason = "length"
        beams = sorted(self.complete + self.live, reverse=True,
                       key=lambda b: beam_score(b, self.eos, self.params.length_penalty))[:self.params.beam_width]
        for beam in beams:
            generated = beam.tokens[self.prompt_len:]
            if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                generated = generated[:-1]
            beam.text = tokenizer.decode(generated, skip_special_tokens=True) if tokenizer is not None else None
        return BeamSearchOutput(beams)
