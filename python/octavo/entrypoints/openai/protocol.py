"""Request bodies of the OpenAI-compatible API (the fields vLLM accepts that Octavo supports),
the OpenAI-style error body, and the mapping from a request to ``SamplingParams``.

Unknown fields are accepted and ignored, as in vLLM, so clients that send extra OpenAI fields
keep working; a field Octavo cannot honour is refused with a 400. response_format
and vLLM's ``structured_outputs`` become the request's StructuredOutputsParams.
"""

from __future__ import annotations

import json
import math
from http import HTTPStatus
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ... import structured_output
from ...sampling_params import SEED_MAX, SEED_MIN, BeamSearchParams, SamplingParams, StructuredOutputsParams

# Past this, JSON cannot carry the value (-inf); vLLM reports -9999.0 the same way.
MIN_LOGPROB = -9999.0


class APIError(Exception):
    """An error the client caused or must know about, sent as an OpenAI-style error body."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.headers = message, int(status), param, headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param)


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                405: "invalid_request_error", 429: "rate_limit_error", 503: "server_overloaded", 504: "timeout"}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's shape ({"error": {message, type, param, code}}) with vLLM's integer code."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status}}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)  # vLLM's bounds: torch's int64
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0  # lower runs first, with --scheduling-policy priority
    return_tokens_as_token_ids: bool | None = None  # None: the server's --return-tokens-as-token-ids
    prompt_logprobs: int | None = None
    return_token_ids: bool = False  # prompt_token_ids and token_ids in the response
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep this many (-1: max_model_len)
    truncation_side: Literal["left", "right"] = "left"  # which end truncate_prompt_tokens cuts
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's StructuredOutputsParams fields
    vllm_xargs: dict[str, Any] | None = None  # SamplingParams.extra_args, for custom logits processors
    use_beam_search: bool = False  # n beams; the n best come back
    length_penalty: float = 1.0  # beam search's score: cum_logprob / length ** length_penalty

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError("Stream options can only be defined when `stream=True`.", param="stream_options")

    def check_prompt_logprobs(self) -> None:
        """vLLM's rules and messages."""
        if self.prompt_logprobs is None:
            return
        if self.prompt_logprobs < 0:
            raise APIError("`prompt_logprobs` must be a positive value.", param="prompt_logprobs")
        if self.stream:
            raise APIError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")

    def truncate(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt cut to truncate_prompt_tokens tokens, from truncation_side (vLLM's rule)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return token_ids
        keep = max_model_len if keep == -1 else keep
        if keep > max_model_len:
            raise APIError(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_model_len})."
                           " Please, select a smaller truncation size.", param="truncate_prompt_tokens")
        if len(token_ids) <= keep:
            return token_ids
        return token_ids[-keep:] if self.truncation_side == "left" else token_ids[:keep]

    def sampling_params(self, defaults: dict[str, Any], max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """``defaults``: the model's generation_config sampling defaults, used for fields the
        request leaves out (vLLM's --generation-config auto)."""
        self.check_stream_options()
        self.check_prompt_logprobs()

        def pick(name: str, fallback):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        if defaults.get("max_tokens") is not None:  # the model's max_new_tokens bounds every request, as in vLLM
            max_tokens = defaults["max_tokens"] if max_tokens is None else min(max_tokens, defaults["max_tokens"])

        asked = [k for k in (prompt_logprobs, self.prompt_logprobs) if k is not None]
        prompt_logprobs = max(asked) if asked else None
        try:
            return SamplingParams(
                n=1 if self.use_beam_search else self.n,  # beam search runs its own requests
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=pick("repetition_penalty", 1.0), temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0), top_k=pick("top_k", 0), min_p=pick("min_p", 0.0), seed=self.seed,
                stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=self.logit_bias,
                allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                structured_outputs=self.structured_outputs_params(), extra_args=self.vllm_xargs)
        except ValueError as e:
            raise APIError(str(e)) from None

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams | None:
        """With use_beam_search: vLLM's mapping (beam_width = n; temperature 0 unless given). The
        beams come back together once the search ends (streamed, in one chunk each)."""
        if not self.use_beam_search:
            return None
        if not math.isfinite(self.length_penalty):
            raise APIError("length_penalty must be a finite number.", param="length_penalty")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                temperature=self.temperature or 0.0, length_penalty=self.length_penalty,
                                include_stop_str_in_output=self.include_stop_str_in_output)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """response_format (which wins, as in vLLM) or structured_outputs, checked by the backend
        that will compile it: a 400 with its message otherwise."""
        rf = self.response_format
        param = "response_format" if rf is not None and rf.get("type", "text") != "text" else "structured_outputs"
        try:
            params = self.response_format_params()
            if params is None and self.structured_outputs is not None:
                params = StructuredOutputsParams(**self.structured_outputs)
            if params is not None:
                structured_output.validate(params)
        except (TypeError, ValueError) as e:
            raise APIError(str(e), param=param) from None
        return params

    def response_format_params(self) -> StructuredOutputsParams | None:
        """OpenAI's response_format as vLLM maps it: json_object, json_schema (its "schema"; strict
        or not, the schema is enforced) or a structural tag; None for text."""
        rf = self.response_format
        kind = None if rf is None else rf.get("type", "text")
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict):
                raise ValueError("When response_format type is 'json_schema', the 'json_schema' field must be "
                                 "provided.")
            schema = spec.get("schema", spec.get("json_schema"))
            if not isinstance(schema, (dict, str)):
                raise ValueError("response_format.json_schema must hold the JSON schema in 'schema'.")
            return StructuredOutputsParams(json=schema)
        if kind == "structural_tag":
            return StructuredOutputsParams(structural_tag=json.dumps(rf))
        raise ValueError(f"response_format type must be one of 'text', 'json_object', 'json_schema', "
                         f"'structural_tag', got {kind!r}")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=-1)  # -1: the whole vocabulary (--max-logprobs permitting)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True  # with --reasoning-parser: return the reasoning beside the content
    # vLLM's extra chat fields.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # put the last message's content in front of the reply when it is the assistant's


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]
