from __future__ import annotations

import random

import pytest

from ledgerserve.tokenizer_proc.detokenizer import IncrementalDetokenizer, held_back_chars


def _stream(tokenizer, text: str, stop=(), prompt: str = "Hi") -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), stop)
    ids = tokenizer.encode(text)
    deltas = [detok.push([t], finished=(i == len(ids) - 1)) for i, t in enumerate(ids)]
    return deltas, detok


def test_multibyte_characters_never_split(tokenizer) -> None:
    text = "naïve café 🙂 你好 over there"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # the tokens do split bytes
    deltas, _ = _stream(tokenizer, text)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_batched_pushes_match_single(tokenizer) -> None:
    text = "The garden teaches patience 🍞 better than any book."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], ())
    out = detok.push(ids[:3]) + detok.push(ids[3:7]) + detok.push(ids[7:], finished=True)
    assert out == text


def test_stop_string_is_excluded(tokenizer) -> None:
    deltas, detok = _stream(tokenizer, "one two three four five", stop=["three"])
    assert "".join(deltas) == "one two "
    assert detok.stop_matched == "three"
    assert detok.stopped


def test_stop_prefix_is_held_back_then_released(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], ["STOP!"])
    sent = detok.push(tokenizer.encode("hello ST"))
    assert sent == "hello "  # "ST" might start a stop string
    sent += detok.push(tokenizer.encode("ay here"), finished=True)
    assert sent == "hello STay here"
    assert not detok.stopped


def test_earliest_of_several_stops_wins(tokenizer) -> None:
    deltas, detok = _stream(tokenizer, "red green blue", stop=["blue", "green"])
    assert "".join(deltas) == "red "
    assert detok.stop_matched == "green"


def test_stop_across_tokens(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], ["lo wo"])
    out = ""
    for token_id in tokenizer.encode("hello world"):
        out += detok.push([token_id])
        if detok.stopped:
            break
    assert out == "hel"


def test_tokens_after_stop_are_not_taken(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], ["two"])
    ids = tokenizer.encode("one two three")
    detok.push(ids, finished=False)
    assert detok.stopped
    assert len(detok.output_token_ids) < len(ids)
    assert tokenizer.decode(detok.output_token_ids).endswith("two")


def test_special_tokens_skipped(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], ())
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert detok.push(tokenizer.encode("done") + [eos], finished=True) == "done"


@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("clean_up", [True, False])
def test_window_decode_is_the_tokenizers_decode(demo_model_dir: str, skip_special: bool, clean_up: bool) -> None:
    """The detokenizer decodes its windows without tokenizer.decode's per-id walk; the text
    must be decode's own, special tokens and clean-up included, whatever the window."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir, clean_up_tokenization_spaces=clean_up)
    detok = IncrementalDetokenizer(tokenizer, [], (), skip_special_tokens=skip_special)
    rng = random.Random(7)
    specials = list(tokenizer.all_special_ids)
    windows = [tokenizer.encode("Hello , world . It 's a test !") + specials]
    windows += [[rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 12))] + specials[:1] for _ in range(200)]
    for ids in windows:
        assert detok._decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip_special)


def test_held_back_chars() -> None:
    assert held_back_chars("abc", ["cd"]) == 1
    assert held_back_chars("abc", ["bcd", "x"]) == 2
    assert held_back_chars("abc", ["zz"]) == 0
