from __future__ import annotations

import pytest

from ledgerserve.tokenizer_proc.chat_template import ChatTemplate, ChatTemplateError, ReservedVariable


def test_renders_model_template(demo_model_dir: str, tokenizer) -> None:
    template = ChatTemplate.from_model_dir(demo_model_dir)
    assert template is not None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    ours = template.render(messages, add_generation_prompt=True)
    theirs = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")
    assert not template.render(messages, add_generation_prompt=False).endswith("assistant\n")


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__subclasses__() }}",
        "{% set x = messages.append(1) %}{{ x }}",
        "{{ messages[0].update({'role': 'x'}) }}",
    ],
)
def test_sandbox_refuses_unsafe_access(source: str) -> None:
    template = ChatTemplate(source)
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "hi"}])


def test_sandbox_hides_private_attributes() -> None:
    template = ChatTemplate("[{{ raise_exception.__globals__ }}][{{ messages.__len__ }}]")
    assert template.render([{"role": "user", "content": "hi"}]) == "[][]"


def test_raise_exception_becomes_error() -> None:
    template = ChatTemplate("{{ raise_exception('no system role') }}")
    with pytest.raises(ChatTemplateError, match="no system role"):
        template.render([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "key", ["messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "raise_exception", "range", "self"]
)
def test_extra_variables_cannot_set_what_the_renderer_sets(key: str) -> None:
    template = ChatTemplate("{{ messages[0]['content'] }}-{{ flavour }}")
    assert template.render([{"role": "user", "content": "hi"}], extra={"flavour": "x"}) == "hi-x"
    with pytest.raises(ReservedVariable, match=f"`{key}`"):
        template.render([{"role": "user", "content": "hi"}], extra={"flavour": "x", key: "z"})


def test_missing_template_gives_none(tmp_path) -> None:
    assert ChatTemplate.from_model_dir(str(tmp_path)) is None
