"""Multi-LoRA in the worker: per-slot stacked buffers (weights.py), the per-batch slot
mapping (mapping.py), the one choice of how each layer runs LoRA (layout.py), the slot
tables (manager.py) and adapter movement: disk -> CPU tier (reader.py, into file images:
file_image.py, in pages of pinned_pool.py, held by cpu_tier.py) -> GPU slot (slot_copy.py,
behind each slot's last reader: fences.py), driven beside the steps by loader.py."""
