"""`ledgerserve serve` and `ledgerserve replay`. The serve flags are generated from EngineConfig's
fields (shared/config.py), but for the few arguments that are not one field each (`_add_other_args`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any

from ledgerserve.shared.config import EngineConfig, Flag, GiB, MiB

AUTO = "auto"  # an auto setting's flag with choices given this value is as if not given


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, EngineConfig)
    _add_other_args(parser)


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
        options["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
    else:
        choices = _choices(f) or None  # shown as the metavar when there are choices
        metavar = None if choices else flag_of(f)[2:].upper().replace("-", "_")
        options.update(type=flag.parse or _value_type(hint), choices=choices, metavar=metavar)
        if typing.get_origin(hint) is tuple:
            options["action"] = "append"
    parser.add_argument(flag_of(f), *flag.aliases, **options)


def _choices(f: dataclasses.Field) -> tuple[str, ...]:
    """A flag's choices: the field's, and `auto` first where start-up resolves it."""
    flag: Flag = f.metadata["flag"]
    return (AUTO, *flag.choices) if flag.choices and flag.auto_text else flag.choices


def _help(f: dataclasses.Field) -> str:
    return f"{f.metadata['flag'].help} (default: {shown_default(f)})".replace("%", "%%")  # argparse formats help with %


def _add_other_args(parser: argparse.ArgumentParser) -> None:
    """The arguments that are not one EngineConfig field each."""
    add = parser.add_argument
    add("model_dir", nargs="?", default=None, help="local HF checkpoint directory (default: the demo model)")
    add("--api-key", default=None, help="require this Bearer key on every /v1 route (or set LEDGERSERVE_API_KEY)")
    modules = 'adapters loaded at start-up (trusted): NAME=PATH or JSON {"name": ..., "path": ..., "pinned": false}'
    add("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", help=modules)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ledgerserve")
    sub = parser.add_subparsers(dest="command", required=True)
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
