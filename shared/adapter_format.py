"""PEFT LoRA adapter directories: read and validate one, bounded against hostile input.

`read_manifest` reads `adapter_config.json` (`shared.adapter_config`) and the safetensors
header (`shared.safetensors_header`), checks the adapter against the base model's shapes, and
returns an `AdapterManifest`: for each targeted module its real rank, scaling and tensor
keys. The HTTP process validates with it before registering an adapter (and then also reads
the whole weights file once, refusing weights that are NaN or infinite, in the file or once
cast to the model's dtype, and taking the content digest of both files,
`shared.adapter_digest`); the worker reads the weights into its CPU tier through it, in the
same pass over the same open files. Every read is bounded: file sizes, JSON depth and member
counts, pattern matching steps. Every refusal is an `AdapterError`; nothing is unpickled
(`.bin` weights are refused).
"""

from __future__ import annotations

import logging
import math
import os
import struct
from collections.abc import Callable, Sequence

from ledgerserve.shared import expert_adapters
from ledgerserve.shared.adapter_config import LoraSpec, PatternValue, read_config
from ledgerserve.shared.adapter_digest import ContentDigest
from ledgerserve.shared.adapter_files import file_size, is_inside, open_file
from ledgerserve.shared.adapter_types import (
    CONFIG_FILE,
    TARGET_KINDS,
    WEIGHTS_FILE,
    AdapterError,
    AdapterManifest,
    BaseShapes,
    LoraModule,
)
from ledgerserve.shared.bounded_json import show
from ledgerserve.shared.module_pattern import MatchBudget, ModulePattern, PatternError
from ledgerserve.shared.safetensors_header import Header, TensorEntry, read_header, scan

__all__ = [
    "CONFIG_FILE",
    "TARGET_KINDS",
    "WEIGHTS_FILE",
    "AdapterError",
    "AdapterManifest",
    "BaseShapes",
    "LoraModule",
    "WeightsReader",
    "read_manifest",
]

MAX_MATCH_STEPS = 4_000_000  # pattern building and matching, all the patterns of one adapter
logger = logging.getLogger(__name__)
# Reads the weights file in place of the value check (a worker, into its CPU tier): called with the
# open file, its size, its checked header, the adapter's modules and the content digest so far
# (the config's bytes); it feeds the whole file to the digest, front to back.
WeightsReader = Callable[[int, int, Header, list[LoraModule], ContentDigest], None]


def read_manifest(
    path: str,
    base: BaseShapes,
    max_lora_rank: int,
    allowed_dirs: Sequence[str] = (),
    check_weights: bool = False,
    model_dtype: str = "float32",
    read_weights: WeightsReader | None = None,
    confined: bool = False,
) -> AdapterManifest:
    """The manifest of the adapter at `path`, or AdapterError (404: no directory there; 400:
    anything else). When the directory lies inside one of `allowed_dirs`, every file read must
    resolve inside one of them too; `confined` (a run-time adapter read again) refuses a directory
    that no longer resolves inside one of them. `check_weights` also reads the whole weights file,
    refusing NaN or infinite values and values that become infinite in `model_dtype` (the workers
    cast the weights to it), and sets the manifest's `content_sha256` from the same pass; else
    `read_weights`, if given, reads it, and the digest it took is the manifest's."""
    if "\x00" in path:
        raise AdapterError("The adapter path holds a NUL byte.")
    try:
        real = os.path.realpath(path)
        if confined and not is_inside(real, allowed_dirs):  # never says what it resolves to now
            raise AdapterError("The adapter's directory no longer lies inside any --lora-allowed-dir; refused.")
        if not os.path.isdir(real):
            raise AdapterError(f"No adapter directory at `{path}`.", code=404)
        roots = tuple(allowed_dirs) if is_inside(real, allowed_dirs) else ()
        return _read(real, base, max_lora_rank, roots, check_weights, model_dtype, read_weights)
    except AdapterError:
        raise
    except OSError as e:  # e.g. permission denied or an I/O error: say what, never where
        raise AdapterError(f"The adapter cannot be read ({type(e).__name__}).") from None
    except Exception as e:  # a case no check foresaw: refused, with the cause kept for logs and tests
        logger.warning("adapter at %s refused: unexpected %s", path, type(e).__name__, exc_info=True)
        raise AdapterError(f"The adapter is malformed ({type(e).__name__}).") from e


def _read(
    real: str,
    base: BaseShapes,
    max_lora_rank: int,
    roots: tuple[str, ...],
    check_weights: bool,
    model_dtype: str,
    read_weights: WeightsReader | None,
) -> AdapterManifest:
    budget = MatchBudget(MAX_MATCH_STEPS)
    digest = ContentDigest()
    spec = read_config(real, roots, max_lora_rank, budget, digest.update)
    fd, weights_path = _open_weights(real, roots)
    try:
        num_bytes = file_size(fd)
        header = read_header(fd, num_bytes, max_tensors(base))
        modules, per_expert = _resolve_modules(spec, base), _per_expert_modules(spec, base, header.tensors)
        experts = _expert_modules(spec, base)
        if not modules and not per_expert and not experts:
            raise AdapterError(f"target_modules {show(spec.target_text)} match no module of the base model.")
        for expert in experts:
            expert_adapters.check_module(expert, header.tensors, base, spec.peft_version)
        for module in per_expert:
            expert_adapters.check_per_expert(module, header.tensors, base)
        expert_keys = {k for e in experts for k in (e.a_key, e.b_key)}
        expert_keys |= {k for m in per_expert for k in (*m.a_keys, *m.b_keys) if k is not None}
        _check_tensors(modules, header.tensors, base, expert_keys)
        if check_weights:
            keys = {k for m in modules for k in (m.a_key, m.b_key)} | expert_keys
            _scan_weights(fd, header, keys, digest, model_dtype)
        elif read_weights is not None:
            read_weights(fd, num_bytes, header, modules, digest)
    finally:
        os.close(fd)
    if experts or per_expert:  # read and checked whole; the engine cannot serve them yet
        form = f"PEFT target_parameters, {len(experts)}" if experts else f"per-expert modules, {len(per_expert)}"
        raise AdapterError(
            f"The adapter's expert LoRA ({form} projections over {len(base.sparse_layers)} layers) "
            "is well formed, but expert adapters cannot be served yet."
        )
    sha256 = digest.value if check_weights or read_weights is not None else ""
    return AdapterManifest(real, tuple(modules), num_bytes, max(m.rank for m in modules), weights_path, sha256)


def max_tensors(base: BaseShapes) -> int:
    """The most tensors an adapter of `base` can hold: A and B of every module, of each sparse
    layer's two expert parameters or of its experts' own modules, and PEFT's saved copies of the
    embedding and lm_head."""
    per_expert = 2 * len(expert_adapters.PROJS) * base.num_experts * len(base.sparse_layers)
    return 2 * len(base.module_names()) + 4 * len(base.sparse_layers) + per_expert + 2


def _open_weights(real: str, roots: tuple[str, ...]) -> tuple[int, str]:
    if not os.path.lexists(os.path.join(real, WEIGHTS_FILE)):
        if any(name.endswith((".bin", ".pt", ".pth", ".ckpt")) for name in os.listdir(real)):
            raise AdapterError("The adapter's weights are pickle files (.bin/.pt); only safetensors is accepted.")
        raise AdapterError(f"The adapter has no {WEIGHTS_FILE}.")
    return open_file(real, WEIGHTS_FILE, roots)


def _resolve_modules(spec: LoraSpec, base: BaseShapes) -> list[LoraModule]:
    names = base.module_names()
    modules = []
    for name, kind, layer in names:
        if not _targets(spec, name):
            continue
        rank = int(_pattern_value(spec.rank_pattern, name, spec.rank))
        alpha = _pattern_value(spec.alpha_pattern, name, spec.alpha)
        scaling = _scaling(alpha, rank, spec.use_rslora, name)
        prefix = f"base_model.model.{name}"
        modules.append(
            LoraModule(name, kind, layer, rank, float(scaling), f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight")
        )
    known = [n for n, _, _ in names] + [
        n
        for layer in base.sparse_layers
        for p in expert_adapters.PROJS
        for n in expert_adapters.per_expert_module_names(base, layer, p)
    ]
    unknown = [t for t in spec.target_names if not any(n == t or n.endswith("." + t) for n in known)]
    if unknown:
        raise AdapterError(
            f"target_modules {show(unknown)} are not modules of the base model (supported: {', '.join(TARGET_KINDS)})."
        )
    return modules


def _scaling(alpha: float, rank: int, use_rslora: bool, name: str) -> float:
    """A module's scaling (alpha / r, or alpha / sqrt(r) with rsLoRA), which the workers keep in
    float32: refused if it is infinite there."""
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    try:
        struct.pack("<f", scaling)
    except OverflowError:
        raise AdapterError(
            f"The scaling of {show(name)} (lora_alpha / r) is {scaling:.3g}, past the float32 range."
        ) from None
    return scaling


def _targets(spec: LoraSpec, name: str) -> bool:
    """PEFT's rule: a list names modules or their suffixes; a string is a full-match pattern,
    or "all-linear" (every projection but the output head)."""
    if spec.all_linear:
        return name != "lm_head"
    if spec.target_pattern is not None:
        return _matches(spec.target_pattern, name, "target_modules")
    return any(name == t or name.endswith("." + t) for t in spec.target_names)


def _pattern_value(patterns: tuple[PatternValue, ...], name: str, default: float) -> float:
    """The value of the first (most specific) key that matches `name`, as PEFT picks it."""
    for entry in patterns:
        if _matches(entry.pattern, name, entry.field):
            return entry.value
    return default


def _matches(pattern: ModulePattern, name: str, field: str) -> bool:
    try:
        return pattern.matches(name)
    except PatternError as e:  # the step budget ran out
        where = f"{field} key {show(pattern.text)}" if pattern.as_key else f"{field} {show(pattern.text)}"
        raise AdapterError(f"{where} is refused: {e.message}.") from None


def _per_expert_modules(
    spec: LoraSpec, base: BaseShapes, tensors: dict[str, TensorEntry]
) -> list[expert_adapters.PerExpertModule]:
    """The per-expert 2-D form: target_modules that name the experts' own modules (as under
    transformers 4). Under transformers 5 the same names match no expert (its experts are 3-D
    parameters), so a file holding none of their tensors has none of this form; one holding any
    must hold all the config targets (check_per_expert): none is dropped silently."""

    def rank_scaling(name: str) -> tuple[int, float]:
        rank = int(_pattern_value(spec.rank_pattern, name, spec.rank))
        return rank, _scaling(_pattern_value(spec.alpha_pattern, name, spec.alpha), rank, spec.use_rslora, name)

    modules = expert_adapters.per_expert_modules(base, lambda name: _targets(spec, name), rank_scaling)
    if not any(key in tensors for m in modules for key in (*m.a_keys, *m.b_keys)):
        return []
    return modules


def _expert_modules(spec: LoraSpec, base: BaseShapes) -> list[expert_adapters.ExpertModule]:
    params = expert_adapters.targeted_params(spec.target_parameters)
    if not params:
        return []
    scaling = _scaling(spec.alpha, spec.rank, spec.use_rslora, "mlp.experts")
    return expert_adapters.expert_modules(params, base, spec.rank, scaling)


def _check_tensors(
    modules: list[LoraModule], tensors: dict[str, TensorEntry], base: BaseShapes, expert_keys: set[str]
) -> None:
    expected_keys = set(expert_keys)
    for m in modules:
        in_f, out_f = base.in_out(m.kind)
        for key, shape in ((m.a_key, (m.rank, in_f)), (m.b_key, (out_f, m.rank))):
            expected_keys.add(key)
            if key not in tensors:
                raise AdapterError(f"{WEIGHTS_FILE} lacks tensor {key}.")
            if tensors[key].shape != shape:
                raise AdapterError(
                    f"Tensor {key} has shape {list(tensors[key].shape)}, the base model needs {list(shape)}."
                )
    extra = sorted(k for k in tensors if k not in expected_keys and not _is_saved_embedding(k, tensors[k], base))
    if extra:
        raise AdapterError(
            f"{WEIGHTS_FILE} holds tensors the adapter config does not explain, e.g. {show(extra[0])} "
            "(extra vocabulary or modules are not supported)."
        )


def _is_saved_embedding(key: str, entry: TensorEntry, base: BaseShapes) -> bool:
    """PEFT saves a copy of the embedding / lm_head when an adapter targets lm_head. A
    copy of the base shape is ignored; any other vocabulary size adds tokens: refused."""
    if not ("embed_tokens" in key or "lm_head" in key):
        return False
    shape = entry.shape
    if len(shape) == 2 and shape[1] == base.hidden_size and shape[0] != base.vocab_size:
        raise AdapterError(
            f"The adapter changes the vocabulary ({show(key)} has {shape[0]} rows, the base model "
            f"{base.vocab_size}); adapters that add tokens are not supported."
        )
    return shape == (base.vocab_size, base.hidden_size)


def _scan_weights(fd: int, header: Header, keys: set[str], digest: ContentDigest, model_dtype: str) -> None:
    """One pass over the weights file: all of it into `digest`, the tensors of `keys` (every
    module's A and B, the experts' among them) checked finite in `model_dtype`."""
    problems = scan(fd, header, digest.update, keys, model_dtype)
    if problems:
        key, problem = next(iter(problems.items()))  # the first in file order
        raise AdapterError(f"Tensor {key} holds {problem}.")
