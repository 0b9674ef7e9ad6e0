"""What an executor needs to start its workers and size their KV caches (plain, picklable data)."""

from __future__ import annotations

from dataclasses import dataclass

from ..speculative import SpeculativeConfig


@dataclass
class WorkerConfig:
    """How each worker loads its model."""

    model: str
    dtype: str = "auto"
    load_format: str = "safetensors"
    device: str = "cpu"  # already resolved: "cpu" or "cuda:N"
    # "int8" / "int4" / "w4a8" / "w8a8": rounded to nearest as the weights are read; "gguf_a8": a
    # GGUF file's blocks multiply int8-rounded inputs
    quantization: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages, each holding a contiguous range of the layers
    enable_expert_parallel: bool = False  # MoE layers: whole experts per tensor-parallel rank
    logits_processors: tuple = ()  # LogitsProcessor classes or "module:Class" names (logits_processor.py)
    speculative: SpeculativeConfig | None = None  # with method "draft_model", the driver loads the draft model
    kv_cache_dtype: str = "auto"  # what the KV cache holds (kv_cache.py): "auto" = the model's dtype

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class CacheConfig:
    """How the KV cache is sized: kv_cache_memory_bytes when given, else (on a GPU) what
    gpu_memory_utilization leaves after the weights and a profiled step of the largest size."""

    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    num_speculative_tokens: int = 0  # drafts a request may verify per step: rows of logits beyond one each
