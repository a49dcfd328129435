"""A tiny llama base, four PEFT adapters that differ in every way the worker must honour,
and their greedy PEFT references: shared by the worker's LoRA tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import AdapterLoadCompleted, AdapterSlotAssigned
from ledgerserve.shared.sampling import SamplingParams
from tests.adapter_factory import load_peft_reference, make_peft_adapter
from tests.model_factory import load_reference, make_tiny_checkpoint
from tests.reference import Reference, greedy_reference

BLOCK_SIZE = 4
NUM_BLOCKS = 160
NUM_NEW_TOKENS = 24
MAX_LORA_RANK = 32
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> make_peft_adapter keyword arguments
ADAPTERS: dict[str, dict] = {
    "head": dict(r=8, alpha=16, targets=["q_proj", "v_proj", "lm_head"], seed=1),
    "attn": dict(r=4, alpha=8, targets=["q_proj", "k_proj", "v_proj", "o_proj"], use_rslora=True, seed=2),
    "mlp": dict(r=16, alpha=8, targets=["gate_proj", "up_proj", "down_proj"], seed=3),
    "all": dict(
        r=32,
        alpha=48,
        targets=ALL_SEVEN,
        rank_pattern={"k_proj": 8, "layers.1.mlp.up_proj": 12},
        alpha_pattern={"down_proj": 16, "v_proj": 5},
        seed=4,
    ),
}
PROMPT_LENS = {"base": 13, "head": 9, "attn": 22, "mlp": 6, "all": 17}


@dataclass
class LoraSetup:
    base_dir: str
    adapter_dirs: dict[str, str]  # name -> adapter directory
    prompts: dict[str, list[int]]  # name ("base" or adapter) -> prompt
    refs: dict[str, Reference]  # name -> greedy reference of its prompt


def build_setup(root: str) -> LoraSetup:
    base_dir = make_tiny_checkpoint("llama", f"{root}/base")
    adapter_dirs = {name: make_peft_adapter(base_dir, f"{root}/{name}", **kw) for name, kw in ADAPTERS.items()}
    gen = torch.Generator().manual_seed(5)
    prompts = {name: torch.randint(3, 256, (n,), generator=gen).tolist() for name, n in PROMPT_LENS.items()}
    refs = {"base": greedy_reference(load_reference(base_dir), prompts["base"], NUM_NEW_TOKENS)}
    for name, path in adapter_dirs.items():
        refs[name] = greedy_reference(load_peft_reference(base_dir, path), prompts[name], NUM_NEW_TOKENS)
    return LoraSetup(base_dir, adapter_dirs, prompts, refs)


def lora_config(base_dir: str, **kw) -> EngineConfig:
    base = dict(
        model_dir=base_dir,
        served_model_name="tiny",
        max_model_len=128,
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_BLOCKS,
        seed=0,
        enable_lora=True,
        max_loras=6,
        max_lora_rank=MAX_LORA_RANK,
        max_cpu_loras=8,
    )
    return EngineConfig(**{**base, **kw})


def load_all(runner, setup: LoraSetup) -> dict[str, int]:
    """Load every adapter into its own slot of a ModelRunner (version_id = 100 + slot); name -> slot."""
    slots = {}
    for slot, name in enumerate(ADAPTERS):
        done = runner.adapters.load(AdapterSlotAssigned(slot, 100 + slot, setup.adapter_dirs[name]))
        assert isinstance(done, AdapterLoadCompleted) and (done.slot, done.version_id) == (slot, 100 + slot), done
        slots[name] = slot
    return slots
