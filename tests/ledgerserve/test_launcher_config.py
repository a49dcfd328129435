"""The launcher turns CLI flags into the EngineConfig every process reads."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from ledgerserve.cli import build_parser
from ledgerserve.cli import main as cli_main
from ledgerserve.launcher import admin_api_key, api_key, children, parse_lora_module, resolve_config
from ledgerserve.shared.config import EngineConfig


def _args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


@pytest.fixture
def model_dir(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return str(tmp_path)


def test_auto_dtype_and_defaults_on_cpu(model_dir, tmp_path):
    cfg = resolve_config(_args(model_dir, "--device", "cpu"), str(tmp_path))
    assert (cfg.device, cfg.dtype, cfg.max_model_len, cfg.max_num_seqs) == ("cpu", "float32", 4096, 64)
    assert cfg.served_model_name == os.path.basename(model_dir) and cfg.host == "127.0.0.1"
    assert not cfg.enable_lora and cfg.max_loras == 8 and cfg.max_lora_rank == 64


def test_auto_dtype_on_cuda_is_bf16(model_dir, tmp_path):
    assert resolve_config(_args(model_dir, "--device", "cuda"), str(tmp_path)).dtype == "bfloat16"


def test_lora_modules_in_both_forms_enable_lora(model_dir, tmp_path):
    spec = json.dumps({"name": "b", "path": "/x/b"})
    cfg = resolve_config(_args(model_dir, "--device", "cpu", "--lora-modules", "a=/x/a", spec), str(tmp_path))
    assert cfg.enable_lora and cfg.lora_modules == (("a", "/x/a"), ("b", "/x/b"))
    assert EngineConfig.from_json(cfg.to_json()) == cfg


def test_pinned_lora_modules(model_dir, tmp_path):
    pinned = json.dumps({"name": "b", "path": "/x/b", "pinned": True})
    cfg = resolve_config(
        _args(model_dir, "--device", "cpu", "--max-loras", "2", "--lora-modules", "a=/x/a", pinned), str(tmp_path)
    )
    assert cfg.lora_modules == (("a", "/x/a"), ("b", "/x/b")) and cfg.pinned_lora_modules == ("b",)
    assert EngineConfig.from_json(cfg.to_json()) == cfg
    both = [json.dumps({"name": n, "path": f"/x/{n}", "pinned": True}) for n in "ab"]
    with pytest.raises(ValueError, match=r"at most max_loras - 1 = 1 adapters may be pinned \(--max-loras 2\)"):
        resolve_config(_args(model_dir, "--device", "cpu", "--max-loras", "2", "--lora-modules", *both), str(tmp_path))
    with pytest.raises(ValueError, match="pinned must be true or false"):
        parse_lora_module(json.dumps({"name": "a", "path": "/x/a", "pinned": "yes"}))


def test_lora_resolve_dir_must_lie_inside_an_allowed_dir(model_dir, tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "by-name").mkdir(parents=True)
    cfg = resolve_config(
        _args(
            model_dir,
            "--device",
            "cpu",
            "--enable-lora",
            "--lora-allowed-dir",
            str(allowed),
            "--lora-resolve-dir",
            str(allowed / "by-name"),
            "--max-on-demand-loras",
            "3",
        ),
        str(tmp_path),
    )
    assert cfg.lora_resolve_dir == os.path.realpath(allowed / "by-name") and cfg.max_on_demand_loras == 3
    for outside in ([], ["--lora-allowed-dir", str(allowed / "by-name")]):
        with pytest.raises(ValueError, match="lora_resolve_dir .* must lie inside a --lora-allowed-dir"):
            resolve_config(
                _args(model_dir, "--device", "cpu", "--enable-lora", *outside, "--lora-resolve-dir", str(allowed)),
                str(tmp_path),
            )
    with pytest.raises(ValueError, match="max_on_demand_loras must be >= 1"):
        resolve_config(_args(model_dir, "--device", "cpu", "--max-on-demand-loras", "0"), str(tmp_path))


@pytest.mark.parametrize("spec", ["nopath", "=/x", "a=", '{"name": "a"}', "{bad json"])
def test_bad_lora_module_specs_are_refused(spec):
    with pytest.raises(ValueError, match="--lora-modules"):
        parse_lora_module(spec)


def test_max_model_len_past_the_model_is_refused(model_dir, tmp_path):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        resolve_config(_args(model_dir, "--device", "cpu", "--max-model-len", "8192"), str(tmp_path))


def test_api_key_reaches_only_the_http_process(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LEDGERSERVE_API_KEY", "from-the-shell")  # --api-key wins; no child but one gets either
    args = _args(model_dir, "--device", "cpu", "--api-key", "s3cret")
    cfg = resolve_config(args, str(tmp_path))
    assert cfg.api_key_required and b"s3cret" not in cfg.to_json()
    envs = {child.name: child.env for child in children(cfg, api_key(args))}
    assert envs["tokenizer"]["LEDGERSERVE_API_KEY"] == "s3cret"
    assert all("LEDGERSERVE_API_KEY" not in env for name, env in envs.items() if name != "tokenizer")
    assert os.environ["LEDGERSERVE_API_KEY"] == "from-the-shell"  # the launcher's own environment is untouched


def test_admin_api_key_reaches_only_the_http_process(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LEDGERSERVE_ADMIN_API_KEY", "admin-from-the-shell")
    args = _args(model_dir, "--device", "cpu", "--api-key", "s3cret")
    cfg = resolve_config(args, str(tmp_path))
    assert cfg.admin_api_key_required and b"admin-from-the-shell" not in cfg.to_json()
    envs = {child.name: child.env for child in children(cfg, api_key(args), admin_api_key(args))}
    assert envs["tokenizer"]["LEDGERSERVE_ADMIN_API_KEY"] == "admin-from-the-shell"
    assert envs["tokenizer"]["LEDGERSERVE_API_KEY"] == "s3cret"
    assert all("LEDGERSERVE_ADMIN_API_KEY" not in env for name, env in envs.items() if name != "tokenizer")
    args = _args(model_dir, "--device", "cpu", "--api-key", "same", "--admin-api-key", "same")
    with pytest.raises(ValueError, match="--admin-api-key must differ from --api-key"):
        resolve_config(args, str(tmp_path))


def test_any_origin_with_credentials_is_refused_at_start(model_dir, tmp_path):
    args = _args(model_dir, "--device", "cpu", "--allowed-origins", '["*"]', "--allow-credentials")
    with pytest.raises(ValueError, match="--allow-credentials is refused"):
        resolve_config(args, str(tmp_path))
    for ok in (["--allowed-origins", '["*"]'], ["--allowed-origins", '["https://a.example"]', "--allow-credentials"]):
        assert resolve_config(_args(model_dir, "--device", "cpu", *ok), str(tmp_path)).allowed_origins


@pytest.mark.parametrize("flag, field", [("--max-model-len", "max_model_len"), ("--max-num-seqs", "max_num_seqs")])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_zero_or_negative_sizes_are_refused_at_start(model_dir, tmp_path, capsys, monkeypatch, flag, field, value):
    with pytest.raises(ValueError, match=f"{field} must be > 0, got {value}"):
        resolve_config(_args(model_dir, "--device", "cpu", flag, value), str(tmp_path))
    run_root = tmp_path / "runs"
    run_root.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(run_root))
    assert cli_main(["serve", model_dir, "--device", "cpu", "--port", "0", flag, value]) == 2
    assert f"ledgerserve: error: {field} must be > 0, got {value}" in capsys.readouterr().err
    assert list(run_root.iterdir()) == []  # the run directory made for it is gone again


def test_event_log_retention_flag(model_dir, tmp_path):
    assert resolve_config(_args(model_dir, "--device", "cpu"), str(tmp_path)).event_log_max_total_bytes == 4 * 1024**3
    cfg = resolve_config(_args(model_dir, "--device", "cpu", "--event-log-max-total-bytes", "0"), str(tmp_path))
    assert cfg.event_log_max_total_bytes == 0  # unlimited
    with pytest.raises(ValueError, match="at least twice event_log_max_bytes"):
        resolve_config(
            _args(
                model_dir,
                "--device",
                "cpu",
                "--event-log-max-bytes",
                "1048576",
                "--event-log-max-total-bytes",
                "1048577",
            ),
            str(tmp_path),
        )


@pytest.mark.parametrize("flags", [["--max-model-len", "8192"], ["--block-size", "0"], ["--lora-modules", "nopath"]])
def test_a_refused_flag_leaves_no_run_directory(model_dir, tmp_path, monkeypatch, capsys, flags):
    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(runs))  # where the launcher makes its run directory
    assert cli_main(["serve", model_dir, "--device", "cpu", "--port", "0", *flags]) == 2
    assert capsys.readouterr().err.startswith("ledgerserve: error: ")
    assert list(runs.iterdir()) == []


def test_the_shard_layout_is_in_the_config_and_a_bad_split_refused(tmp_path):
    heads = {"max_position_embeddings": 4096, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps({**heads, "intermediate_size": 64}))
    cfg = resolve_config(_args(str(tmp_path), "--device", "cpu", "-tp", "2"), str(tmp_path))
    assert cfg.tp_layout.startswith("tp=2 megatron") and "kv heads 2 -> 1/rank (split)" in cfg.tp_layout
    assert EngineConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3 does not divide .* num_attention_heads \(4\)"):
        resolve_config(_args(str(tmp_path), "--device", "cpu", "-tp", "3"), str(tmp_path))


def test_workers_alone_get_the_loopback_transport_env(model_dir, tmp_path, monkeypatch):
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    cfg = resolve_config(_args(model_dir, "--device", "cpu"), str(tmp_path))
    for child in children(cfg):
        on_loopback = child.env is not None and child.env.get("GLOO_SOCKET_IFNAME") == "lo"
        assert on_loopback == child.name.startswith("worker-"), child.name
        assert on_loopback == (child.env.get("NCCL_SOCKET_IFNAME") == "lo"), child.name
