"""vLLM launch lines, written in the forms vLLM's docs use, run with `vllm serve` replaced by
`ledgerserve serve`: each parses and resolves into the EngineConfig values vLLM's meaning gives,
or fails with the stated reason. Models come from an offline Hugging Face cache or a local dir."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import Any

import pytest

from ledgerserve.cli import build_parser
from ledgerserve.launcher import resolve_config
from tests.ledgerserve.hf_cache import add_snapshot, checkpoint_files

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
QWEN = "Qwen/Qwen2.5-1.5B-Instruct"
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"

# (vLLM launch line, expected EngineConfig values | "error: <text the failure must hold>")
LINES: list[tuple[str, dict[str, Any] | str]] = [
    (
        f"vllm serve {LLAMA} --enable-lora --lora-modules sql-lora=/adapters/sql --max-lora-rank 64"
        " --trust-remote-code --disable-log-requests",
        {"served_model_name": LLAMA, "enable_lora": True, "lora_modules": (("sql-lora", "/adapters/sql"),)},
    ),
    (
        f"vllm serve {QWEN} -tp 2 --max-model-len 32k --dtype half",
        {"tensor_parallel_size": 2, "max_model_len": 32000, "dtype": "float16", "served_model_name": QWEN},
    ),
    (
        f"vllm serve {QWEN} --max-model-len 32K --dtype float --max-num-batched-tokens 8k",
        {"max_model_len": 32768, "dtype": "float32", "max_num_batched_tokens": 8000},
    ),
    (
        f"vllm serve {LLAMA} --served-model-name llama-8b base",
        {"served_model_name": "llama-8b", "served_model_aliases": ("base",)},
    ),
    (f"vllm serve {LLAMA} --chat-template ./t.jinja", {"chat_template": "{cwd}/t.jinja"}),
    (f"vllm serve {LLAMA} --chat-template '{TEMPLATE}'", {"chat_template": TEMPLATE}),
    (
        "vllm serve {local} --gpu-memory-utilization 0.85 --max-num-seqs 128 --seed 42 --dtype bfloat16",
        {"gpu_memory_utilization": 0.85, "max_num_seqs": 128, "seed": 42, "dtype": "bfloat16"},
    ),
    (
        f"vllm serve {LLAMA} --enable-lora --max-loras 4 --max-cpu-loras 8 --max-lora-rank 32 --fully-sharded-loras",
        {"max_loras": 4, "max_cpu_loras": 8, "max_lora_rank": 32},
    ),
    (
        f"vllm serve --model {QWEN} --revision v2 --tokenizer {LLAMA} --tokenizer-revision main",
        {"max_model_len": 8192, "tokenizer": "{llama_snapshot}", "revision": "v2"},
    ),
    (
        f"vllm serve {LLAMA} --host 0.0.0.0 --port 8080 --uvicorn-log-level warning --root-path /llm"
        " --allowed-origins '[\"https://app.example\"]' --allow-credentials --enable-prefix-caching",
        {"host": "0.0.0.0", "port": 8080, "uvicorn_log_level": "warning", "root_path": "/llm"},
    ),
    (
        f"vllm serve {LLAMA} --ssl-keyfile key.pem --ssl-certfile cert.pem --kv-cache-dtype auto",
        {"ssl_keyfile": "{cwd}/key.pem", "ssl_certfile": "{cwd}/cert.pem"},
    ),
    (f"vllm serve {LLAMA} --quantization awq", "error: --quantization awq is refused: quantized checkpoints"),
    (f"vllm serve {LLAMA} --kv-cache-dtype fp8", "error: --kv-cache-dtype fp8 is refused: the KV cache is kept"),
    (f"vllm serve {LLAMA} --enable-lora --enable-lora-bias", "error: adapters with biases are not supported"),
    (f"vllm serve {LLAMA} --no-enable-prefix-caching", "error: the prefix cache cannot be turned off"),
    (f"vllm serve {LLAMA} --max-model-len 1m", "error: --max-model-len 1000000 exceeds the model's max_position"),
    (f"vllm serve {LLAMA} --max-model-len 1.5K", "error: no decimals with a binary suffix; did you mean 1.5k?"),
    (f"vllm serve {LLAMA} --max-lora 2", "error: unknown flag --max-lora; did you mean --max-loras"),
    (f"vllm serve {LLAMA} --ssl-keyfile key.pem", "error: --ssl-keyfile and --ssl-certfile go together"),
    (
        f"vllm serve {LLAMA} --allowed-origins https://a.example",
        "error: --allowed-origins: 'https://a.example' is not a JSON list",
    ),
    (f"vllm serve {LLAMA} --chat-template ./missing.jinja", "error: is neither a file nor a template"),
    (f"vllm serve {LLAMA} --chat-template '{{% for %}}'", "error: --chat-template does not compile"),
    ("vllm serve meta-llama/Unknown-Model", "error: model 'meta-llama/Unknown-Model' (revision main) is not in"),
    (
        f"vllm serve {LLAMA} --tensor-parallel-size 2 --pipeline-parallel-size 1 -dp 1"
        " --distributed-executor-backend mp",
        {"tensor_parallel_size": 2},
    ),
    (f"vllm serve {LLAMA} -tp 2 -pp 2", "error: --pipeline-parallel-size 2 is refused: pipeline"),
    (f"vllm serve {LLAMA} --data-parallel-size 2", "error: --data-parallel-size 2 is refused: one engine serves"),
    (f"vllm serve {LLAMA} --distributed-executor-backend ray", "error: the launcher starts one worker process"),
]
NOTICES = {
    0: [
        "--trust-remote-code: remote code is never run",
        "--disable-log-requests: the server's log never prints request contents",
    ],
    7: ["--fully-sharded-loras: adapters are always sharded with the model"],
    9: ["--enable-prefix-caching: the prefix cache is always on"],
}


@pytest.fixture
def setup(tmp_path: Path, demo_model_dir: str, monkeypatch) -> dict[str, str]:
    cache = tmp_path / "hub"
    llama = add_snapshot(cache, LLAMA, "main", checkpoint_files(demo_model_dir, max_position_embeddings=131072))
    add_snapshot(cache, QWEN, "main", checkpoint_files(demo_model_dir, max_position_embeddings=32768))
    add_snapshot(cache, QWEN, "v2", checkpoint_files(demo_model_dir, max_position_embeddings=8192))
    work = tmp_path / "work"
    work.mkdir()
    for name in ("t.jinja", "key.pem", "cert.pem"):
        (work / name).write_text(TEMPLATE if name == "t.jinja" else "pem")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return {"cwd": str(work), "local": demo_model_dir, "run_dir": str(tmp_path), "llama_snapshot": str(llama)}


def _launch(line: str, setup: dict[str, str]):
    argv = shlex.split(line.replace("{local}", setup["local"]))
    assert argv[:2] == ["vllm", "serve"]
    args = build_parser().parse_args(["serve", *argv[2:], "--device", "cpu"])
    return resolve_config(args, setup["run_dir"])


@pytest.mark.parametrize("index", range(len(LINES)))
def test_vllm_launch_line(index: int, setup, caplog, capsys):
    line, expected = LINES[index]
    caplog.set_level(logging.INFO, logger="launcher")
    if isinstance(expected, str):
        with pytest.raises((ValueError, SystemExit)) as failed:
            _launch(line, setup)
        reason = str(failed.value) if failed.type is not SystemExit else capsys.readouterr().err
        assert expected.removeprefix("error: ") in reason, reason
        return
    cfg = _launch(line, setup)
    for name, value in expected.items():
        if isinstance(value, str):
            value = value.format(**setup) if "{" in value and "{%" not in value else value
        assert getattr(cfg, name) == value, name
    notices = [r.getMessage() for r in caplog.records]
    assert len(notices) == len(NOTICES.get(index, []))
    for notice, start in zip(notices, NOTICES.get(index, [])):
        assert notice.startswith(start), notice


def test_help_lists_every_vllm_flag(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    flags = """--trust-remote-code --disable-log-requests --enable-log-requests --enable-prefix-caching
    --no-enable-prefix-caching --chat-template -tp --tensor-parallel-size --tokenizer --tokenizer-revision
    --revision --download-dir --uvicorn-log-level --root-path --allowed-origins --allowed-methods
    --allowed-headers --allow-credentials --ssl-keyfile --ssl-certfile --dtype --max-model-len
    --served-model-name --max-lora-rank --max-loras --max-cpu-loras --enable-lora-bias --fully-sharded-loras
    --pipeline-parallel-size -pp --data-parallel-size -dp --distributed-executor-backend
    --quantization --kv-cache-dtype --gpu-memory-utilization --seed --max-num-seqs --max-num-batched-tokens
    --model --enable-lora --lora-modules""".split()
    listed = {word.rstrip(",") for word in text.split() if word.startswith("-")}
    assert set(flags) <= listed, set(flags) - listed
    assert "vLLM flags with no setting here" in text
