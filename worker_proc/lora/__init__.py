"""Multi-LoRA in the worker: per-slot stacked buffers (weights.py), the per-batch slot
mapping (mapping.py), the CPU tier (cpu_tier.py) and the slot table (manager.py).

Import the submodules directly; models/layers.py imports mapping and weights, and
manager imports models/layers, so this package's root stays empty of imports."""
