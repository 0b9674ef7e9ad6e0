"""``octavo serve``'s options, apart from the server so that ``octavo --help`` stays light."""

import argparse
import json

from ..device_arg import add_device_argument
from .reasoning_parsers import PARSERS as REASONING_PARSERS
from .tool_parsers import PARSERS

# `vllm serve` options for features Octavo does not have yet: refused with the feature's name
# rather than argparse's bare "unrecognized arguments".
UNSUPPORTED_VLLM_OPTIONS = {
    ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank"): "LoRA adapters",
    ("--guided-decoding-backend",): "guided decoding (vLLM's older name; use --structured-outputs-config)",
    ("--kv-transfer-config",): "KV cache transfer (disaggregated prefill)",
    ("--cpu-offload-gb", "--kv-offloading-size"): "CPU offload",
    ("--limit-mm-per-prompt", "--mm-processor-kwargs"): "multimodal inputs",
    ("--enable-sleep-mode",): "sleep mode",
}


class _Unsupported(argparse.Action):
    def __init__(self, option_strings, dest, feature: str, **kwargs):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.feature = feature

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.feature} is not supported by Octavo yet")


def add_arguments(parser) -> None:
    """``octavo serve``'s options, named as ``vllm serve``'s."""
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $OCTAVO_API_KEY)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="name(s) clients use for the model; the first is the one responses carry "
                             "(default: the model argument)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", "-q", default=None,
                        choices=["int8", "int4", "q4_1", "w4a8", "w8a8", "fp8", "gguf_a8"],
                        help="quantize the projections at load time (round to nearest; LM head in int8); gguf_a8: "
                             "int8 inputs for a GGUF file's blocks")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="answer 503 with Retry-After while this many requests are waiting (default: no limit)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=["auto", "bfloat16", "float16", "fp8", "fp8_e4m3"],
                        help="what the KV cache holds: the model's dtype, or (CPU) bfloat16 / float16, half a float32 "
                             "model's bytes, or fp8 (E4M3, scaled by the checkpoint's k_scale / v_scale or 1), a "
                             "quarter")
    add_device_argument(parser)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split the model over this many worker processes (tensor parallel)")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="split the model's layers into this many stages, a worker process each, one batch "
                             "per stage in flight (pipeline parallel)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="mixture-of-experts layers: place whole experts on the tensor-parallel ranks "
                             "instead of cutting every expert over them")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="run this many engine cores (each with the whole model and its own KV cache); "
                             "requests go to the least loaded")
    parser.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
                        help="where the workers run: 'uni' (the engine core's process), 'mp' (a process each; "
                             "the default for more than one) or 'ray' (a Ray actor each, on a Ray cluster)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="on a GPU, run decode steps eagerly instead of replaying CUDA graphs")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="on a GPU, the fraction of its memory this server may use (weights, activations "
                             "and the KV cache) when --kv-cache-memory-bytes is not given")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="the most logprobs a request may ask for per token (-1: the whole vocabulary)")
    parser.add_argument("--max-n", type=int, default=128,
                        help="the most samples (n) one request may ask for; more get a 400 (Octavo's own limit)")
    parser.add_argument("--max-request-bytes", type=int, default=16 << 20,
                        help="request bodies larger than this get a 413 (Octavo's own limit)")
    parser.add_argument("--chat-template", default=None,
                        help="a chat template file, or the template itself, used instead of the model's")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="abort a request that has not finished after this many seconds (504)")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="on SIGINT/SIGTERM, seconds to let in-flight requests finish before aborting them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    parser.add_argument("--generation-config", default="auto",
                        help="sampling defaults for fields a request leaves out: 'auto' (the model's "
                             "generation_config.json), 'vllm' (none: vLLM's defaults) or a folder with one")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                        help="priority: requests with a lower `priority` field run first")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="accepted for vLLM's command lines; Octavo never runs a model's own code")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="usage.prompt_tokens_details.cached_tokens: prompt tokens read from the prefix cache")
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true", help="serve GET /tokenizer_info")
    parser.add_argument("--enable-server-load-tracking", action="store_true",
                        help="serve GET /load: the generation requests in flight")
    parser.add_argument("--enable-request-id-headers", action="store_true",
                        help="answer with an X-Request-Id header (the client's, or a new one)")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="logprobs name tokens as 'token_id:N' instead of their text")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let tool_choice be "auto": the model decides, --tool-call-parser finds its calls')
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                        help="the format the model writes tool calls in")
    parser.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                        help='leave the tools out of the chat template when tool_choice is "none"')
    parser.add_argument("--logits-processors", nargs="+", default=None, metavar="MODULE:CLASS",
                        help="custom logits processors (vLLM v1's LogitsProcessor subclasses); requests pass them "
                             "arguments in vllm_xargs")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="return a reasoning model's thinking (<think>...</think>) apart from its answer")
    parser.add_argument("--structured-outputs-config", type=json.loads, default=None,
                        help='JSON, e.g. {"backend": "xgrammar"}: the grammar backend ("auto": xgrammar, or '
                             "llguidance where xgrammar refuses)")
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help='JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}: '
                             "speculative decoding (drafts by prompt lookup, a draft model or an EAGLE head, "
                             "verified exactly)")
    for options, feature in UNSUPPORTED_VLLM_OPTIONS.items():
        parser.add_argument(*options, action=_Unsupported, feature=feature)
