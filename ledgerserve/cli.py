"""`ledgerserve serve` and `ledgerserve replay`. The serve flags are generated from EngineConfig's
fields (shared/config.py), but for the few arguments that are not one field each (`_add_other_args`)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ledgerserve.shared.config import EngineConfig, Flag, GiB, MiB

AUTO = "auto"  # an auto setting's flag with choices given this value is as if not given


@dataclass(frozen=True)
class VllmFlag:
    """A vLLM flag with no setting here: `notice` (accepted; start-up logs `reason` once) or
    `refuse` (start-up fails with `reason`), unless its value is one of `fine_values`."""

    flag: str
    action: str
    reason: str
    takes_value: bool = False
    fine_values: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # short forms, as vLLM's


LOG_REQUESTS_NOTICE = (
    "the server's log never prints request contents (the access log, --uvicorn-log-level, has one line per "
    "request); the event log keeps every prompt and output token id unless --event-log-content hashed"
)
VLLM_FLAGS = (
    VllmFlag(
        "--trust-remote-code",
        "notice",
        "remote code is never run: only the built-in Llama-family architectures are served",
    ),
    VllmFlag("--disable-log-requests", "notice", LOG_REQUESTS_NOTICE),
    VllmFlag("--enable-log-requests", "notice", LOG_REQUESTS_NOTICE),
    VllmFlag("--enable-prefix-caching", "notice", "the prefix cache is always on"),
    VllmFlag(
        "--no-enable-prefix-caching",
        "refuse",
        "the prefix cache cannot be turned off: the KV cache is the prefix cache (one radix tree per adapter version)",
    ),
    VllmFlag("--enable-lora-bias", "refuse", "LoRA adapters with biases are not supported"),
    VllmFlag(
        "--fully-sharded-loras",
        "notice",
        "adapters are always sharded with the model (full A and this rank's rows of B on column-parallel layers, "
        "this rank's columns of A and a small all-reduce on row-parallel ones); the flag changes nothing",
    ),
    VllmFlag(
        "--pipeline-parallel-size",
        "refuse",
        "pipeline parallelism is not built: split the model with --tensor-parallel-size",
        takes_value=True,
        fine_values=("1",),
        aliases=("-pp",),
    ),
    VllmFlag(
        "--data-parallel-size",
        "refuse",
        "one engine serves one copy of the model: run several servers behind a router for data parallelism",
        takes_value=True,
        fine_values=("1",),
        aliases=("-dp",),
    ),
    VllmFlag(
        "--distributed-executor-backend",
        "refuse",
        "the launcher starts one worker process per tensor-parallel rank (vLLM's mp); no other executor is built",
        takes_value=True,
        fine_values=("mp",),
    ),
    VllmFlag(
        "--quantization", "refuse", "quantized checkpoints are not supported: weights load as --dtype", takes_value=True
    ),
    VllmFlag(
        "--kv-cache-dtype",
        "refuse",
        "the KV cache is kept in the model dtype; fp8 KV is not supported",
        takes_value=True,
        fine_values=("auto",),
    ),
)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, EngineConfig)
    _add_other_args(parser)
    _add_vllm_flags(parser)


def add_settings(parser: argparse.ArgumentParser, config_type: type) -> None:
    """One flag per field of `config_type` that has one (a `shared.config.setting`)."""
    hints = typing.get_type_hints(config_type)
    for f in flagged_fields(config_type):
        _add_setting(parser, f, hints[f.name])


def flagged_fields(config_type: type = EngineConfig) -> list[dataclasses.Field]:
    """The fields that have a flag of their own."""
    return [f for f in dataclasses.fields(config_type) if "flag" in f.metadata]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata["flag"].name or "--" + f.name.replace("_", "-")


def _add_setting(parser: argparse.ArgumentParser, f: dataclasses.Field, hint: Any) -> None:
    """One flag from its field. The parser's own default is None (not given), so the value a flag
    not given ends up with is the field's default or the launcher's resolution, never restated."""
    flag: Flag = f.metadata["flag"]
    options: dict[str, Any] = {"dest": f.name, "default": None, "help": _help(f)}
    if _value_type(hint) is bool:
        on_somewhere = f.default or flag.on_cuda  # on by default somewhere: --no-X turns it off
        options["action"] = argparse.BooleanOptionalAction if on_somewhere else "store_true"
    else:
        choices = _choices(f) or None  # shown as the metavar when there are choices
        metavar = None if choices else flag_of(f)[2:].upper().replace("-", "_")
        value_type = _saying_why(flag.parse) if flag.parse else _value_type(hint)
        options.update(type=value_type, choices=choices, metavar=metavar, nargs=flag.nargs)
        if typing.get_origin(hint) is tuple and flag.repeat:
            options["action"] = "append"
    parser.add_argument(flag_of(f), *flag.aliases, **options)


def _saying_why(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` whose ValueError reaches the user: argparse shows an ArgumentTypeError's message."""

    def parse_text(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse_text


def _choices(f: dataclasses.Field) -> tuple[str, ...]:
    """A flag's choices: the field's, and `auto` first where start-up resolves it."""
    flag: Flag = f.metadata["flag"]
    return (AUTO, *flag.choices) if flag.choices and flag.auto_text else flag.choices


def _help(f: dataclasses.Field) -> str:
    return f"{f.metadata['flag'].help} (default: {shown_default(f)})".replace("%", "%%")  # argparse formats help with %


def _add_other_args(parser: argparse.ArgumentParser) -> None:
    """The arguments that are not one EngineConfig field each."""
    add = parser.add_argument
    model = "a local checkpoint directory or a Hugging Face id ORG/NAME (default: the demo model)"
    add("model_dir", nargs="?", default=None, metavar="MODEL", help=model)
    add("--model", dest="model", default=None, help="MODEL as a flag, as vLLM takes it")
    add("--api-key", default=None, help="require this Bearer key on every /v1 route (or set LEDGERSERVE_API_KEY)")
    admin = "require this Bearer key to load, unload or pin adapters (or set LEDGERSERVE_ADMIN_API_KEY)"
    add("--admin-api-key", default=None, help=admin)
    modules = (
        'adapters loaded at start-up (trusted): NAME=PATH or JSON {"name": ..., "path": ..., "pinned": false} '
        "(vLLM's base_model_name accepted; other keys refused)"
    )
    add("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", help=modules)


def _add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """VLLM_FLAGS, in a group of their own."""
    group = parser.add_argument_group("vLLM flags with no setting here (accepted with a notice, or refused)")
    for vf in VLLM_FLAGS:
        kind = {"metavar": "VALUE", "default": None} if vf.takes_value else {"action": "store_true"}
        help_text = f"{vf.action}: {vf.reason}".replace("%", "%%")
        group.add_argument(vf.flag, *vf.aliases, dest=_vllm_dest(vf), help=help_text, **kind)


def _vllm_dest(vf: VllmFlag) -> str:
    return "vllm_" + vf.flag[2:].replace("-", "_")


def vllm_flag_notices(args: argparse.Namespace) -> list[str]:
    """One notice per accepted VLLM_FLAGS flag given; ValueError naming the first refused one."""
    notices = []
    for vf in VLLM_FLAGS:
        value = getattr(args, _vllm_dest(vf), None)
        if value in (None, False) or value in vf.fine_values:
            continue
        given = f"{vf.flag} {value}" if vf.takes_value else vf.flag
        if vf.action == "refuse":
            raise ValueError(f"{given} is refused: {vf.reason}")
        notices.append(f"{given}: {vf.reason}")
    return notices


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the flags give; a flag not given (or an auto one given `auto`) is left out."""
    given = {}
    for f in flagged_fields():
        value = getattr(args, f.name)
        if value is not None and not (value == AUTO and AUTO in _choices(f)):
            given[f.name] = tuple(value) if isinstance(value, list) else value
    return given


def shown_default(f: dataclasses.Field) -> str:
    """A field's default as --help and the README show it."""
    auto = f.metadata["flag"].auto_text
    return auto.format(default=_shown(f.name, f.default)) if auto else _shown(f.name, f.default)


def _shown(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value in (None, "", ()):
        return "none"
    for unit, unit_name in ((GiB, "GiB"), (MiB, "MiB")):
        if name.endswith("_bytes") and value >= unit and value % unit == 0:
            return f"{value // unit} {unit_name}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _value_type(hint: Any) -> type:
    """The type a flag's text becomes: `int | None` -> int, `tuple[str, ...]` -> str."""
    args = [arg for arg in typing.get_args(hint) if arg not in (type(None), Ellipsis)]
    return args[0] if args else hint


class Parser(argparse.ArgumentParser):
    """No prefix abbreviations (`--max-lora` is not `--max-loras`); an unknown flag is an error
    that names the closest known ones."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(unknown_flag_message(unknown, self._flag_names()))
        return parsed

    def _flag_names(self) -> list[str]:
        parsers = [self]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
        return [flag for p in parsers for a in p._actions for flag in a.option_strings]


def unknown_flag_message(unknown: list[str], known: list[str]) -> str:
    flags = [arg for arg in unknown if arg.startswith("-")] or unknown
    flag = flags[0].split("=", 1)[0]
    close = difflib.get_close_matches(flag, known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return f"unrecognized arguments: {' '.join(unknown)} (unknown flag {flag}{hint})"


def build_parser() -> argparse.ArgumentParser:
    from ledgerserve.version import version

    parser = Parser(prog="ledgerserve")
    parser.add_argument("-v", "-V", "--version", action="version", version=version(), help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_serve_args(sub.add_parser("serve", help="start the server (launcher, tokenizer, scheduler, workers)"))
    sub.add_parser("replay", help="replay and verify an event log", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "replay":
        from ledgerserve.scheduler_proc.replay import main as replay_main

        return replay_main(argv[1:])
    args = build_parser().parse_args(argv)
    from ledgerserve.launcher import serve

    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
