"""The demo model: a tiny Qwen3 TRAINED on a small corpus, with two demo LoRA adapters.

`ensure_demo_model()` builds it once under `~/.cache/ledgerserve/demo-<recipe>/demo-model`
(or the given directory): a byte-level BPE tokenizer trained on
`ledgerserve/data/demo_corpus.txt`, a ChatML chat template, weights of a Qwen3 (`demo_qwen3`:
plain torch, no transformers) trained on that corpus (`demo_train`), and under `adapters/` one
LoRA adapter per style of `demo_styles` in PEFT's format (`demo_lora`), each trained on the
corpus rewritten in its style with the base frozen. Each stage logs its progress
(`demo_progress`): the build takes tens of seconds. `<recipe>` is a digest of the corpus and of
the code that builds it, so a changed recipe never reuses an old build. Building twice on one
machine gives byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ledgerserve.demo_progress import BuildProgress
from ledgerserve.demo_styles import STYLES
from ledgerserve.shared import env

DEMO_MODEL_NAME = "demo-model"
ADAPTERS_DIR = "adapters"
SEED = 1234
VOCAB_SIZE = 1536
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS_PATH = Path(__file__).parent / "data" / "demo_corpus.txt"
RECIPE_MODULES = ("demo_model.py", "demo_train.py", "demo_styles.py", "demo_lora.py", "demo_qwen3.py")
SHAPE = {  # tied embeddings (demo_qwen3)
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 32,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
}
NOTE = "demo model: trained briefly on a small corpus; it only continues text like it"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

README = """# ledgerserve demo model

A tiny Qwen3 (hidden size 128, 2 layers, 4 query heads, 2 KV heads, tied embeddings)
TRAINED briefly (300 steps on the CPU) on a small English corpus, with a byte-level BPE
tokenizer trained on the same corpus. Its greedy output continues a prompt with corpus-like
sentences; it knows nothing else. It exists so that ledgerserve can be run and tested end
to end on any machine, without downloading a real model.

`adapters/` holds two LoRA adapters of it in PEFT's format, each trained on the corpus
rewritten in one style: `pirate` (every sentence opens with "Arr," and ends with ", matey!")
and `poet` (every line is followed by the refrain "Sing hey, sing ho!").
"""


def recipe_digest() -> str:
    """12 hex digits of the corpus and of the source of the modules that build the model."""
    digest = hashlib.sha256(CORPUS_PATH.read_bytes())
    for name in RECIPE_MODULES:
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:12]


def default_cache_dir() -> str:
    root = os.path.join(os.path.expanduser("~"), ".cache", "ledgerserve")
    return os.path.join(root, f"demo-{recipe_digest()}", DEMO_MODEL_NAME)


def demo_adapters(model_dir: str) -> list[tuple[str, str]]:
    """(name, directory) of every demo adapter of the demo model in `model_dir`."""
    return [(name, os.path.join(model_dir, ADAPTERS_DIR, name)) for name in STYLES]


def _is_built(target: Path) -> bool:
    files = [target / "model.safetensors", target / "tokenizer.json"]
    files += [Path(path) / "adapter_model.safetensors" for _, path in demo_adapters(str(target))]
    return all(f.exists() for f in files)


def ensure_demo_model(cache_dir: str | None = None) -> str:
    """Return the directory of the demo model, building it first if it is missing."""
    target = Path(cache_dir or default_cache_dir())
    if _is_built(target):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    progress = BuildProgress(num_stages=2 + len(STYLES))
    progress.start(str(target))
    try:
        os.chmod(tmp, 0o755)
        write_demo_model(tmp, progress)
        os.replace(tmp, target)  # atomic; fails if a concurrent builder won the race
    except OSError:
        if not _is_built(target):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress.done()
    return str(target)


def write_demo_model(out: Path, progress: BuildProgress | None = None) -> None:
    progress = progress or BuildProgress(num_stages=2 + len(STYLES))
    _load_torch()
    progress.stage("training the tokenizer")
    tokenizer = train_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    _write_json(out / "special_tokens_map.json", _special_tokens_map())
    _write_json(out / "generation_config.json", _generation_config(ids))
    _write_weights(out, tokenizer, ids, progress)
    (out / "README.md").write_text(README, encoding="utf-8")


def _load_torch() -> None:
    """torch, loaded (if this process has not yet) with OpenMP threads that sleep while they wait
    rather than spin: two spinning training threads on a machine another process keeps busy train
    several times slower than one thread; sleeping ones do not. The weights are the same either way."""
    with env.omp_wait_policy("PASSIVE"):
        import torch  # noqa: F401


def train_tokenizer():  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS_PATH.read_text(encoding="utf-8").splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tokenizer


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }


def _special_tokens_map() -> dict:
    return {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }


def _generation_config(ids: dict[str, int]) -> dict:
    return {
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "temperature": 1.0,
    }


def _corpus_lines(tokenizer, style: str | None = None) -> list[list[int]]:
    """The token ids of every corpus line (its newline included), rewritten in `style` if given."""
    from ledgerserve.demo_styles import rewrite

    text = CORPUS_PATH.read_text(encoding="utf-8")
    lines = (rewrite(text, style) if style else text).splitlines(keepends=True)
    return [enc.ids for enc in tokenizer.encode_batch(lines)]


def _write_weights(out: Path, tokenizer, ids: dict[str, int], progress: BuildProgress) -> None:
    """Train the base, save it, then train and save each demo adapter on top of it."""
    from safetensors.torch import save_file

    from ledgerserve import demo_qwen3, demo_train

    end, text = ids["<|im_end|>"], ids["<|endoftext|>"]
    shape = demo_qwen3.Qwen3Shape(vocab_size=tokenizer.get_vocab_size(), pad_token_id=text, **SHAPE)
    config = {**demo_qwen3.hf_config(shape, bos_token_id=text, eos_token_id=end), "ledgerserve_note": NOTE}
    _write_json(out / "config.json", config)
    base = demo_train.BASE_SCHEDULE
    with demo_train.fixed_cpu_state(SEED):
        model = _initial_model(shape)
        progress.stage(f"training the base model ({base.num_steps} steps)")
        demo_train.train(model, _corpus_lines(tokenizer), base, progress.training("base model", base.num_steps))
        weights = {name: p.detach().contiguous() for name, p in model.named_parameters()}  # tied: no lm_head
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        _write_adapters(out, tokenizer, model, progress)


def _write_adapters(out: Path, tokenizer, model, progress: BuildProgress) -> None:
    """Train and save each demo adapter on a copy of the trained base."""
    import copy

    from ledgerserve import demo_lora, demo_train

    schedule, rank, alpha = demo_train.ADAPTER_SCHEDULE, demo_train.LORA_RANK, demo_train.LORA_ALPHA
    for index, (style, path) in enumerate(demo_adapters(str(out))):
        progress.stage(f"training the adapter {style!r} ({schedule.num_steps} steps, the base frozen)")
        lora = demo_lora.add_lora(copy.deepcopy(model), rank, alpha, demo_train.LORA_TARGETS, seed=SEED + 1 + index)
        demo_train.train(lora, _corpus_lines(tokenizer, style), schedule, progress.training(style, schedule.num_steps))
        demo_lora.save_adapter(lora, Path(path), rank, alpha, demo_train.LORA_TARGETS)


def _initial_model(shape):  # -> demo_qwen3.Qwen3ForCausalLM
    """The model with seeded initial weights, filled in sorted-name order from one generator."""
    import torch

    from ledgerserve.demo_qwen3 import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(shape)
    generator = torch.Generator().manual_seed(SEED)
    params = dict(model.named_parameters())  # tied: no lm_head
    with torch.no_grad():
        for name in sorted(params):
            if name.endswith("norm.weight"):
                params[name].fill_(1.0)
            else:
                params[name].copy_(torch.randn(params[name].shape, generator=generator) * 0.02)
    return model


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
