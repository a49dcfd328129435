"""What the launcher checks before it starts any child, so that a start that cannot succeed stops
in a second with one message naming what is wrong, not after the model has loaded: the model's
`config.json` (as the worker will read it) and every start-up adapter (`--lora-modules` and the
demo's, read and validated as the HTTP process will: against the base's shapes, `--max-lora-rank`
and `--dtype`)."""

from __future__ import annotations

import json
import os

from ledgerserve.shared.adapter_format import AdapterError, BaseShapes, read_manifest
from ledgerserve.shared.config import EngineConfig
from ledgerserve.worker_proc.models.config import parse_model_config


def read_hf_config(model_dir: str) -> dict:
    """The model's config.json as a dict; ValueError naming the file when it is missing, unreadable,
    not JSON or not a JSON object."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(value).__name__}")
    return value


def check_model_config(model_dir: str, hf_config: dict) -> BaseShapes:
    """The checkpoint's architecture and shapes as the worker and the adapter checks read them;
    ValueError naming config.json and the field that is missing or wrong."""
    path = os.path.join(model_dir, "config.json")
    try:
        parse_model_config(hf_config)
        return BaseShapes.from_hf_config(hf_config)
    except KeyError as e:
        raise ValueError(f"{path} has no {e.args[0]!r}: a Llama-family config.json gives it") from None
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        raise ValueError(f"{path}: {e}") from None


def check_startup_adapters(config: EngineConfig, base: BaseShapes) -> None:
    """Every start-up adapter read whole and validated as the HTTP process will validate it (it is
    read again there: this check only moves the refusal before the model load); ValueError naming
    the adapter."""
    for name, path in config.lora_modules:
        try:
            read_manifest(
                path, base, config.max_lora_rank, config.lora_allowed_dirs, check_weights=True, model_dtype=config.dtype
            )
        except AdapterError as e:
            raise ValueError(f"start-up adapter '{name}' at {path}: {e.message}") from None
