"""The HTTP process's tokenizer: AutoTokenizer's, built by the generic fast class directly when
tokenizer_config.json names it, so that loading it imports no torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from ledgerserve.tokenizer_proc.main import load_tokenizer

TEXTS = ["hello world", "<|im_start|>user\nhi<|im_end|>", "  spaced  out\n\n", "ünïcødé ✓ 123"]


def _same(tok, ref) -> None:
    assert type(tok) is type(ref)
    assert [tok(t)["input_ids"] for t in TEXTS] == [ref(t)["input_ids"] for t in TEXTS]
    assert tok.all_special_tokens == ref.all_special_tokens and tok.chat_template == ref.chat_template
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (
        ref.eos_token_id,
        ref.bos_token_id,
        ref.pad_token_id,
    )


def test_the_generic_fast_class_gives_autotokenizers_tokenizer_without_torch(demo_model_dir: str) -> None:
    assert json.loads((Path(demo_model_dir) / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "PreTrainedTokenizerFast"
    )
    _same(load_tokenizer(demo_model_dir), AutoTokenizer.from_pretrained(demo_model_dir))
    code = (
        f"import sys\nfrom ledgerserve.tokenizer_proc.main import load_tokenizer\nload_tokenizer({demo_model_dir!r})\n"
    )
    code += "print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["False"], done.stderr


def test_another_declared_class_goes_through_autotokenizer(demo_model_dir: str, tmp_path: Path) -> None:
    copy = tmp_path / "tok"
    shutil.copytree(demo_model_dir, copy, ignore=shutil.ignore_patterns("*.safetensors", "adapters"))
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2TokenizerFast"  # not the generic class: AutoTokenizer decides
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    _same(load_tokenizer(str(copy)), AutoTokenizer.from_pretrained(str(copy)))
