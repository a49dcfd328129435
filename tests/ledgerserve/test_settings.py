"""Each setting is written once, on its EngineConfig field: the serve flags, their --help defaults,
the resolved config of a bare `ledgerserve serve`, the core's config and docs/serving.md's flag table
all follow from the fields."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from pathlib import Path

import pytest

from ledgerserve import launcher
from ledgerserve.cli import (
    VLLM_FLAGS,
    add_serve_args,
    add_settings,
    build_parser,
    flag_of,
    flagged_fields,
    shown_default,
)
from ledgerserve.demo_model import demo_adapters
from ledgerserve.launcher import resolve_config
from ledgerserve.scheduler_proc.core import CoreConfig
from ledgerserve.shared.config import EngineConfig, setting

SERVING_MD = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
SET_BY_LAUNCHER = {
    "model_dir",
    "run_dir",
    "is_demo_model",
    "api_key_required",
    "admin_api_key_required",
    "lora_modules",
    "pinned_lora_modules",
    "served_model_aliases",
    "tp_layout",
}
OTHER_ARGS = {
    "model_dir",
    "--model",
    "--api-key",
    "--admin-api-key",
    "--lora-modules",
}  # declared by hand in cli.py, not one field each
VLLM_ONLY = {vf.flag for vf in VLLM_FLAGS}  # accepted with a notice or refused: no field


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ledgerserve serve")
    add_serve_args(parser)
    return parser


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


@pytest.fixture
def model_dir(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return str(tmp_path)


@pytest.fixture
def on_device(monkeypatch):
    def set_device(device: str) -> None:
        monkeypatch.setattr(launcher, "_detected_device", lambda: device)

    return set_device


def test_every_field_has_a_flag_or_says_what_sets_it():
    flagged = {f.name for f in flagged_fields()}
    assert set(FIELDS) - flagged == SET_BY_LAUNCHER
    for name in SET_BY_LAUNCHER:
        assert FIELDS[name].metadata["set_by"] and "flag" not in FIELDS[name].metadata
    options = {a.option_strings[0] if a.option_strings else a.dest: a.dest for a in _serve_parser()._actions}
    assert {flag_of(FIELDS[name]): name for name in flagged} == {
        flag: dest for flag, dest in options.items() if flag not in OTHER_ARGS | VLLM_ONLY | {"-h"}
    }
    assert flag_of(FIELDS["shutdown_timeout_s"]) == "--shutdown-timeout"  # a flag named apart from its field
    assert flag_of(FIELDS["lora_allowed_dirs"]) == "--lora-allowed-dir"


def _help_blocks(monkeypatch) -> dict[str, str]:
    """--help, one entry per option: its first option string -> its lines, whitespace folded."""
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping
    blocks: dict[str, list[str]] = {}
    flag = ""
    for line in _serve_parser().format_help().split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
        if flag:
            blocks.setdefault(flag, []).append(line)
    return {flag: " ".join(" ".join(lines).split()) for flag, lines in blocks.items()}


def test_help_shows_each_default_from_the_dataclass(monkeypatch):
    blocks = _help_blocks(monkeypatch)
    for f in flagged_fields():
        assert f"(default: {shown_default(f)})" in blocks[flag_of(f)], flag_of(f)
    expected = {
        "--max-num-batched-tokens": "tokens in one step (the chunked-prefill budget) (default: 2048)",
        "--max-num-seqs": "(default: 256 on CUDA, 64 on CPU)",
        "--dtype": "(default: bfloat16 on CUDA, float32 on CPU)",
        "--max-cpu-loras": "(default: max(32, --max-loras))",
        "--max-request-bytes": "(default: 8 MiB)",
        "--event-log-max-total-bytes": "(default: 4 GiB)",
        "--shutdown-timeout": "(default: 30)",
        "--gpu-memory-utilization": "(default: 0.9)",
        "--lora-overlap-loading": "(default: on)",
        "--enforce-eager": "(default: off)",
        "--lora-resolve-dir": "(default: none)",
        "--event-log-dir": "(default: ~/.cache/ledgerserve/events)",
    }
    for flag, text in expected.items():
        assert text in blocks[flag], (flag, blocks[flag])


def test_bare_serve_resolves_to_the_dataclass_defaults(model_dir, monkeypatch, on_device, tmp_path):
    monkeypatch.setattr(launcher, "_demo_model_dir", lambda: model_dir)
    monkeypatch.delenv("LEDGERSERVE_API_KEY", raising=False)
    monkeypatch.delenv("LEDGERSERVE_ADMIN_API_KEY", raising=False)
    on_device("cpu")
    cfg = resolve_config(_args(), str(tmp_path))
    auto = {f.name for f in flagged_fields() if f.metadata["flag"].auto_text}
    assert auto == {
        "served_model_name",
        "max_model_len",
        "dtype",
        "device",
        "max_num_seqs",
        "num_kv_blocks",
        "event_log_dir",
        "max_cpu_loras",
        "tokenizer",
        "async_scheduling",
    }
    for name, f in FIELDS.items():
        if name not in auto | {"model_dir", "run_dir", "is_demo_model", "enable_lora", "lora_modules"}:
            assert getattr(cfg, name) == f.default, name
    # the demo model comes with its demo adapters, registered as --lora-modules would
    assert cfg.enable_lora and cfg.lora_modules == tuple(demo_adapters(model_dir))
    # on the CPU the auto settings the dataclass has a default for resolve to it
    assert (cfg.device, cfg.dtype, cfg.max_num_seqs, cfg.max_cpu_loras, cfg.num_kv_blocks, cfg.async_scheduling) == (
        "cpu",
        "float32",
        64,
        32,
        None,
        False,
    )
    assert (cfg.model_dir, cfg.is_demo_model, cfg.run_dir, cfg.max_model_len) == (model_dir, True, str(tmp_path), 4096)
    assert cfg.served_model_name == os.path.basename(model_dir)
    assert cfg.event_log_dir == os.path.join(os.path.expanduser("~"), ".cache", "ledgerserve", "events")
    assert (cfg.port, cfg.max_num_batched_tokens, cfg.event_log_max_bytes, cfg.lora_overlap_loading) == (
        8000,
        2048,
        256 * 1024 * 1024,
        True,
    )


def test_cuda_defaults_apply_only_where_no_flag_gave_a_value(model_dir, on_device, tmp_path):
    on_device("cuda")
    cfg = resolve_config(_args(model_dir), str(tmp_path))
    assert (cfg.device, cfg.dtype, cfg.max_num_seqs, cfg.async_scheduling) == ("cuda", "bfloat16", 256, True)
    args = _args(model_dir, "--dtype", "float16", "--max-num-seqs", "8", "--no-async-scheduling")
    cfg = resolve_config(args, str(tmp_path))
    assert (cfg.device, cfg.dtype, cfg.max_num_seqs, cfg.async_scheduling) == ("cuda", "float16", 8, False)
    on_device("cpu")
    cfg = resolve_config(_args(model_dir, "--dtype", "auto", "--device", "auto"), str(tmp_path))
    assert (cfg.device, cfg.dtype) == ("cpu", "float32")  # `auto` given is as if not given
    assert resolve_config(_args(model_dir, "--served-model-name", "auto"), str(tmp_path)).served_model_name == "auto"


def test_max_cpu_loras_follows_max_loras_unless_given(model_dir, on_device, tmp_path):
    on_device("cpu")
    assert resolve_config(_args(model_dir, "--max-loras", "40"), str(tmp_path)).max_cpu_loras == 40
    assert resolve_config(_args(model_dir, "--max-loras", "4"), str(tmp_path)).max_cpu_loras == 32
    cfg = resolve_config(_args(model_dir, "--max-loras", "4", "--max-cpu-loras", "6"), str(tmp_path))
    assert (cfg.max_loras, cfg.max_cpu_loras) == (4, 6)


def test_repeated_flag_collects_into_a_tuple_through_its_parser(model_dir, on_device, tmp_path):
    on_device("cpu")
    (tmp_path / "a").mkdir()
    os.symlink(tmp_path / "a", tmp_path / "link")
    cfg = resolve_config(
        _args(model_dir, "--lora-allowed-dir", str(tmp_path / "link"), "--lora-allowed-dir", str(tmp_path)),
        str(tmp_path),
    )
    assert cfg.lora_allowed_dirs == (os.path.realpath(tmp_path / "a"), os.path.realpath(tmp_path))


def _k_tokens(text: str) -> int:
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


@dataclasses.dataclass(frozen=True)
class _Settings:
    max_model_len: int = setting(16, "longest prompt + output", aliases=("--max-len",), parse=_k_tokens)
    names: tuple[str, ...] = setting((), "a name (repeatable)", name="--name")


def test_a_field_gives_its_flag_aliases_and_value_parser(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping
    parser = argparse.ArgumentParser()
    add_settings(parser, _Settings)
    args = parser.parse_args(["--max-len", "32k", "--name", "a", "--name", "b"])
    assert (args.max_model_len, args.names) == (32 * 1024, ["a", "b"])
    assert parser.parse_args(["--max-model-len", "7"]).max_model_len == 7
    assert parser.parse_args([]).max_model_len is None  # not given: the field's default applies
    assert "longest prompt + output (default: 16)" in parser.format_help()


def test_core_config_of_a_default_engine_config():
    engine = EngineConfig(model_dir="m", served_model_name="m", max_model_len=512)
    assert dataclasses.asdict(CoreConfig.from_engine(engine)) == {
        "max_num_seqs": 64,
        "max_num_batched_tokens": 2048,
        "block_size": 16,
        "max_model_len": 512,
        "tensor_parallel_size": 1,
        "max_loras": 8,
        "max_cpu_loras": 32,
        "enable_lora": False,
        "lora_max_wait_steps": 16,
        "max_steps_in_flight": 1,
        "lora_overlap_loading": True,
        "max_on_demand_loras": 64,
        "policy": {
            "overlap_loading": True,
            "targeted_drain": True,
            "keep_dropped_namespaces": False,
            "op_reply_registry": False,
            "digest_load_reports": False,
        },
    }
    async_engine = dataclasses.replace(engine, async_scheduling=True, max_loras=3, lora_overlap_loading=False)
    core = CoreConfig.from_engine(async_engine)
    assert (core.max_steps_in_flight, core.max_loras, core.lora_overlap_loading) == (2, 3, False)


FLAG_ROW = re.compile(r"^\| (`[^|]+`) \| ([^|]+) \|", re.MULTILINE)


def doc_flag_rows(text: str) -> dict[str, str]:
    """docs/serving.md's flag table: each flag (its first word) -> its default cell; `--a` / `--b`
    rows split into one entry per flag, the cell split the same way."""
    table = text.split("| flag | default | meaning |", 1)[1].split("\n\n", 1)[0]
    rows: dict[str, str] = {}
    for flags_cell, default_cell in FLAG_ROW.findall(table):
        flags = [part.strip("` ").split()[0] for part in flags_cell.split(" / ")]
        defaults = default_cell.strip().split(" / ") if len(flags) > 1 else [default_cell.strip()]
        rows.update(zip(flags, (d.strip("` ") for d in defaults)))
    return rows


def test_serving_doc_flag_table_matches_the_parser():
    text = SERVING_MD.read_text()
    rows = doc_flag_rows(text)
    parser_flags = {a.option_strings[0] for a in _serve_parser()._actions if a.option_strings} - {"-h"}
    assert set(rows) == parser_flags - VLLM_ONLY | {"MODEL"}
    vllm_section = text.split("## Coming from vLLM", 1)[1].split("\n## ", 1)[0]
    for flag in VLLM_ONLY:  # the flags with no setting are listed where vLLM users look
        assert f"`{flag}" in vllm_section, flag
    for f in flagged_fields():
        if not f.metadata["flag"].auto_text:
            assert rows[flag_of(f)] == shown_default(f), flag_of(f)


def test_doc_check_reads_the_table():
    table = "| flag | default | meaning |\n|---|---|---|\n| `--host` / `--port` | `h` / `1` | x |\n"
    table += "| `--a DIR` | 8 MiB | y |\n\n| `--b` | 2 | after the table |\n"
    assert doc_flag_rows(table) == {"--host": "h", "--port": "1", "--a": "8 MiB"}
