"""Sampling parameters for text generation, field for field the same as ``vllm.SamplingParams``."""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any

logger = logging.getLogger(__name__)

# Below this temperature sampling is greedy (the same threshold as vLLM).
_SAMPLING_EPS = 1e-5
# Positive temperatures are raised to at least this value: dividing logits by a smaller one overflows.
_MIN_TEMPERATURE = 1e-2
# vLLM clamps each logit bias to this magnitude.
_MAX_LOGIT_BIAS = 100.0
# Seeds are 64-bit signed integers, as torch's generators and vLLM's API take them.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
# A top_k past every vocabulary keeps every token; larger ones are held at this, so that they
# still cross to the engine core's process (msgpack carries 64-bit integers) and fit the
# sampler's int32 column.
TOP_K_MAX = (1 << 31) - 1


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(Enum):
    """What each streamed ``RequestOutput`` carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_utf8(what: str, text: Any) -> None:
    """Text sent to an engine core in another process travels as UTF-8: a string holding a lone
    surrogate (which JSON's \\ud800 escapes make) is refused here, before it could fail a batch."""
    try:
        text.encode()
    except (AttributeError, UnicodeEncodeError):
        raise ValueError(f"{what} must be a string of valid Unicode, got {text!r}.") from None


# The constraint fields of StructuredOutputsParams: a request sets exactly one.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output, as ``vllm.sampling_params.StructuredOutputsParams``:

    - json: a JSON schema (a dict, or its JSON text): the output is one JSON value it validates.
    - regex: the output matches this regular expression.
    - choice: the output is one of these strings.
    - grammar: an EBNF (GBNF) grammar; the output is a sentence of its ``root`` rule.
    - json_object: True: the output is one JSON object.
    - structural_tag: xgrammar's structural tag (JSON text): free text with tagged, constrained parts.

    disable_any_whitespace: JSON without whitespace between tokens; disable_additional_properties:
    objects hold only the properties the schema names (unless it says otherwise);
    whitespace_pattern: accepted as vLLM's field, which its xgrammar backend also ignores.
    The grammar is checked when the request is added (ValueError with the backend's message).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # The backend that compiles it ("xgrammar" or "guidance"): the engine's choice, made when it
    # checks the request (structured_output.validate).
    _backend: str | None = field(default=None, init=False, repr=False)
    # A reasoning model's </think> token (the server's --reasoning-parser): the constraint starts
    # after the output's first one; None: from the first output token.
    _reasoning_end: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) > 1:
            raise ValueError("You can only use one kind of structured outputs constraint but multiple are "
                             f"specified: {given}")
        if not given:
            raise ValueError("You must use one kind of structured outputs constraint but none are specified: "
                             f"one of {list(STRUCTURED_OUTPUT_KINDS)}")
        if self.choice is not None and (isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple))
                                        or not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"choice must be a non-empty list of strings, got {self.choice!r}")
        for name in ("regex", "grammar", "structural_tag"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {type(getattr(self, name)).__name__}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            if hasattr(self.json, "model_json_schema"):  # a pydantic model class, as vLLM takes
                self.json = self.json.model_json_schema()
            else:
                raise ValueError(f"json must be a JSON schema (a dict or a string), got {type(self.json).__name__}")

    @property
    def kind(self) -> str:
        """The constraint this request sets: one of STRUCTURED_OUTPUT_KINDS."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """Sampling parameters for text generation.

    The fields follow the OpenAI completions API, as in vLLM:

    - n: number of outputs to return for the prompt.
    - presence_penalty / frequency_penalty: in [-2, 2]; > 0 discourages tokens already generated
      (once / in proportion to their count).
    - repetition_penalty: > 0; > 1 discourages tokens seen in the prompt or the output.
    - temperature: >= 0; 0 means greedy. Positive values below 0.01 are raised to 0.01.
    - top_p: in (0, 1]; 1 keeps every token.
    - top_k: number of most likely tokens to keep; 0 (or -1) keeps every token.
    - min_p: in [0, 1]; minimum probability relative to the most likely token, 0 disables it.
    - seed: random seed for this request (None: unseeded; -1 also means unseeded).
    - stop: string(s) that end generation; they are left out of the text unless
      include_stop_str_in_output is True.
    - stop_token_ids: token ids that end generation; they stay in the output unless special.
    - ignore_eos: keep generating after the EOS token.
    - max_tokens: maximum tokens per output (None: up to the model's context length).
    - min_tokens: tokens to generate before EOS or stop_token_ids may end the output.
    - logprobs: number of top log probabilities per output token (the sampled token's is always
      returned too); None returns none, -1 the whole vocabulary.
    - prompt_logprobs: the same, per prompt token.
    - detokenize: produce text (False returns token ids only; stop strings then cannot work).
    - skip_special_tokens / spaces_between_special_tokens: how special tokens are detokenized.
    - include_stop_str_in_output: keep the matched stop string at the end of the text.
    - output_kind: what streamed outputs carry (see RequestOutputKind).
    - logit_bias: {token_id: bias} added to the logits; each bias is clamped to [-100, 100].
    - allowed_token_ids: only these tokens may be sampled (a non-empty list).
    - bad_words: words never generated: a word's last token is banned wherever the output so far
      ends with its other tokens (each word tokenized with and without a leading space, as vLLM).
    - structured_outputs: a StructuredOutputsParams (a JSON schema, regex, choice or grammar the
      output must follow; the tokens it rules out are masked at every step).
    - extra_args: anything for custom logits processors (LLM(logits_processors=...)) to read.
    - best_of: vLLM's field; only None or 1 are accepted (vLLM V1 dropped best_of > 1 as well).

    Invalid values raise ValueError with a message naming the field.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None
    best_of: int | None = None  # accepted as vLLM's field; V1 engines (vLLM's and Octavo) refuse > 1

    # Derived in __post_init__ / by the engine, not arguments (same names as vLLM).
    output_text_buffer_length: int = field(default=0, init=False, repr=False)
    _eos_token_id: int | None = field(default=None, init=False, repr=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if _is_int(self.temperature) or isinstance(self.temperature, float):
            if 0 < self.temperature < _MIN_TEMPERATURE:
                logger.warning(
                    "temperature %s is less than %s, which may cause numerical errors nan or inf "
                    "in tensors. We have maxed it out to %s.",
                    self.temperature, _MIN_TEMPERATURE, _MIN_TEMPERATURE)
                self.temperature = _MIN_TEMPERATURE
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple, set)):
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        else:
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}.")
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.logit_bias is not None:
            self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _normalize_allowed_token_ids(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = _normalize_bad_words(self.bad_words)

        # Characters held back while streaming so that a stop string arriving in pieces
        # is never shown (see octavo.engine.detokenizer.check_stop_strings).
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1

        self._verify_args()
        self.top_k = min(self.top_k, TOP_K_MAX)

        if self.temperature < _SAMPLING_EPS:
            # Greedy: the truncation knobs mean nothing, so reset them as vLLM does.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _verify_args(self) -> None:
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of > 1):
            raise ValueError(f"best_of is not supported (it is {self.best_of!r}); like vLLM V1, Octavo returns "
                             "the n samples it generates. Use n instead.")
        if not _is_int(self.n):
            raise ValueError(f"n must be an int, but is of type {type(self.n)}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be a finite number, got {self.repetition_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an integer, got {type(self.top_k).__name__}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}.")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}] (a 64-bit integer), got {self.seed}.")
        if self.max_tokens is not None:
            if not _is_int(self.max_tokens):
                raise ValueError(f"max_tokens must be an int or None, got {self.max_tokens!r}.")
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not _is_int(self.min_tokens):
            raise ValueError(f"min_tokens must be an int, got {self.min_tokens!r}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or (value != -1 and value < 0)):
                raise ValueError(f"{name} must be non-negative or -1, got {value}.")
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {min(self.stop_token_ids)}.")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        for s in self.stop:
            check_utf8("a stop string", s)
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}.")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {type(self.extra_args).__name__}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def eos_token_id(self) -> int | None:
        """The EOS token that ends this request (None when ignore_eos); set by the engine."""
        return self._eos_token_id

    @property
    def all_stop_token_ids(self) -> set[int]:
        """stop_token_ids plus the model's EOS id(s): what min_tokens must suppress."""
        return self._all_stop_token_ids

    def update_from_generation_config(self, generation_config: dict[str, Any],
                                      eos_token_id: int | None = None) -> None:
        """Adds the model's EOS token(s) (tokenizer EOS plus generation_config's eos_token_id)."""
        if not self.ignore_eos:
            self._eos_token_id = eos_token_id
        if eos_token_id is not None:
            self._all_stop_token_ids.add(eos_token_id)
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is None:
            return
        eos_ids = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
        eos_ids.discard(eos_token_id)  # the primary EOS is checked on its own
        if eos_ids:
            self._all_stop_token_ids.update(eos_ids)
            if not self.ignore_eos:
                self.stop_token_ids = list(dict.fromkeys([*self.stop_token_ids, *sorted(eos_ids)]))

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """bad_words as token id sequences; set by the engine (update_from_tokenizer)."""
        return self._bad_words_token_ids

    def update_from_tokenizer(self, tokenizer) -> None:
        """Tokenizes bad_words as vLLM does: each word (left-stripped) without and with a leading
        space, both kept where the spaced form is a different sequence of the same length."""
        self._bad_words_token_ids = []
        for word in self.bad_words or []:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError("bad_words entries must tokenize to at least one token.")
            self._bad_words_token_ids.append(list(plain))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                self._bad_words_token_ids.append(list(spaced))

    def sample_seed(self, index: int) -> int | None:
        """The seed of the index-th of the n samples: seed + index (as vLLM's child requests),
        wrapped into 64 bits."""
        if self.seed is None:
            return None
        return (self.seed + index - SEED_MIN) % (1 << 64) + SEED_MIN

    def clone(self) -> SamplingParams:
        """A deep copy: the engine may mutate its copy (EOS ids) without touching the caller's."""
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        return (
            f"SamplingParams(n={self.n}, presence_penalty={self.presence_penalty}, "
            f"frequency_penalty={self.frequency_penalty}, repetition_penalty={self.repetition_penalty}, "
            f"temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}, "
            f"min_p={self.min_p}, seed={self.seed}, stop={self.stop}, "
            f"stop_token_ids={self.stop_token_ids}, "
            f"include_stop_str_in_output={self.include_stop_str_in_output}, "
            f"ignore_eos={self.ignore_eos}, max_tokens={self.max_tokens}, "
            f"min_tokens={self.min_tokens}, logprobs={self.logprobs}, "
            f"prompt_logprobs={self.prompt_logprobs}, skip_special_tokens={self.skip_special_tokens}, "
            f"spaces_between_special_tokens={self.spaces_between_special_tokens})"
        )


def _normalize_allowed_token_ids(ids: Any) -> list[int]:
    """vLLM's messages; the vocabulary bound is the engine's check."""
    if not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids):
        raise ValueError(f"allowed_token_ids must be a list of integers, got {ids!r}.")
    if not ids:
        raise ValueError("allowed_token_ids is not None and empty!")
    if min(ids) < 0:
        raise ValueError("allowed_token_ids contains out-of-vocab token id!")
    return list(dict.fromkeys(int(t) for t in ids))


# Every step checks each bad word against the output's end: bounded, so that one request cannot
# slow the steps of all the others.
MAX_BAD_WORDS = 1024


def _normalize_bad_words(words: Any) -> list[str]:
    if isinstance(words, str) or not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
        raise ValueError(f"bad_words must be a list of strings, got {words!r}.")
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words holds {len(words)} words, more than the {MAX_BAD_WORDS} allowed.")
    if any(not w.strip() for w in words):
        raise ValueError(f"bad_words cannot contain an empty string. Got bad_words={list(words)!r}")
    for word in words:
        check_utf8("a bad word", word)
    return list(words)


def _normalize_logit_bias(logit_bias: Any) -> dict[int, float]:
    """Token ids may come as strings (JSON keys); biases are clamped to [-100, 100] as in vLLM."""
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to bias, got {type(logit_bias).__name__}.")
    result: dict[int, float] = {}
    bad_keys = []
    for token, bias in logit_bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            bad_keys.append(token)
            continue
        if isinstance(token, float) and not token.is_integer():
            bad_keys.append(token)
            continue
        if token_id < 0:
            raise ValueError(f"logit_bias token ids must be non-negative, got {token_id}.")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
            raise ValueError(f"logit_bias values must be numbers, got {bias!r} for token {token_id}.")
        result[token_id] = min(_MAX_LOGIT_BIAS, max(-_MAX_LOGIT_BIAS, float(bias)))
    if bad_keys:
        raise ValueError(
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad_keys!r}")
    return result


@dataclass
class BeamSearchParams:
    """Beam search's parameters, as vLLM's (LLM.beam_search; octavo/beam_search.py)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
