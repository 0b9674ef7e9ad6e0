"""Which slice of each weight a tensor-parallel rank holds, and which layers a pipeline stage holds.

Attention is cut at KV-group boundaries: a rank holds whole KV heads with the query heads that
read them, so its attention is ordinary GQA over its own heads and nothing crosses ranks until
the output projection. The cut may be uneven (3 KV groups over 2 ranks: 2 + 1), which is how a
model whose heads do not divide by the rank count still runs. With fewer KV heads than ranks,
each KV head is replicated on the ranks that share its query heads. The MLP's intermediate
dimension and the vocabulary are cut into near-equal contiguous ranges.
"""

from __future__ import annotations

from dataclasses import dataclass


def split(total: int, parts: int, index: int) -> tuple[int, int]:
    """[begin, end) of part ``index`` when ``total`` is cut into ``parts`` contiguous ranges
    whose sizes differ by at most one (the first ones larger)."""
    base, extra = divmod(total, parts)
    begin = index * base + min(index, extra)
    return begin, begin + base + (index < extra)


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``world``: its heads, intermediate rows and vocabulary rows."""

    rank: int = 0
    world: int = 1
    q_heads: tuple[int, int] = (0, 0)   # [begin, end) of the model's query heads
    kv_heads: tuple[int, int] = (0, 0)  # [begin, end) of its KV heads
    intermediate: tuple[int, int] = (0, 0)
    vocab: tuple[int, int] = (0, 0)
    # Mixture-of-experts layers place whole experts on ranks instead of cutting every expert
    # (layers/moe.py); attention and dense layers are cut as without it.
    expert_parallel: bool = False

    @classmethod
    def of(cls, config, rank: int = 0, world: int = 1, expert_parallel: bool = False) -> TPShard:
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a tensor-parallel group of {world}")
        group = heads // kv_heads  # query heads per KV head
        if kv_heads >= world:
            kv = split(kv_heads, world, rank)
            q = (kv[0] * group, kv[1] * group)
        else:  # fewer KV heads than ranks: ranks share a KV head, each with part of its query heads
            if world % kv_heads:
                raise ValueError(f"tensor_parallel_size {world} must be a multiple of the model's "
                                 f"{kv_heads} KV heads when it is larger")
            sharing = world // kv_heads
            if group < sharing:
                raise ValueError(f"tensor_parallel_size {world} is more than the model's {heads} query heads")
            head = rank // sharing
            kv = (head, head + 1)
            first, last = split(group, sharing, rank % sharing)
            q = (head * group + first, head * group + last)
        if config.intermediate_size < world or config.vocab_size < world:
            raise ValueError(f"tensor_parallel_size {world} is larger than the model's layers can be cut")
        return cls(rank, world, q, kv, split(config.intermediate_size, world, rank), split(config.vocab_size, world, rank),
                   expert_parallel)

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]


@dataclass(frozen=True)
class PPStage:
    """Pipeline stage ``rank`` of ``world``: the decoder layers [begin, end) it holds. The first
    stage also holds the embedding, the last the final norm and the LM head (and the embedding
    when the LM head is tied to it)."""

    rank: int = 0
    world: int = 1
    layers: tuple[int, int] = (0, 0)

    @classmethod
    def of(cls, config, rank: int = 0, world: int = 1) -> PPStage:
        if not 0 <= rank < world:
            raise ValueError(f"stage {rank} is not in a pipeline of {world}")
        if world > config.num_hidden_layers:
            raise ValueError(f"pipeline_parallel_size {world} is more than the model's {config.num_hidden_layers} layers")
        return cls(rank, world, split(config.num_hidden_layers, world, rank))

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1
