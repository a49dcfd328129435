"""A tiny deterministic demo checkpoint: Qwen3 architecture with RANDOM weights.

`ensure_demo_model()` builds it once under `~/.cache/ledgerserve/demo-model-v1` (or the
given directory): a byte-level BPE tokenizer trained on `ledgerserve/data/demo_corpus.txt`,
a ChatML chat template, and seeded random weights saved as safetensors. The model
produces gibberish; it exists so the whole server can run on any machine. Building twice
gives byte-identical files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

DEMO_MODEL_NAME = "demo-model-v1"
SEED = 1234
VOCAB_SIZE = 1536
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS_PATH = Path(__file__).parent / "data" / "demo_corpus.txt"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

README = """# ledgerserve demo model (demo-model-v1)

THE WEIGHTS OF THIS MODEL ARE RANDOM. It generates meaningless text.

It has the Qwen3 architecture (hidden size 128, 2 layers, 4 query heads, 2 KV heads,
tied embeddings) with weights drawn from a seeded normal distribution, and a byte-level
BPE tokenizer trained on a small English corpus. It exists so that ledgerserve can be run
and tested end to end on any machine, without downloading a real model.
"""


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "ledgerserve", DEMO_MODEL_NAME)


def ensure_demo_model(cache_dir: str | None = None) -> str:
    """Return the directory of the demo model, building it first if it is missing."""
    target = Path(cache_dir or default_cache_dir())
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)
        write_demo_model(tmp)
        os.replace(tmp, target)  # atomic; fails if a concurrent builder won the race
    except OSError:
        if not (target / "model.safetensors").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def write_demo_model(out: Path) -> None:
    tokenizer = train_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    _write_json(out / "special_tokens_map.json", _special_tokens_map())
    _write_json(out / "generation_config.json", _generation_config(ids))
    _write_weights(out, tokenizer.get_vocab_size(), ids)
    (out / "README.md").write_text(README, encoding="utf-8")


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


def _model_config(vocab_size: int, ids: dict[str, int]):  # -> transformers.Qwen3Config
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        dtype="float32",
    )


def _write_weights(out: Path, vocab_size: int, ids: dict[str, int]) -> None:
    from safetensors.torch import save_file

    config = _model_config(vocab_size, ids)
    config.save_pretrained(str(out))
    _mark_random_weights(out / "config.json")
    save_file(_random_state_dict(config), str(out / "model.safetensors"), metadata={"format": "pt"})


def _random_state_dict(config) -> dict:
    """Seeded weights with the exact names and shapes of Qwen3ForCausalLM.

    Parameters are filled in sorted-name order from one generator, so the result does not
    depend on how transformers happens to initialise modules."""
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied: no lm_head
    generator = torch.Generator().manual_seed(SEED)
    state: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shapes[name], dtype=torch.float32)
        else:
            state[name] = torch.randn(shapes[name], generator=generator, dtype=torch.float32) * 0.02
    return state


def _mark_random_weights(path: Path) -> None:
    config = json.loads(path.read_text(encoding="utf-8"))
    config["architectures"] = ["Qwen3ForCausalLM"]
    config["ledgerserve_note"] = "demo model: the weights are random; outputs are meaningless"
    config.pop("transformers_version", None)  # keep the files identical across versions
    _write_json(path, config)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
