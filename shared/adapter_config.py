"""adapter_config.json: read within a byte limit, then checked field by field into a `LoraSpec`.

Every field the server uses is type- and range-checked, and every pattern is compiled with
`shared.module_pattern`; a refusal names the field. Fields PEFT writes with an empty default
but that would change which modules or tensors an adapter has are refused when set.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ledgerserve.shared.adapter_files import file_size, open_file, read_at
from ledgerserve.shared.adapter_types import CONFIG_FILE, AdapterError
from ledgerserve.shared.bounded_json import JsonError, loads, show
from ledgerserve.shared.module_pattern import MatchBudget, ModulePattern, PatternError, compile_key, compile_target

CONFIG_MAX_BYTES = 1 << 20
CONFIG_MAX_MEMBERS = 16384
MAX_PATTERN_KEYS = 2048  # entries of rank_pattern, of alpha_pattern
MAX_TARGET_MODULES = 2048  # entries of a target_modules list
MAX_MODULE_NAME_CHARS = 256  # one entry of a target_modules list
DEFAULT_RANK = 8  # PEFT's defaults for r and lora_alpha
DEFAULT_ALPHA = 8

# field -> what setting it adds (refused); None, false and empty values are PEFT's defaults
_UNSUPPORTED = {
    "use_dora": "DoRA adapters (use_dora)",
    "modules_to_save": "Adapters that train extra modules (modules_to_save)",
    "trainable_token_indices": "Adapters that add vocabulary (trainable_token_indices)",
    "layers_to_transform": "Adapters on a subset of layers (layers_to_transform, layers_pattern)",
    "layers_pattern": "Adapters on a subset of layers (layers_to_transform, layers_pattern)",
    "exclude_modules": "Adapters with exclude_modules",
    "layer_replication": "Adapters with layer_replication",
    "lora_bias": "LoRA biases (lora_bias)",
    "alora_invocation_tokens": "Activated LoRA adapters (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA adapters (use_qalora)",
}


@dataclass(frozen=True)
class PatternValue:
    field: str  # rank_pattern | alpha_pattern
    key: str
    pattern: ModulePattern
    value: float


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    use_rslora: bool
    target_text: str | list[str]  # target_modules as written, for messages
    target_names: tuple[str, ...]  # target_modules given as a list
    target_pattern: ModulePattern | None  # target_modules given as a pattern string
    all_linear: bool
    rank_pattern: tuple[PatternValue, ...]  # most specific (longest key) first
    alpha_pattern: tuple[PatternValue, ...]
    target_parameters: tuple[str, ...] = ()  # 3-D parameters adapted in place (a MoE layer's experts)
    peft_version: str | None = None  # the PEFT release that saved it, when recorded


def read_config(
    directory: str,
    roots: Sequence[str],
    max_lora_rank: int,
    budget: MatchBudget,
    feed: Callable[[bytes], None] | None = None,
) -> LoraSpec:
    """The checked spec of `directory`'s config; its bytes, as read, also go to `feed`."""
    fd, _ = open_file(directory, CONFIG_FILE, roots)
    try:
        num_bytes = file_size(fd)
        if num_bytes > CONFIG_MAX_BYTES:
            raise AdapterError(f"{CONFIG_FILE} is {num_bytes} bytes; at most {CONFIG_MAX_BYTES} are read.")
        data = read_at(fd, 0, num_bytes, CONFIG_FILE)
    finally:
        os.close(fd)
    if feed is not None:
        feed(data)
    try:
        config = loads(data, CONFIG_MAX_MEMBERS)
    except JsonError as e:
        raise AdapterError(f"{CONFIG_FILE} {e.message}.") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object.")
    return parse_config(config, max_lora_rank, budget)


def parse_config(config: dict[str, Any], max_lora_rank: int, budget: MatchBudget) -> LoraSpec:
    """The checked spec of a decoded config; AdapterError naming the first bad field."""
    _check_kind(config)
    parameters = _parameters(config.get("target_parameters"))
    target_text = _targets(config.get("target_modules"), allow_none=bool(parameters))
    all_linear = target_text == "all-linear"
    pattern = None
    if isinstance(target_text, str) and not all_linear:
        pattern = _compile(compile_target, target_text, budget, f"target_modules {show(target_text)}")
    return LoraSpec(
        rank=_rank(config.get("r", DEFAULT_RANK), "r", max_lora_rank),
        alpha=_alpha(config.get("lora_alpha", DEFAULT_ALPHA), "lora_alpha"),
        use_rslora=_bool(config.get("use_rslora", False), "use_rslora"),
        target_text=target_text,
        target_names=tuple(target_text) if isinstance(target_text, list) else (),
        target_pattern=pattern,
        all_linear=all_linear,
        rank_pattern=_patterns(config, "rank_pattern", lambda v, f: _rank(v, f, max_lora_rank), budget),
        alpha_pattern=_patterns(config, "alpha_pattern", _alpha, budget),
        target_parameters=parameters,
        peft_version=_version(config.get("peft_version")),
    )


def _check_kind(config: dict[str, Any]) -> None:
    """A plain LoRA adapter: the PEFT type, the bias, and none of the settings we do not serve."""
    peft_type = config.get("peft_type", "LORA")
    if not isinstance(peft_type, str):
        raise AdapterError(f"peft_type must be a string, got {show(peft_type)}.")
    if peft_type.upper() != "LORA":
        raise AdapterError(f"Only LoRA adapters are supported, not peft_type {show(peft_type)}.")
    bias = config.get("bias", "none")
    if not isinstance(bias, str):
        raise AdapterError(f"bias must be a string, got {show(bias)}.")
    if bias != "none":
        raise AdapterError(f"Adapters with bias={show(bias)} are not supported; only bias='none'.")
    for field, what in _UNSUPPORTED.items():
        value = config.get(field)
        if value is not None and value is not False and value != [] and value != {} and value != "":
            raise AdapterError(f"{what} are not supported ({field} = {show(value)}).")


def _targets(value: Any, allow_none: bool = False) -> str | list[str]:
    if not value and allow_none:
        return []
    if not value:
        raise AdapterError("The adapter config names no target_modules.")
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise AdapterError(f"target_modules must be a string or a list of strings, got {show(value)}.")
    if len(value) > MAX_TARGET_MODULES:
        raise AdapterError(f"target_modules lists {len(value)} modules; at most {MAX_TARGET_MODULES} are accepted.")
    long = next((t for t in value if len(t) > MAX_MODULE_NAME_CHARS), None)
    if long is not None:
        raise AdapterError(f"target_modules entry {show(long)} is longer than {MAX_MODULE_NAME_CHARS} characters.")
    return value


def _parameters(value: Any) -> tuple[str, ...]:
    """target_parameters: a list of bounded strings (which of them the base has is checked later)."""
    if not value:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise AdapterError(f"target_parameters must be a list of strings, got {show(value)}.")
    if len(value) > MAX_TARGET_MODULES or any(len(t) > MAX_MODULE_NAME_CHARS for t in value):
        raise AdapterError(f"target_parameters {show(value)} is too long.")
    return tuple(value)


def _version(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 64:
        raise AdapterError(f"peft_version must be a short string, got {show(value)}.")
    return value


def _patterns(
    config: dict[str, Any], field: str, check: Callable[[Any, str], float], budget: MatchBudget
) -> tuple[PatternValue, ...]:
    """rank_pattern / alpha_pattern: keys compiled, values checked, longest key first (a stable
    sort: keys of one length keep the file's order)."""
    raw = config.get(field)
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise AdapterError(f"{field} must be an object mapping module patterns to values, got {show(raw)}.")
    if len(raw) > MAX_PATTERN_KEYS:
        raise AdapterError(f"{field} has {len(raw)} entries; at most {MAX_PATTERN_KEYS} are accepted.")
    entries = []
    for key in sorted(raw, key=len, reverse=True):
        where = f"{field}[{show(key)}]"
        if not key:
            raise AdapterError(f"{field} has an empty key.")
        value = check(raw[key], where)
        entries.append(PatternValue(field, key, _compile(compile_key, key, budget, f"{field} key {show(key)}"), value))
    return tuple(entries)


def _compile(
    compile_fn: Callable[[str, MatchBudget], ModulePattern], text: str, budget: MatchBudget, where: str
) -> ModulePattern:
    try:
        return compile_fn(text, budget)
    except PatternError as e:
        raise AdapterError(f"{where} is refused: {e.message}.") from None


def _rank(value: Any, field: str, max_lora_rank: int) -> int:
    if type(value) is not int or value < 1:
        raise AdapterError(f"{field} must be an integer from 1 to --max-lora-rank {max_lora_rank}, got {show(value)}.")
    if value > max_lora_rank:
        raise AdapterError(f"Adapter rank {field} = {value} exceeds --max-lora-rank {max_lora_rank}.")
    return value


def _alpha(value: Any, field: str) -> float:
    number = _finite_float(value)
    if number is None or number <= 0:
        raise AdapterError(f"{field} must be a finite number > 0, got {show(value)}.")
    return number


def _finite_float(value: Any) -> float | None:
    """`value` as a finite float, or None for anything else (bools, huge ints, NaN, infinities)."""
    if type(value) not in (int, float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _bool(value: Any, field: str) -> bool:
    if type(value) is not bool:
        raise AdapterError(f"{field} must be true or false, got {show(value)}.")
    return value
