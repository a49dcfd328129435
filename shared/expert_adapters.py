"""Expert LoRA in PEFT's `target_parameters` form, read against the base model's experts.

PEFT (0.19 and later) wraps a MoE layer's fused expert parameters: `mlp.experts.gate_up_proj`
[E, 2I, H] and `mlp.experts.down_proj` [E, H, I]. With both targeted the wrappers nest, gate_up
inside (`...mlp.experts.base_layer.lora_A/B`) and down outside (`...mlp.experts.lora_A/B`), whatever
order the config lists them in; with one targeted, its tensors are the outer ones. A is
expert-major [r * E, in]; B is interleaved [out, r * E] (worker_proc/lora/expert_layout.py).

PEFT 0.18 read the 3-D parameters with in and out swapped: its A is [r * E, out] and its B
[in, r * E]. The shapes tell the two apart unless in == out (2I == H for gate_up, H == I for
down); then the config's recorded `peft_version` decides, and without one the adapter is refused
as ambiguous. A 0.18 adapter is refused with the reason: its deltas would be transposed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ledgerserve.shared.adapter_types import AdapterError, BaseShapes
from ledgerserve.shared.bounded_json import show
from ledgerserve.shared.safetensors_header import TensorEntry

EXPERT_PARAMS = ("gate_up_proj", "down_proj")
FIRST_UNSWAPPED = (0, 19)  # the first PEFT release that reads 3-D parameters as [out, in]
_VERSION = re.compile(r"^(\d{1,4})\.(\d{1,4})(?:\.|$)")


@dataclass(frozen=True)
class ExpertModule:
    layer: int
    param: str  # gate_up_proj or down_proj
    rank: int  # per expert
    scaling: float
    a_key: str  # [rank * E, in], expert-major
    b_key: str  # [out, rank * E], interleaved


def targeted_params(target_parameters: tuple[str, ...]) -> tuple[str, ...]:
    """The expert parameters a config's target_parameters name (as `mlp.experts.<param>` or a full
    path ending so); AdapterError for any other entry."""
    params = []
    for entry in target_parameters:
        param = next(
            (p for p in EXPERT_PARAMS if entry == f"mlp.experts.{p}" or entry.endswith(f".mlp.experts.{p}")), None
        )
        if param is None:
            raise AdapterError(
                f"target_parameters entry {show(entry)} is not an expert parameter of the base model "
                f"(supported: mlp.experts.{EXPERT_PARAMS[0]}, mlp.experts.{EXPERT_PARAMS[1]})."
            )
        params.append(param)
    return tuple(p for p in EXPERT_PARAMS if p in params)


def expert_modules(params: tuple[str, ...], base: BaseShapes, rank: int, scaling: float) -> list[ExpertModule]:
    """One module per sparse layer and targeted parameter, with the tensor keys PEFT saves it under."""
    if params and not base.sparse_layers:
        raise AdapterError("The adapter targets expert parameters, but the base model has no experts.")
    modules = []
    for layer in base.sparse_layers:
        prefix = f"base_model.model.model.layers.{layer}.mlp.experts"
        for param in params:
            inner = len(params) == 2 and param == "gate_up_proj"  # the wrapper nested inside
            stem = f"{prefix}.base_layer" if inner else prefix
            modules.append(ExpertModule(layer, param, rank, scaling, f"{stem}.lora_A.weight", f"{stem}.lora_B.weight"))
    return modules


def in_out(base: BaseShapes, param: str) -> tuple[int, int]:
    """(in, out) of one expert of `param`, as PEFT 0.19 and later read it."""
    h, i = base.hidden_size, base.expert_intermediate_size
    return (h, 2 * i) if param == "gate_up_proj" else (i, h)


def check_module(m: ExpertModule, tensors: dict[str, TensorEntry], base: BaseShapes, peft_version: str | None) -> None:
    """The module's A and B have the shapes of its form; AdapterError saying why not."""
    for key in (m.a_key, m.b_key):
        if key not in tensors:
            raise AdapterError(f"The adapter's weights lack tensor {key}.")
    width = m.rank * base.num_experts
    n_in, n_out = in_out(base, m.param)
    got = (tuple(tensors[m.a_key].shape), tuple(tensors[m.b_key].shape))
    current, swapped = ((width, n_in), (n_out, width)), ((width, n_out), (n_in, width))
    old = _before_unswapped(peft_version)
    where = f"layer {m.layer} mlp.experts.{m.param}"
    if got == current and (got != swapped or old is False):
        if old:
            raise AdapterError(
                f"The expert LoRA of {where} has the shapes of PEFT 0.19 or later, but the config records "
                f"peft_version {show(peft_version)}; refused rather than guess which way round it is."
            )
        return
    if got == swapped and got == current and old is None:
        raise AdapterError(
            f"The expert LoRA of {where} is ambiguous: its in and out sizes are equal ({n_in}), so only the "
            "config's peft_version tells PEFT 0.18's transposed form from the current one, and it records none."
        )
    if got == swapped:
        raise AdapterError(
            f"The expert LoRA of {where} was written by PEFT 0.18 or earlier, which read the 3-D expert "
            "parameters with in and out swapped; its deltas would be transposed. Save it again with PEFT 0.19 or later."
        )
    raise AdapterError(
        f"The expert LoRA of {where} has A {list(got[0])} and B {list(got[1])}; rank {m.rank} over "
        f"{base.num_experts} experts needs A {list(current[0])} and B {list(current[1])}."
    )


def _before_unswapped(peft_version: str | None) -> bool | None:
    """Whether the recorded PEFT version predates 0.19; None when none is recorded or it is unreadable."""
    if not isinstance(peft_version, str) or (m := _VERSION.match(peft_version)) is None:
        return None
    return (int(m.group(1)), int(m.group(2))) < FIRST_UNSWAPPED


PROJS = ("gate", "up", "down")


@dataclass(frozen=True)
class PerExpertModule:
    """One projection of one sparse layer in the per-expert 2-D form (transformers 4's expert
    modules, `...experts.{e}.gate_proj` or Mixtral's `w1` / `w3` / `w2`): expert e's A [r, in] and
    B [out, r] under its own keys; None where the adapter leaves expert e alone (a zero delta)."""

    layer: int
    proj: str  # gate, up or down
    rank: int
    scaling: float
    a_keys: tuple[str | None, ...]  # one per expert
    b_keys: tuple[str | None, ...]


def per_expert_module_names(base: BaseShapes, layer: int, proj: str) -> list[str]:
    """The module path of each expert's `proj` in `layer`, as transformers 4 named them."""
    block, *names = base.per_expert_names
    return [f"model.layers.{layer}.{block}.experts.{e}.{names[PROJS.index(proj)]}" for e in range(base.num_experts)]


def per_expert_modules(
    base: BaseShapes, targets: Callable[[str], bool], rank_scaling: Callable[[str], tuple[int, float]]
) -> list[PerExpertModule]:
    """The per-expert modules the config targets (`targets`, PEFT's rule for a module path), each
    with its rank and scaling (`rank_scaling`): one per sparse layer and projection, refused where
    the targeted experts of one differ in either (the engine keeps one of each per projection)."""
    modules = []
    for layer in base.sparse_layers:
        for proj in PROJS:
            names = [name if targets(name) else None for name in per_expert_module_names(base, layer, proj)]
            chosen = {rank_scaling(name) for name in names if name is not None}
            if not chosen:
                continue
            if len(chosen) > 1:
                raise AdapterError(
                    f"The experts of layer {layer} {proj} differ in rank or lora_alpha (rank_pattern / alpha_pattern); "
                    "the engine serves one rank and scaling per projection of a layer."
                )
            (rank, scaling), keys = chosen.pop(), [f"base_model.model.{n}" if n else None for n in names]
            a_keys = tuple(k and f"{k}.lora_A.weight" for k in keys)
            b_keys = tuple(k and f"{k}.lora_B.weight" for k in keys)
            modules.append(PerExpertModule(layer, proj, rank, scaling, a_keys, b_keys))
    return modules


def check_per_expert(m: PerExpertModule, tensors: dict[str, TensorEntry], base: BaseShapes) -> None:
    """Each targeted expert's A is [r, in] and its B [out, r]; AdapterError naming the first that is not."""
    h, i = base.hidden_size, base.expert_intermediate_size
    n_in, n_out = (i, h) if m.proj == "down" else (h, i)
    for a_key, b_key in zip(m.a_keys, m.b_keys):
        if a_key is None or b_key is None:
            continue
        for key, shape in ((a_key, (m.rank, n_in)), (b_key, (n_out, m.rank))):
            if key not in tensors:
                raise AdapterError(f"The adapter's weights lack tensor {key}.")
            if tensors[key].shape != shape:
                raise AdapterError(
                    f"Tensor {key} has shape {list(tensors[key].shape)}, the base model's expert needs {list(shape)}."
                )
