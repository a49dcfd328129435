"""Training of the demo model and its demo adapters: fp32 on the CPU, a fixed seed and a
fixed thread count, so one machine builds byte-identical weights every time whatever its
number of cores (the thread count, not the cores, decides how each sum is split; two threads
run on one core as well, and train the base about 1.5x faster than one on two cores).

The text is one token stream of the corpus lines; each training row is a window of the
stream that starts at the beginning of a line, so a prompt such as "The morning" looks like
what the model saw. The base model learns every weight; an adapter learns only its LoRA
weights (`demo_lora`, saved in PEFT's format), on the corpus rewritten in its style, with the
base frozen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

NUM_THREADS = 2  # fixed: the result must not depend on the machine's core count


@dataclass(frozen=True)
class Schedule:
    num_steps: int
    lr: float
    batch_size: int
    seq_len: int
    num_warmup_steps: int
    seed: int


BASE_SCHEDULE = Schedule(num_steps=300, lr=4e-3, batch_size=16, seq_len=64, num_warmup_steps=20, seed=1)
ADAPTER_SCHEDULE = Schedule(num_steps=40, lr=1e-2, batch_size=12, seq_len=48, num_warmup_steps=5, seed=2)
LORA_RANK = 8
LORA_ALPHA = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@contextmanager
def fixed_cpu_state(seed: int) -> Iterator[None]:
    """Fixed thread count and global RNG inside; the caller's are restored after."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(NUM_THREADS)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        torch.set_num_threads(num_threads)


def line_stream(lines: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The token stream of the lines, twice over (so a window may wrap), and the offset of
    every line: ([2 * num_tokens] int64, [num_lines] int64)."""
    starts, offset = [], 0
    for ids in lines:
        starts.append(offset)
        offset += len(ids)
    flat = [t for ids in lines for t in ids]
    return torch.tensor(flat + flat, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64)


def train(
    model: torch.nn.Module,
    lines: list[list[int]],
    schedule: Schedule,
    on_step: Callable[[int, torch.Tensor], None] | None = None,
) -> float:
    """Train the model's trainable parameters on next-token prediction; returns the last loss.
    `on_step` gets each step's number (from 1) and loss."""
    stream, starts = line_stream(lines)
    num_tokens = stream.numel() // 2
    if num_tokens <= schedule.seq_len:
        raise ValueError(f"the corpus has {num_tokens} tokens, fewer than one window of {schedule.seq_len}")
    generator = torch.Generator().manual_seed(schedule.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=schedule.lr, weight_decay=0.0)
    lr_scale = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, schedule))
    offsets = torch.arange(schedule.seq_len + 1)
    model.train()
    loss = torch.zeros(())
    for step in range(schedule.num_steps):
        rows = starts[torch.randint(0, starts.numel(), (schedule.batch_size,), generator=generator)]
        window = stream[rows[:, None] + offsets]  # [batch, seq_len + 1]
        logits = model(input_ids=window[:, :-1]).logits  # [batch, seq_len, vocab]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        lr_scale.step()
        if on_step is not None:
            on_step(step + 1, loss.detach())
    model.eval()
    return loss.item()


def _lr_factor(step: int, schedule: Schedule) -> float:
    """Linear warm-up, then linear decay to a tenth."""
    warmup = min(1.0, (step + 1) / schedule.num_warmup_steps)
    return warmup * max(0.1, 1.0 - step / schedule.num_steps)
