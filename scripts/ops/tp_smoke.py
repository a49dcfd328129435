"""Serve a model at tensor parallel N and use it as a client would, then verify its event log.

The checks, each a row of the report: the base and every adapter listed; a greedy completion
from each; a chat; a stream whose text equals the same request's without streaming; an adapter
loaded at run time (the demo: a copy of `pirate`, which must answer pirate's text), used,
unloaded, and then refused with 404; the server stopping cleanly; `ledgerserve replay --verify`
of its log. Exit status 1 if any check failed.

    python -m scripts.ops.tp_smoke --tensor-parallel-size 2 --device cuda --out tp2_demo.json
    python -m scripts.ops.tp_smoke --tensor-parallel-size 2 --device cuda --llama3-8b-dummy --out tp2_8b.json

The demo model runs in the device's default dtype (fp32 on the CPU, bf16 on CUDA); the
Llama-3-8B-shaped server has random bf16 weights (`--load-format dummy`), the demo's tokenizer
and a random rank-8 adapter on all seven projections."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import openai
import torch

from ledgerserve.demo_model import demo_adapters, ensure_demo_model
from ledgerserve.shared.adapter_format import BaseShapes
from scripts.common.bench_fixtures import write_adapter, write_served_model_dir
from scripts.common.server_process import Server
from scripts.serving.serving_workload import read_model_config

PROMPT = "The morning"
MAX_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}
LOADED_NAME = "loaded-at-run-time"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Target:
    """What to serve: the server's arguments, and the adapter to load at run time."""

    model_dir: str | None  # None: the demo
    args: list[str]
    adapter_path: str
    same_as: str | None  # the served adapter whose text the loaded one must give, or None


def demo_target() -> Target:
    adapters = dict(demo_adapters(ensure_demo_model()))
    copy_of = "pirate"
    return Target(None, ["--lora-allowed-dir", os.path.dirname(adapters[copy_of])], adapters[copy_of], copy_of)


def dummy_target(work_dir: str) -> Target:
    model_dir = write_served_model_dir(work_dir, ensure_demo_model())
    adapter_root = os.path.join(work_dir, "adapters")
    base = BaseShapes.from_hf_config(read_model_config(model_dir))
    path = write_adapter(adapter_root, 0, base, 8, "cpu")
    args = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "1024"]
    args += ["--enable-lora", "--max-lora-rank", "16", "--lora-allowed-dir", adapter_root]
    return Target(model_dir, args, path, None)


def run_checks(server: Server, target: Target) -> list[Check]:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    checks: list[Check] = []
    served = _attempt(checks, "models", lambda: _models(client))
    if served is None:
        return checks
    base, adapters = served
    texts = {m: _attempt(checks, f"completion {m}", lambda m=m: _completion(client, m)) for m in [base, *adapters]}
    _attempt(checks, "chat", lambda: _chat(client, base))
    _attempt(checks, "stream", lambda: _stream(client, base, texts[base]))
    expected = texts.get(target.same_as) if target.same_as else None
    if _attempt(checks, "load adapter", lambda: _load(server, client, target.adapter_path, expected)) is not None:
        _attempt(checks, "unload adapter", lambda: _unload(server, client))
    return checks


def _attempt(checks: list[Check], name: str, step: Callable[[], tuple[Any, str]]) -> Any:
    """Run one check: its result, or None where it failed (the failure is recorded)."""
    try:
        result, detail = step()
    except Exception as e:  # a check that raises failed; the rest still run
        checks.append(Check(name, False, f"{type(e).__name__}: {e}"))
        return None
    checks.append(Check(name, True, detail))
    return result


def _models(client: openai.OpenAI) -> tuple[tuple[str, list[str]], str]:
    data = client.models.list().data
    bases = [m.id for m in data if m.model_extra.get("parent") is None]
    if len(bases) != 1:
        raise AssertionError(f"expected one base model, got {bases}")
    adapters = sorted(m.id for m in data if m.model_extra.get("parent") is not None)
    return (bases[0], adapters), f"base {bases[0]}, adapters {adapters}"


def _completion(client: openai.OpenAI, model: str) -> tuple[str, str]:
    r = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    if r.usage is None or r.usage.completion_tokens != MAX_TOKENS or r.choices[0].finish_reason != "length":
        raise AssertionError(f"expected {MAX_TOKENS} tokens ending in 'length': {r}")
    return r.choices[0].text, f"{MAX_TOKENS} tokens, {r.choices[0].text!r}"


def _chat(client: openai.OpenAI, model: str) -> tuple[str, str]:
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me about the morning."}], max_tokens=8
    )
    text = r.choices[0].message.content
    if not isinstance(text, str) or r.usage is None or not r.usage.completion_tokens:
        raise AssertionError(f"no answer: {r}")
    return text, f"{r.usage.completion_tokens} tokens, {text!r}"


def _stream(client: openai.OpenAI, model: str, whole: str | None) -> tuple[str, str]:
    """The streamed text, which must equal `whole`, and its token count from the closing usage chunk
    (the dummy model's random tokens may decode to no text at all)."""
    stream = client.completions.create(
        model=model, prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    events = list(stream)
    chunks = [c.choices[0].text for c in events if c.choices]
    usage = events[-1].usage if events else None
    text = "".join(chunks)
    if usage is None or usage.completion_tokens != MAX_TOKENS:
        raise AssertionError(f"expected a closing usage of {MAX_TOKENS} tokens: {usage}")
    if whole is not None and text != whole:
        raise AssertionError(f"streamed {text!r}, not the completion's {whole!r}")
    return text, f"{len(chunks)} chunks, {MAX_TOKENS} tokens, {text!r}"


def _load(server: Server, client: openai.OpenAI, path: str, expected: str | None) -> tuple[str, str]:
    r = httpx.post(server.base_url + "/v1/load_lora_adapter", json={"lora_name": LOADED_NAME, "lora_path": path})
    if r.status_code != 200:
        raise AssertionError(f"load answered {r.status_code}: {r.text}")
    if LOADED_NAME not in {m.id for m in client.models.list().data}:
        raise AssertionError(f"{LOADED_NAME} is not listed after its load")
    text, _ = _completion(client, LOADED_NAME)
    if expected is not None and text != expected:
        raise AssertionError(f"the loaded copy answered {text!r}, its original {expected!r}")
    return text, f"{path}: {MAX_TOKENS} tokens, {text!r}"


def _unload(server: Server, client: openai.OpenAI) -> tuple[None, str]:
    r = httpx.post(server.base_url + "/v1/unload_lora_adapter", json={"lora_name": LOADED_NAME})
    if r.status_code != 200:
        raise AssertionError(f"unload answered {r.status_code}: {r.text}")
    try:
        client.completions.create(model=LOADED_NAME, prompt=PROMPT, max_tokens=1)
    except openai.NotFoundError as e:
        return None, f"then refused: {e.status_code} {e.body}"
    raise AssertionError(f"{LOADED_NAME} still answers after its unload")


def replay_check(log_dir: str) -> Check:
    args = [sys.executable, "-m", "ledgerserve", "replay", "--verify", log_dir]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return Check("replay --verify", done.returncode == 0, " | ".join(line.strip() for line in lines))


def smoke(args: argparse.Namespace, work_dir: str) -> dict[str, Any]:
    target = dummy_target(work_dir) if args.llama3_8b_dummy else demo_target()
    flags = ["--tensor-parallel-size", str(args.tensor_parallel_size), "--device", args.device, *target.args]
    log_dir = os.path.join(work_dir, "events")
    server = Server(target.model_dir, log_dir, [*flags, *args.server_args]).start()
    try:
        checks = run_checks(server, target)
    finally:
        exit_code = server.stop()
    checks.append(Check("clean exit", exit_code == 0, f"exit code {exit_code}"))
    checks.append(replay_check(log_dir))
    return {"server_args": server.extra_args, "checks": [asdict(c) for c in checks], "ok": all(c.ok for c in checks)}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--llama3-8b-dummy", action="store_true", help="a Llama-3-8B-shaped dummy model, not the demo")
    p.add_argument("--out", default=None, help="write the report here (JSON)")
    p.add_argument("server_args", nargs="*", help="more `ledgerserve serve` flags, after --")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tp-smoke-") as work_dir:
        report = smoke(args, work_dir)
    for check in report["checks"]:
        print(f"{'ok  ' if check['ok'] else 'FAIL'} {check['name']}: {check['detail']}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
