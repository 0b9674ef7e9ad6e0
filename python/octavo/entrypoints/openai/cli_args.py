"""``octavo serve``'s options, apart from the server so that ``octavo --help`` stays light."""

from ..device_arg import add_device_argument


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
    parser.add_argument("--quantization", "-q", default=None, choices=["int8", "int4"],
                        help="quantize the projections at load time (round to nearest; LM head in int8)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="answer 503 with Retry-After while this many requests are waiting (default: no limit)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    add_device_argument(parser)
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
