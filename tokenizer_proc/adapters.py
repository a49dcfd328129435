"""The HTTP side's view of LoRA adapters: a mirror of the core's registry, the allowed-dir
policy for run-time loads, validation with `read_manifest`, and the model cards. Which
adapter a request names, loading it on demand, is `lora_resolver.py`.

The core owns the registry; `AdapterRegistry.refresh` replaces the mirror with the registry as
the engine client holds it after each `AdapterRegistryChanged`. Refusals raise `ApiError` (OpenAI error shape).
A path outside every `--lora-allowed-dir` root is refused with 400 (what vLLM users get
for a bad `lora_path`), never 403, and before the path is looked at, so the answer does
not reveal whether something exists outside the roots.
"""

from __future__ import annotations

import json
import os
import unicodedata
from typing import Any

from ledgerserve.shared.adapter_format import AdapterError, AdapterManifest, BaseShapes, read_manifest
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import AdapterInfo, AdapterRow
from ledgerserve.tokenizer_proc.errors import ApiError


class AdapterRegistry:
    """name -> AdapterInfo, as the core last reported it."""

    def __init__(self) -> None:
        self._by_name: dict[str, AdapterInfo] = {}

    def refresh(self, adapters: list[AdapterInfo]) -> None:
        self._by_name = {a.name: a for a in adapters}

    def get(self, name: str) -> AdapterInfo | None:
        return self._by_name.get(name)

    def by_path(self, path: str) -> AdapterInfo | None:
        if "\x00" in path:  # no file system path holds one
            return None
        real = os.path.realpath(path)
        matches = sorted((a for a in self._by_name.values() if a.path == real), key=lambda a: a.name)
        return matches[0] if matches else None

    def all(self) -> list[AdapterInfo]:
        return sorted(self._by_name.values(), key=lambda a: a.name)


def load_base_shapes(model_dir: str) -> BaseShapes:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return BaseShapes.from_hf_config(json.load(f))


def require_lora(config: EngineConfig) -> None:
    if not config.enable_lora:
        raise ApiError(400, "LoRA is not enabled; start the server with --enable-lora.", "lora_name")


MAX_NAME_CHARS = 256


def check_name(name: str, config: EngineConfig) -> None:
    """An adapter name is a model id and a metrics label: short, no stray spaces, and one way to
    write it: no invisible characters and in Unicode NFC, so two names that look the same are
    the same name."""
    if not name or name != name.strip():
        raise ApiError(400, "lora_name must be a non-empty name without surrounding spaces.", "lora_name")
    if len(name) > MAX_NAME_CHARS:
        raise ApiError(400, f"lora_name is longer than {MAX_NAME_CHARS} characters.", "lora_name")
    if (problem := name_problem(name)) is not None:
        raise ApiError(400, f"lora_name {problem}.", "lora_name")
    if name in config.served_model_names:
        raise ApiError(400, f"lora_name `{name}` is the base model's name.", "lora_name")


def name_problem(name: str) -> str | None:
    """What makes `name` look like another name, or None: a control, format (zero-width, bidi),
    private-use, unassigned or lone-surrogate character, a line or paragraph separator, a space
    other than U+0020, or a form other than NFC."""
    for index, ch in enumerate(name):
        category = unicodedata.category(ch)
        if category[0] == "C" or category in ("Zl", "Zp") or (category == "Zs" and ch != " "):
            what = unicodedata.name(ch, "") or category
            return (
                "must not hold control, format (zero-width, bidi), private-use or unassigned characters, "
                f"line separators or spaces other than U+0020: it holds U+{ord(ch):04X} ({what}) at position {index}"
            )
    if not unicodedata.is_normalized("NFC", name):
        return "is not in Unicode NFC form (a name must be written in its composed form)"
    return None


def allowed_real_path(path: str, roots: tuple[str, ...]) -> str:
    """The real path of `path` (symlinks followed) if it lies inside one of `roots`."""
    if not roots:
        raise ApiError(
            400,
            "Loading adapters at run time is disabled; start the server with "
            "--lora-allowed-dir DIR to allow adapters under DIR.",
            "lora_path",
        )
    if not path or "\x00" in path:
        raise ApiError(400, "lora_path must be a non-empty path.", "lora_path")
    real = os.path.realpath(path)
    for root in roots:
        real_root = os.path.realpath(root)
        if os.path.commonpath([real, real_root]) == real_root:
            return real
    raise ApiError(400, f"lora_path `{path}` is not inside any --lora-allowed-dir.", "lora_path")


def validate(path: str, base: BaseShapes, config: EngineConfig) -> AdapterManifest:
    """read_manifest (weights included: values NaN or infinite, in the file or once cast to the
    model's dtype, are refused, and the content digest is taken in the same pass), its
    refusals turned into OpenAI-shaped errors. Called off the event loop (asyncio.to_thread):
    it reads the whole adapter."""
    try:
        return read_manifest(
            path, base, config.max_lora_rank, config.lora_allowed_dirs, check_weights=True, model_dtype=config.dtype
        )
    except AdapterError as e:
        raise ApiError(e.code, e.message, e.param) from None


def model_cards(
    config: EngineConfig,
    registry: AdapterRegistry,
    created: int,
    rows: dict[str, AdapterRow] | None = None,
    shows_paths: bool = False,
) -> list[dict[str, Any]]:
    """The base model's cards (one per served name, the first first), then each adapter's with
    `pinned` and `location` (gpu, cpu or disk) from its latest row; an adapter the scheduler has
    sent no row for yet is on disk. `root` is the directory a model was read from when
    `shows_paths` (a request holding the admin key), else the card's own id: server paths are
    not shown to ordinary clients."""

    def root(name: str, path: str) -> str:
        return path if shows_paths else name

    base = [_card(name, root(name, config.model_dir), None, config, created) for name in config.served_model_names]
    rows = rows or {}
    return base + [
        {
            **_card(a.name, root(a.name, a.path), config.served_model_name, config, created),
            "pinned": a.pinned,
            "location": _location(rows.get(a.name)),
        }
        for a in registry.all()
    ]


def _location(row: AdapterRow | None) -> str:
    return row.tier if row is not None else "disk"


def _card(name: str, root: str, parent: str | None, config: EngineConfig, created: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "ledgerserve",
        "root": root,
        "parent": parent,
        "max_model_len": config.max_model_len,
        "permission": [],
    }
