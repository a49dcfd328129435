"""Building blocks of the Llama-family decoder.

Every projection is a `SlotLinear`: its forward takes the batch's `LoraMapping` (each
token's adapter slot, -1 = base model) and, when LoRA is enabled, adds each slot's delta
from its stacked buffers (`self.lora`), for fused qkv, o, gate_up, down and lm_head alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ledgerserve.kernels import ops
from ledgerserve.kernels.lora_types import LoraDelta, LoraLayout
from ledgerserve.kernels.peer_buffers import RowSend
from ledgerserve.worker_proc.lora import layout as lora_layout
from ledgerserve.worker_proc.lora.mapping import LoraMapping
from ledgerserve.worker_proc.lora.weights import LoraWeights
from ledgerserve.worker_proc.models.config import ModelConfig
from ledgerserve.worker_proc.models.shard import LayerShard, down_shard, gate_up_shard, vocab_shard, whole
from ledgerserve.worker_proc.parallel import TpGroup


@dataclass(frozen=True)
class Deferred:
    """A projection's output with what is still owed on it: its LoRA delta, which the kernel that
    consumes it adds (kernels/lora_types.LoraDelta), and, from a row-parallel layer at tensor
    parallel > 1, its all-reduce: `partial` is this rank's [num_tokens, columns] sum, and `y` and
    `delta.h` are views of it (reduce_add_rms_norm settles both). `sent_part`: the fused all-reduce
    norm's part to which the GEMV already sent y's row (ops.row_send), None where it did not."""

    y: torch.Tensor  # [num_tokens, out_features]
    delta: LoraDelta | None = None
    partial: torch.Tensor | None = None
    sent_part: int | None = None


class SlotLinear(nn.Module):
    """y = x W^T + b, with the output split into named shards (fused projections).

    `output_sizes` lists the shards (e.g. [q, k, v]); checkpoint tensors load into
    their row range with `load_shard`. With stacked LoRA (`attach_lora(..., stack=True)`)
    the base weight and every slot's A share one tensor, so a decode step's single GEMM
    returns the base output and every slot's shrink; only the expand runs after it.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        shard: LayerShard | None = None,
        group: TpGroup | None = None,
    ) -> None:
        """`shard`: the part of the checkpoint's tensors this rank holds (models/shard.py; default:
        all of them); a row-parallel shard all-reduces its output over `group`."""
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.shard = shard or whole(in_features, self.output_sizes)
        self.group = group or TpGroup()
        self.defers_reduce = self.shard.reduce and self.group.size > 1  # forward_deferred leaves the all-reduce
        out_features = sum(output_sizes)
        # zeros: rows past the vocabulary (padding) and a row-parallel bias off rank 0 stay zero
        self.weight = nn.Parameter(torch.zeros(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.lora: LoraWeights | None = None  # set by attach_lora when LoRA is enabled
        # [out + max_loras * num_slices * max_rank, in] and its zero-padded bias; `weight` views its top rows
        self.stacked: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor, lora: LoraMapping | None = None) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        return self._forward(x, self._lora_plan(x, lora))

    def forward_deferred(self, x: torch.Tensor, lora: LoraMapping | None, part: int | None = None) -> Deferred:
        """forward, except that on the stacked decode path the LoRA delta comes back unapplied, for
        the kernel that consumes the output to add (one launch fewer), and that a row-parallel
        layer's all-reduce is left to the consumer too (reduce_add_rms_norm), except on the
        unstacked LoRA path, which reduces base output and shrink before its expand. `part`: the
        consuming norm's part of the fused all-reduce's buffer, where the GEMV may send the row."""
        plan = self._lora_plan(x, lora)
        if plan is None and self.defers_reduce:
            send = self._row_send(x, self.weight, None, part)
            y = ops.linear(x, self.weight, self.bias, send)  # [num_tokens, out]
            return Deferred(y, None, y, None if send is None else part)
        if not isinstance(plan, lora_layout.Stacked):
            return Deferred(self._forward(x, plan))
        assert self.lora is not None
        out, send = self._stacked_gemm(x, plan.num_slots, part)
        y, h = self._split_stacked(out, plan.num_slots)
        sent_part = None if send is None else part
        return Deferred(y, LoraDelta(h, self.lora, plan.token_slots), out if self.defers_reduce else None, sent_part)

    def _row_send(
        self, x: torch.Tensor, weight: torch.Tensor, lora: LoraWeights | None, part: int | None
    ) -> RowSend | None:
        """Where a row-parallel layer's GEMV sends its output row (ops.row_send), if it can."""
        if part is None or not self.defers_reduce:
            return None
        return ops.row_send(x, weight, self.weight.shape[0], lora, self.group.peer_buffers, part)

    def _lora_plan(self, x: torch.Tensor, lora: LoraMapping | None) -> lora_layout.Stacked | LoraLayout | None:
        if self.lora is None or lora is None:
            return None
        return lora_layout.choose(self.lora, self.stacked is not None, lora, x)

    def _forward(self, x: torch.Tensor, plan: lora_layout.Stacked | LoraLayout | None) -> torch.Tensor:
        if plan is None:
            return self._reduce(ops.linear(x, self.weight, self.bias))
        assert self.lora is not None
        if isinstance(plan, lora_layout.Stacked):
            y, h = self._split_stacked(self._reduce(self._stacked_gemm(x, plan.num_slots)[0]), plan.num_slots)
            ops.lora_expand_stacked(y, h, self.lora, plan.tiles)
            return y
        y = ops.linear(x, self.weight, self.bias)
        if not self.shard.reduce:
            self.lora.apply(x, y, plan)
            return y
        # row-parallel: the base output and the [num_slices, num_tokens, max_rank] shrink are partial sums
        buf = ops.lora_shrink(x, self.lora, plan)
        y = self._reduce(y)
        ops.lora_expand(y, self._reduce(buf), self.lora, plan)
        return y

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's partial output summed over the group (in place); y otherwise."""
        if not self.shard.reduce or self.group.size == 1:
            return y
        return self.group.all_reduce(y.contiguous())

    def _stacked_gemm(
        self, x: torch.Tensor, num_slots: int, part: int | None = None
    ) -> tuple[torch.Tensor, RowSend | None]:
        """[num_tokens, out + num_slots * num_slices * max_rank]: the base output and x A^T of
        slots [0, num_slots) (0: all), from one GEMM; a row-parallel layer's is this rank's partial
        sum. With `part`, the GEMV sends the base output row where it can (the RowSend, else None)."""
        assert self.stacked is not None and self.lora is not None
        max_loras, num_slices, max_rank = self.lora.a.shape[:3]
        rows = self.weight.shape[0] + (num_slots or max_loras) * num_slices * max_rank
        # A copy may write the A rows of a slot no token of this step uses while this GEMM runs
        # (worker_proc/lora/fences.py): each output column reads one weight row only, and those
        # slots' columns of h are never read, so the step's output cannot change.
        weight, bias = self.stacked
        send = self._row_send(x, weight[:rows], self.lora, part)
        return ops.linear(x, weight[:rows], None if bias is None else bias[:rows], send), send

    def _split_stacked(self, out: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """_stacked_gemm's output as the base output y [num_tokens, out] (rows strided) and h
        [num_tokens, num_slots, num_slices, max_rank]."""
        assert self.lora is not None
        max_loras, num_slices, max_rank = self.lora.a.shape[:3]
        num_out = self.weight.shape[0]
        return out[:, :num_out], out[:, num_out:].unflatten(1, (num_slots or max_loras, num_slices, max_rank))

    def attach_lora(self, max_loras: int, max_rank: int, stack: bool) -> LoraWeights:
        """Hang per-slot LoRA buffers on this layer; with `stack` (worker_proc/lora/layout.stacks_a),
        A lives under the base weight."""
        weight = self.weight.data  # [out, in]
        num_a_rows = max_loras * len(self.output_sizes) * max_rank
        a = None
        if stack:
            stacked = torch.cat([weight, weight.new_zeros(num_a_rows, self.in_features)])  # [out + A rows, in]
            bias = None if self.bias is None else torch.cat([self.bias.data, self.bias.data.new_zeros(num_a_rows)])
            self.weight.data = stacked[: weight.shape[0]]
            if self.bias is not None and bias is not None:
                self.bias.data = bias[: weight.shape[0]]
            self.stacked = (stacked, bias)
            a = stacked[weight.shape[0] :].view(max_loras, len(self.output_sizes), max_rank, self.in_features)
        self.lora = LoraWeights(
            max_loras, max_rank, self.in_features, self.output_sizes, weight.dtype, weight.device, a, self.shard
        )
        return self.lora

    def load_shard(self, name: str, shard: int, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor (`name` is 'weight' or 'bias') into shard `shard`'s rows."""
        param = self.weight if name == "weight" else self.bias
        if param is None:
            raise ValueError(f"checkpoint has a {name} this layer does not")
        start = sum(self.output_sizes[:shard])
        rows = param.data[start : start + self.output_sizes[shard]]
        lo, hi = self.shard.rows[shard]  # fewer rows than the slice holds at the vocabulary's padded end
        rows = rows[: hi - lo]
        if rows.shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name} shard {shard}: {tuple(tensor.shape)} vs {tuple(rows.shape)}")
        rows.copy_(tensor)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        return ops.rms_norm(x, self.weight, self.eps)


def reduce_add_rms_norm(
    group: TpGroup, x: Deferred, residual: torch.Tensor | None, norm: RMSNorm, part: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """normed, new_residual = norm(x + its LoRA delta + residual), x summed over the ranks first
    where it is a partial sum: in the norm's kernel where the group and the shape allow
    (ops.fuses_all_reduce_norm), else by the group's all-reduce. Without a residual (the first
    layer's input, which has no delta) the new residual is x itself. `part`: which part of the fused
    kernel's buffer; the model's consecutive calls take different parts (models/llama.py)."""
    if x.partial is not None:
        peers = group.peer_buffers
        if peers is not None and ops.fuses_all_reduce_norm(x.y, x.delta, peers):
            assert x.sent_part in (None, part), (x.sent_part, part)
            sent = x.sent_part is not None
            return ops.all_reduce_add_rms_norm(x.y, residual, norm.weight, norm.eps, x.delta, peers, part, sent)
        assert x.sent_part is None  # ops.row_send sends only what this fused norm takes
        group.all_reduce_(x.partial)
    if residual is None:
        assert x.delta is None
        return norm(x.y), x.y
    return ops.fused_add_rms_norm(x.y, residual, norm.weight, norm.eps, x.delta)


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TpGroup) -> None:
        """This rank's MLP columns: gate/up column-parallel, down row-parallel."""
        super().__init__()
        hidden, local = cfg.hidden_size, cfg.local_intermediate_size
        self.gate_up_proj = SlotLinear(hidden, [local, local], cfg.mlp_bias, gate_up_shard(cfg), group)
        self.down_proj = SlotLinear(local, [hidden], cfg.mlp_bias, down_shard(cfg), group)

    def forward(self, x: torch.Tensor, lora: LoraMapping | None, part: int | None = None) -> Deferred:
        """[num_tokens, hidden], with what the next residual-add norm owes it (LoRA delta, all-reduce);
        `part`: that norm's part of the fused all-reduce's buffer."""
        gate_up = self.gate_up_proj.forward_deferred(x, lora)  # [num_tokens, 2 * intermediate]
        return self.down_proj.forward_deferred(ops.silu_and_mul(gate_up.y, gate_up.delta), lora, part)


class VocabEmbedding(nn.Module):
    """This rank's rows of the embedding table (models/shard.vocab_shard): an id outside them gives
    zeros, and the all-reduce that the first norm owes its output (Deferred.partial) sums the one
    rank that holds it."""

    def __init__(self, cfg: ModelConfig, group: TpGroup) -> None:
        super().__init__()
        self.shard = vocab_shard(cfg)
        self.group = group
        self.first_row = cfg.first_vocab_row
        self.weight = nn.Parameter(torch.zeros(cfg.local_vocab_size, cfg.hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> Deferred:  # [num_tokens] -> [num_tokens, hidden]
        if self.group.size == 1:
            return Deferred(nn.functional.embedding(ids, self.weight))
        h = ops.vocab_embedding(ids, self.weight, self.first_row)  # [num_tokens, hidden]: this rank's share
        return Deferred(h, partial=h)
