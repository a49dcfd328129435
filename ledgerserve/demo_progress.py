"""What the demo build tells the user while it runs: each stage as it starts, and the step and loss
of a training every few seconds, logged (so on stderr, as every start-up line)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ledgerserve.demo")

LOG_EVERY_S = 3.0


class BuildProgress:
    """One build's progress: `stage` lines, and `training` callbacks that log a training's step
    and loss at most every `every_s` seconds (and at its last step)."""

    def __init__(self, num_stages: int, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.num_stages = num_stages
        self.every_s = every_s
        self.clock = clock
        self.started_s = clock()
        self.num_started = 0

    def start(self, target: str) -> None:
        log.info(
            "building the demo model into %s: a tokenizer, a base model and %d adapters, trained on the CPU "
            "(about half a minute, once; later starts reuse it)",
            target,
            self.num_stages - 2,
        )

    def stage(self, what: str) -> None:
        self.num_started += 1
        log.info("demo model %d/%d: %s (%.1f s so far)", self.num_started, self.num_stages, what, self.elapsed_s())

    def training(self, what: str, num_steps: int) -> Callable[[int, torch.Tensor], None]:
        """The callback `demo_train.train` calls after each step with the step (from 1) and its loss."""
        started_s = last_s = self.clock()

        def on_step(step: int, loss: torch.Tensor) -> None:
            nonlocal last_s
            now_s = self.clock()
            if now_s - last_s < self.every_s and step < num_steps:
                return
            last_s = now_s
            if step == num_steps:
                log.info("demo model: %s trained: %d steps in %.1f s, loss %.3f", what, step, now_s - started_s, loss)
                return
            left_s = (now_s - started_s) / step * (num_steps - step)
            log.info("demo model: %s step %d/%d, loss %.3f (about %.0f s left)", what, step, num_steps, loss, left_s)

        return on_step

    def done(self) -> None:
        log.info("demo model built in %.1f s", self.elapsed_s())

    def elapsed_s(self) -> float:
        return self.clock() - self.started_s
