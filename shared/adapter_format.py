"""PEFT LoRA adapter directories: read and validate one without loading its tensors.

`read_manifest` reads `adapter_config.json` and the safetensors *header* only, checks the
adapter against the base model's shapes, and returns an `AdapterManifest`: for each
targeted module its real rank, scaling and tensor keys. The HTTP process validates with
it before registering an adapter; the worker loads tensors by the manifest's keys. Never
unpickles anything: `.bin` weights are refused.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass

TARGET_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class AdapterError(Exception):
    """A refused adapter: `code` is the HTTP status (400 bad adapter, 404 no such path)."""

    def __init__(self, message: str, code: int = 400, param: str = "lora_path") -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must agree with: the base model's module names and shapes."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int  # num_heads * head_dim
    kv_size: int  # num_kv_heads * head_dim
    vocab_size: int

    @staticmethod
    def from_hf_config(cfg: dict) -> "BaseShapes":
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return BaseShapes(
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            q_size=cfg["num_attention_heads"] * head_dim,
            kv_size=cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim,
            vocab_size=cfg["vocab_size"],
        )

    def in_out(self, kind: str) -> tuple[int, int]:
        """(in_features, out_features) of one projection."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size), "k_proj": (h, self.kv_size), "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
            "lm_head": (h, self.vocab_size),
        }[kind]

    def module_names(self) -> list[tuple[str, str, int]]:
        """(full module path, kind, layer) of every projection an adapter may target."""
        names = []
        for layer in range(self.num_layers):
            for kind in TARGET_KINDS[:4]:
                names.append((f"model.layers.{layer}.self_attn.{kind}", kind, layer))
            for kind in TARGET_KINDS[4:7]:
                names.append((f"model.layers.{layer}.mlp.{kind}", kind, layer))
        names.append(("lm_head", "lm_head", -1))
        return names


@dataclass(frozen=True)
class LoraModule:
    name: str  # full module path in the base model, e.g. model.layers.3.mlp.up_proj
    kind: str  # one of TARGET_KINDS
    layer: int  # -1 for lm_head
    rank: int
    scaling: float
    a_key: str  # safetensors key of A: [rank, in_features]
    b_key: str  # safetensors key of B: [out_features, rank]


@dataclass(frozen=True)
class AdapterManifest:
    path: str  # real path of the adapter directory
    modules: tuple[LoraModule, ...]
    num_bytes: int  # size of the weights file
    max_rank: int

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(k for k in TARGET_KINDS if any(m.kind == k for m in self.modules))


def read_manifest(path: str, base: BaseShapes, max_lora_rank: int) -> AdapterManifest:
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        raise AdapterError(f"No adapter directory at `{path}`.", code=404)
    config = _read_config(real)
    header, num_bytes = _read_safetensors_header(real)
    modules = _resolve_modules(config, base)
    _check_ranks(modules, max_lora_rank)
    _check_tensors(modules, header, base)
    return AdapterManifest(real, tuple(modules), num_bytes, max(m.rank for m in modules))


def _read_config(path: str) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise AdapterError(f"The adapter has no {CONFIG_FILE}.")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {e.__class__.__name__}.") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object.")
    _check_config(config)
    return config


def _check_config(config: dict) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"Only LoRA adapters are supported, not peft_type {peft_type}.")
    if config.get("use_dora"):
        raise AdapterError("DoRA adapters (use_dora) are not supported.")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"Adapters with bias={config.get('bias')!r} are not supported; only bias='none'.")
    if config.get("modules_to_save") or config.get("trainable_token_indices"):
        raise AdapterError("Adapters that train extra modules or add vocabulary (modules_to_save, "
                           "trainable_token_indices) are not supported.")
    rank, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"Adapter rank r must be a positive integer, got {rank!r}.")
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"lora_alpha must be a finite number, got {alpha!r}.")
    if not config.get("target_modules"):
        raise AdapterError("The adapter config names no target_modules.")


def _read_safetensors_header(path: str) -> tuple[dict, int]:
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        if any(name.endswith((".bin", ".pt", ".pth", ".ckpt")) for name in os.listdir(path)):
            raise AdapterError("The adapter's weights are pickle files (.bin/.pt); only safetensors is accepted.")
        raise AdapterError(f"The adapter has no {WEIGHTS_FILE}.")
    size = os.path.getsize(weights)
    with open(weights, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise AdapterError(f"{WEIGHTS_FILE} is truncated.")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise AdapterError(f"{WEIGHTS_FILE} is truncated or malformed (bad header length).")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise AdapterError(f"{WEIGHTS_FILE} has a malformed header.") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{WEIGHTS_FILE} has a malformed header.")
    header.pop("__metadata__", None)
    _check_data_extent(header, size - 8 - header_len)
    return header, size


def _check_data_extent(header: dict, data_bytes: int) -> None:
    end = 0
    for key, info in header.items():
        try:
            start, stop = info["data_offsets"]
            expected = _DTYPE_BYTES[info["dtype"]] * math.prod(info["shape"])
        except (KeyError, TypeError, ValueError):
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {key} has a malformed or unsupported entry.") from None
        if stop - start != expected or start < 0:
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {key} has inconsistent offsets.")
        end = max(end, stop)
    if end > data_bytes:
        raise AdapterError(f"{WEIGHTS_FILE} is truncated: its header needs {end} data bytes, the file has {data_bytes}.")


def _targets(config: dict, name: str) -> bool:
    target = config["target_modules"]
    if isinstance(target, str):
        return target == "all-linear" and name != "lm_head" or re.fullmatch(target, name) is not None
    return any(name == t or name.endswith("." + t) for t in target)


def _pattern_value(patterns: dict, name: str, default):
    for key in sorted(patterns, key=len, reverse=True):  # most specific first, deterministic
        if re.match(rf"(.*\.)?({key})$", name):
            return patterns[key]
    return default


def _resolve_modules(config: dict, base: BaseShapes) -> list[LoraModule]:
    targets = config["target_modules"]
    names = base.module_names()
    modules = []
    for name, kind, layer in names:
        if not _targets(config, name):
            continue
        rank = _pattern_value(config.get("rank_pattern") or {}, name, config.get("r", 8))
        alpha = _pattern_value(config.get("alpha_pattern") or {}, name, config.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        prefix = f"base_model.model.{name}"
        modules.append(LoraModule(name, kind, layer, rank, float(scaling), f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"))
    if not modules:
        raise AdapterError(f"target_modules {targets!r} match no module of the base model.")
    if isinstance(targets, list):
        unknown = [t for t in targets if not any(n == t or n.endswith("." + t) for n, _, _ in names)]
        if unknown:
            raise AdapterError(f"target_modules {unknown} are not modules of the base model (supported: {', '.join(TARGET_KINDS)}).")
    return modules


def _check_ranks(modules: list[LoraModule], max_lora_rank: int) -> None:
    worst = max(modules, key=lambda m: (m.rank, m.name))
    if worst.rank > max_lora_rank:
        raise AdapterError(f"Adapter rank {worst.rank} (module {worst.name}) exceeds --max-lora-rank {max_lora_rank}.")


def _check_tensors(modules: list[LoraModule], header: dict, base: BaseShapes) -> None:
    expected_keys = set()
    for m in modules:
        in_f, out_f = base.in_out(m.kind)
        for key, shape in ((m.a_key, [m.rank, in_f]), (m.b_key, [out_f, m.rank])):
            expected_keys.add(key)
            if key not in header:
                raise AdapterError(f"{WEIGHTS_FILE} lacks tensor {key}.")
            if list(header[key]["shape"]) != shape:
                raise AdapterError(f"Tensor {key} has shape {header[key]['shape']}, the base model needs {shape}.")
    extra = sorted(k for k in header if k not in expected_keys and not _is_saved_embedding(k, header[k], base))
    if extra:
        raise AdapterError(f"{WEIGHTS_FILE} holds tensors the adapter config does not explain, e.g. {extra[0]} "
                           "(extra vocabulary or modules are not supported).")


def _is_saved_embedding(key: str, info: dict, base: BaseShapes) -> bool:
    """PEFT saves a copy of the embedding / lm_head when an adapter targets lm_head. A
    copy of the base shape is ignored; any other vocabulary size adds tokens: refused."""
    if not ("embed_tokens" in key or "lm_head" in key):
        return False
    shape = list(info["shape"])
    if len(shape) == 2 and shape[1] == base.hidden_size and shape[0] != base.vocab_size:
        raise AdapterError(f"The adapter changes the vocabulary ({key} has {shape[0]} rows, the base model "
                           f"{base.vocab_size}); adapters that add tokens are not supported.")
    return shape == [base.vocab_size, base.hidden_size]
