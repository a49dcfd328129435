"""The multi-adapter decode workload through transformers + PEFT, for the "≥ 100× transformers
+ PEFT" target: Llama-3-8B shapes with random bf16 weights, `--adapters` random rank-16 LoRA
adapters on all seven projections, one request per adapter, `--prompt-len` random prompt
tokens, `--gen-len` greedy output tokens. Uses PEFT's mixed-batch inference
(`generate(..., adapter_names=[...])`); with a peft that lacks it, one single-request
batch per adapter (said in the output).
Prints JSON (tokens/s = output tokens / wall time); with `--ours FILE` (the JSON of
`bench_decode.py --e2e`) also the ratio.

    python -m scripts.adapters.bench_peft --out peft.json --ours ours.json
"""

from __future__ import annotations

import argparse
import json
import time

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

from scripts.common.bench_fixtures import LLAMA3_8B, SEVEN
from scripts.common.report_files import read_json, write_json

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)  # --tiny: a CPU smoke run of this script


def build(num_adapters: int, rank: int, device: str, tiny: bool) -> peft.PeftModel:
    """Random bf16 base from a config, `num_adapters` random LoRA adapters a0..a{n-1}."""
    fields = {k: v for k, v in LLAMA3_8B.items() if k not in ("architectures", "model_type", "torch_dtype")}
    cfg = LlamaConfig(**(fields | TINY if tiny else fields))
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    lora = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=SEVEN,
        lora_dropout=0.0,
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora, adapter_name="a0")
    for i in range(1, num_adapters):
        model.add_adapter(f"a{i}", lora)
    return model.to(torch.bfloat16).eval()  # PEFT keeps adapters in float32 by default


def mixed_batch_supported(model, ids: torch.Tensor, names: list[str]) -> bool:
    """Whether this peft runs `generate(..., adapter_names=...)` (tried on a 2-token warm-up)."""
    try:
        generate(model, ids, names, 2, True)
    except (TypeError, ValueError) as e:
        print(f"no mixed-batch inference in peft {peft.__version__} ({e}): one batch per adapter", flush=True)
        return False
    return True


def generate(model, ids: torch.Tensor, names: list[str], gen_len: int, mixed: bool) -> int:
    """Greedy `gen_len` tokens for every row; returns output tokens produced."""
    kw = dict(max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False, pad_token_id=0)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        if mixed:
            out = model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, **kw)
            return (out.shape[1] - ids.shape[1]) * ids.shape[0]
        total = 0
        for i, name in enumerate(names):  # no mixed batches: one single-request batch per adapter
            model.set_adapter(name)
            out = model.generate(input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1], **kw)
            total += out.shape[1] - ids.shape[1]
        return total


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny model (a smoke run, e.g. on CPU)")
    ap.add_argument("--ours", default="", help="bench_decode.py --e2e JSON, for the ratio")
    ap.add_argument("--out", default="")
    return ap.parse_args()


def timed_generate(args: argparse.Namespace, model) -> tuple[bool, int, float]:
    """(mixed batches?, output tokens, wall seconds) of one warmed-up timed generation."""
    vocab = model.config.vocab_size
    ids = torch.randint(1000 % vocab, vocab, (args.adapters, args.prompt_len), device=args.device)
    names = [f"a{i}" for i in range(args.adapters)]  # batch = one request per adapter
    mixed = mixed_batch_supported(model, ids, names)  # also the warm-up
    if not mixed:
        generate(model, ids, names, 2, mixed)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    tokens = generate(model, ids, names, args.gen_len, mixed)
    sync()
    return mixed, tokens, time.perf_counter() - t0


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build(args.adapters, args.rank, args.device, args.tiny)
    build_s = time.perf_counter() - t0
    mixed, tokens, wall = timed_generate(args, model)
    report = dict(
        device=torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        torch=torch.__version__,
        transformers=transformers.__version__,
        peft=peft.__version__,
        mixed_batch=mixed,
        batch=args.adapters,
        adapters=args.adapters,
        rank=args.rank,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        output_tokens=tokens,
        build_s=round(build_s, 1),
        wall_s=round(wall, 3),
        tok_s=round(tokens / wall, 1),
    )
    if args.ours:
        ours = read_json(args.ours, "the bench_decode report")
        report["ours_tok_s"] = ours["tok_s"]
        report["ratio"] = round(ours["tok_s"] / report["tok_s"], 1)
    if args.out:
        write_json(args.out, report, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
