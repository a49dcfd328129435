"""Hostile variants of a good PEFT adapter, one per kind of attack on the adapter reader, each
with a fragment of the refusal it must get. Shared by the reader's unit tests and the HTTP
tests: every builder turns a copy of a good adapter (for any base model) into a bad one."""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ledgerserve.shared.adapter_types import CONFIG_FILE, WEIGHTS_FILE

Build = Callable[[Path, Path], None]  # (adapter copy, a directory outside the allowed root)


@dataclass(frozen=True)
class Raw:
    """A config value written verbatim (JSON that json.dumps cannot produce, e.g. 1e999)."""

    text: str


def write_config(adapter: Path, config: dict[str, Any]) -> None:
    text = json.dumps(config, default=lambda raw: f"@raw:{raw.text}@")
    (adapter / CONFIG_FILE).write_text(re.sub(r'"@raw:([^"@]*)@"', r"\1", text))


def edit_config(adapter: Path, **changes: Any) -> None:
    write_config(adapter, {**json.loads((adapter / CONFIG_FILE).read_text()), **changes})


def read_weights(adapter: Path) -> tuple[dict[str, Any], bytes]:
    data = (adapter / WEIGHTS_FILE).read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + header_len]), data[8 + header_len :]


def write_weights(adapter: Path, header: dict[str, Any] | bytes, body: bytes) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    (adapter / WEIGHTS_FILE).write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def edit_header(mutate: Callable[[dict[str, Any]], Any]) -> Build:
    """A builder that rewrites the header (keeping the data section); `mutate` edits the
    header in place and may return raw header bytes instead."""

    def build(adapter: Path, _: Path) -> None:
        header, body = read_weights(adapter)
        raw = mutate(header)
        write_weights(adapter, raw if isinstance(raw, bytes) else header, body)

    return build


def first_tensor(header: dict[str, Any]) -> str:
    return sorted(k for k in header if k != "__metadata__")[0]


def config(**changes: Any) -> Build:
    return lambda adapter, _: edit_config(adapter, **changes)


def raw_config(text: bytes) -> Build:
    return lambda adapter, _: (adapter / CONFIG_FILE).write_bytes(text)


def poison_weights(value: float, dtype: torch.dtype) -> Build:
    """One value of the first A tensor set to `value`, every tensor stored as `dtype`."""

    def build(adapter: Path, _: Path) -> None:
        tensors = {k: v.to(dtype) for k, v in load_file(str(adapter / WEIGHTS_FILE)).items()}
        key = sorted(k for k in tensors if "lora_A" in k)[0]
        tensors[key].view(-1)[-1] = value
        save_file(tensors, str(adapter / WEIGHTS_FILE), metadata={"format": "pt"})

    return build


def huge_weights(value: float, layer: int = 0) -> Build:
    """Every lora_A of layer `layer`'s modules filled with `value`, every lora_B with -`value`:
    finite values (in the file and in the model's dtype) that overflow once multiplied. Such an
    adapter loads; keeping what it computes to its own rows is the kernels' work."""

    def build(adapter: Path, _: Path) -> None:
        tensors = load_file(str(adapter / WEIGHTS_FILE))
        for key, t in tensors.items():
            if f".layers.{layer}." in key:
                t.fill_(value if "lora_A" in key else -value)
        save_file(tensors, str(adapter / WEIGHTS_FILE), metadata={"format": "pt"})

    return build


def link_outside(name: str) -> Build:
    """`name` replaced by a link to a good copy of it outside the allowed root."""

    def build(adapter: Path, outside: Path) -> None:
        target = outside / f"{adapter.name}-{name}"
        os.replace(adapter / name, target)
        (adapter / name).symlink_to(target)

    return build


def fifo(name: str) -> Build:
    def build(adapter: Path, _: Path) -> None:
        (adapter / name).unlink()
        os.mkfifo(adapter / name)

    return build


def _set_entry(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda header: header[first_tensor(header)].__setitem__(field, value)


def _overlap(header: dict[str, Any]) -> None:
    a, b = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[:2]
    span = header[a]["data_offsets"][1] - header[a]["data_offsets"][0]
    header[b]["data_offsets"] = [header[b]["data_offsets"][0] - span // 2, header[b]["data_offsets"][1] - span // 2]


def _zero_size_tensors(header: dict[str, Any]) -> None:
    for i in range(200):
        header[f"extra.{i}"] = {"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0]}


# name -> (builder, a fragment of the refusal)
HOSTILE: dict[str, tuple[Build, str]] = {
    "redos-target": (config(target_modules="model.(.|.)*Z"), "match no module"),
    "lookaround-target": (config(target_modules="(?=model).*q_proj"), "target_modules '(?=model).*q_proj' is refused"),
    "backref-rank-key": (config(rank_pattern={r"(q)\1_proj": 4}), "rank_pattern key"),
    "unclosed-alpha-key": (config(alpha_pattern={"(q_proj": 4}), "alpha_pattern key '(q_proj' is refused"),
    "deep-config": (raw_config(b'{"r": 4, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "nests deeper than 32"),
    "config-members": (config(**{f"k{i}": 0 for i in range(20_000)}), "more than 16384 object members"),
    "oversize-config": (raw_config(b"{" + b" " * (2 << 20) + b"}"), "at most 1048576 are read"),
    "not-utf8-config": (raw_config(b'{"r": "\xff"}'), "not UTF-8"),
    "duplicate-key": (raw_config(b'{"r": 4, "r": 8, "target_modules": ["q_proj"]}'), "repeats the key 'r'"),
    "zero-rank-pattern": (config(rank_pattern={"q_proj": 0}), "rank_pattern['q_proj'] must be an integer"),
    "negative-rank": (config(r=-4), "r must be an integer"),
    "bool-rank": (config(r=True), "r must be an integer"),
    "string-rank": (config(r="4"), "r must be an integer"),
    "float-rank-pattern": (config(rank_pattern={"q_proj": 4.0}), "rank_pattern['q_proj'] must be an integer"),
    "infinite-alpha": (config(lora_alpha=Raw("1e999")), "lora_alpha must be a finite number"),
    "infinite-alpha-pattern": (
        config(alpha_pattern={"v_proj": Raw("1e999")}),
        "alpha_pattern['v_proj'] must be a finite",
    ),
    "nan-alpha-literal": (config(lora_alpha=Raw("NaN")), "holds NaN"),
    "zero-alpha": (config(lora_alpha=0), "lora_alpha must be a finite number > 0"),
    "float32-infinite-scaling": (config(lora_alpha=1e40), "past the float32 range"),
    "list-alpha-pattern": (config(alpha_pattern=["v_proj"]), "alpha_pattern must be an object"),
    "string-rslora": (config(use_rslora="yes"), "use_rslora must be true or false"),
    "int-target-modules": (config(target_modules=7), "target_modules must be a string or a list"),
    "mixed-target-modules": (config(target_modules=["q_proj", 3]), "target_modules must be a string or a list"),
    "int-peft-type": (config(peft_type=3), "peft_type must be a string"),
    "dict-bias": (config(bias={"x": 1}), "bias must be a string"),
    "layers-to-transform": (config(layers_to_transform=[0]), "layers_to_transform"),
    "deep-header": (edit_header(lambda h: b"[" * 30_000 + b"]" * 30_000), "nests deeper than 32"),
    "huge-header": (edit_header(lambda h: json.dumps({f"k{i}": i for i in range(300_000)}).encode()), "-byte header"),
    "header-members": (
        edit_header(lambda h: h.__setitem__("__metadata__", {f"m{i}": "" for i in range(5000)})),
        "object members",
    ),
    "too-many-tensors": (edit_header(_zero_size_tensors), "tensors; an adapter of this base model has at most"),
    "int-dtype": (edit_header(_set_entry("dtype", "I32")), "unsupported dtype 'I32'"),
    "negative-shape": (edit_header(_set_entry("shape", [-4, 16])), "malformed shape"),
    "bool-shape": (edit_header(_set_entry("shape", [True, 16])), "malformed shape"),
    "reversed-offsets": (edit_header(_set_entry("data_offsets", [64, 0])), "malformed data_offsets"),
    "string-offsets": (edit_header(_set_entry("data_offsets", ["0", 64])), "malformed data_offsets"),
    "extra-entry-field": (edit_header(_set_entry("offsets", [0, 1])), "needs exactly dtype, shape and data_offsets"),
    "overlapping-offsets": (edit_header(_overlap), "overlap another tensor"),
    "list-metadata": (edit_header(lambda h: h.__setitem__("__metadata__", ["x"])), "__metadata__ must map"),
    "nan-weights": (poison_weights(float("nan"), torch.float32), "holds NaN or infinite values"),
    "inf-weights-bf16": (poison_weights(float("inf"), torch.bfloat16), "holds NaN or infinite values"),
    "neg-inf-weights-f16": (poison_weights(float("-inf"), torch.float16), "holds NaN or infinite values"),
    "config-link-outside": (link_outside(CONFIG_FILE), "is a link that leaves --lora-allowed-dir"),
    "weights-link-outside": (link_outside(WEIGHTS_FILE), "is a link that leaves --lora-allowed-dir"),
    "fifo-config": (fifo(CONFIG_FILE), "adapter_config.json is not a regular file"),
    "fifo-weights": (fifo(WEIGHTS_FILE), "adapter_model.safetensors is not a regular file"),
}
