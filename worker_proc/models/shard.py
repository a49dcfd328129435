"""Which part of each checkpoint tensor a tensor-parallel rank holds (Megatron-style).

Column-parallel layers (q/k/v, gate/up, lm_head) hold rows of the output: this rank's heads, MLP
columns or vocabulary rows; their input is replicated. Row-parallel layers (o, down) hold columns
of the input and produce a partial sum that the group all-reduces; only rank 0 holds their bias,
so that the sum adds it once. The vocabulary is padded to a multiple of the rank count: rows past
it are zero. With one rank every layer holds its whole tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from ledgerserve.worker_proc.models.config import ModelConfig

Span = tuple[int, int]  # [start, stop) of one checkpoint dimension


@dataclass(frozen=True)
class LayerShard:
    rows: tuple[Span, ...]  # per output slice: its rows of the slice's checkpoint tensor
    cols: Span  # columns of the checkpoint's input dimension this rank holds
    in_full: int  # the checkpoint's input size
    out_full: tuple[int, ...]  # the checkpoint's size of each output slice
    reduce: bool = False  # row-parallel: the output is this rank's partial sum
    rank: int = 0

    def checkpoint_shape(self, attr: str, s: int) -> tuple[int, ...]:
        """The shape slice `s`'s checkpoint tensor `attr` must have, whatever part of it this rank holds."""
        return (self.out_full[s],) if attr == "bias" else (self.out_full[s], self.in_full)

    def checkpoint_index(self, attr: str, s: int) -> tuple[slice, ...] | None:
        """This rank's part of slice `s`'s checkpoint tensor `attr` ('weight' [out, in] or 'bias'
        [out]); None: the rank holds zeros in its place (a row-parallel bias on ranks past 0)."""
        rows = slice(*self.rows[s])
        if attr == "bias":
            return (rows,) if not self.reduce or self.rank == 0 else None
        return rows, slice(*self.cols)


def whole(in_features: int, output_sizes: list[int]) -> LayerShard:
    """A layer holding its whole checkpoint tensors (one rank, or a replicated layer)."""
    return LayerShard(tuple((0, n) for n in output_sizes), (0, in_features), in_features, tuple(output_sizes))


def _column(cfg: ModelConfig, starts: list[int], local: list[int], full: list[int]) -> LayerShard:
    rows = tuple((min(start, n), min(start + size, n)) for start, size, n in zip(starts, local, full))
    return LayerShard(rows, (0, cfg.hidden_size), cfg.hidden_size, tuple(full), rank=cfg.tp_rank)


def _row(cfg: ModelConfig, in_local: int) -> LayerShard:
    start = cfg.tp_rank * in_local
    hidden = cfg.hidden_size
    return LayerShard(((0, hidden),), (start, start + in_local), in_local * cfg.tp_size, (hidden,), True, cfg.tp_rank)


def qkv_shard(cfg: ModelConfig) -> LayerShard:
    """This rank's q heads, and the KV heads they use."""
    q_local, kv_local = cfg.num_local_heads * cfg.head_dim, cfg.num_local_kv_heads * cfg.head_dim
    q_start, kv_start = cfg.tp_rank * q_local, cfg.first_kv_head * cfg.head_dim
    q_full, kv_full = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return _column(cfg, [q_start, kv_start, kv_start], [q_local, kv_local, kv_local], [q_full, kv_full, kv_full])


def gate_up_shard(cfg: ModelConfig) -> LayerShard:
    local = cfg.local_intermediate_size
    start = cfg.tp_rank * local
    return _column(cfg, [start, start], [local, local], [cfg.intermediate_size] * 2)


def vocab_shard(cfg: ModelConfig) -> LayerShard:
    """The embedding's and lm_head's vocabulary rows (short of local_vocab_size at the padded end)."""
    return _column(cfg, [cfg.first_vocab_row], [cfg.local_vocab_size], [cfg.vocab_size])


def o_shard(cfg: ModelConfig) -> LayerShard:
    return _row(cfg, cfg.num_local_heads * cfg.head_dim)


def down_shard(cfg: ModelConfig) -> LayerShard:
    return _row(cfg, cfg.local_intermediate_size)
