"""launch_single_task's command line, generated from the config's options (accel/cli/config.py
options(): the command line's own fields and the library's LIBRARY_FLAGS): an option added to a
dataclass is a flag here, a key of config.json and a value the resume check sees."""

from __future__ import annotations

import argparse
import difflib
import types
import typing
from typing import Any

from accel.cli.config import Option, RunConfig, from_dict, options, set_nested
from accel.cli.recipes import apply_recipe

# Help sections, in order: a nested config's fields go under its title, a top-level field under
# the `group` its metadata names.
SECTIONS = {
    "Run": "Run",
    "model": "Model",
    "data": "Data",
    "data.mixup": "Mixup and CutMix (on the host, at collate time)",
    "optim": "Optimizer and schedule",
    "Precision and kernels": "Precision and kernels",
    "hosts": "Parallelism",
    "compiler": "XLA compiler backends (xla, jax)",
    "Output, checkpoints and logging": "Output, checkpoints and logging",
}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2 (no usage block), and a flag
    must be spelt whole: argparse's default takes any unambiguous prefix (`--batch 8` as
    `--batch_size 8`), so a typo that happens to be a prefix would change the run silently."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extra = self.parse_known_args(args, namespace)
        for word in extra:
            if word.startswith("--"):
                self.error(self.unknown_flag(word.split("=", 1)[0]))
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed

    def unknown_flag(self, flag: str) -> str:
        """What an unknown flag says: the whole flags it begins, where it is a shortening."""
        known = [s for s in self._option_strings() if s.startswith("--")]
        whole = sorted(s for s in known if s.startswith(flag))
        if whole:
            names = " or ".join(whole)
            return f"{flag} is not a flag (flags are spelt whole): did you mean {names}?"
        close = difflib.get_close_matches(flag, known, n=3, cutoff=0.75)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        return f"unrecognized arguments: {flag}{hint}"

    def _option_strings(self) -> list[str]:
        # argparse lists its actions only in `_actions` (no public API gives the flags a parser
        # takes); tests/unit/test_bad_input.py's shortened-flag cases fail if it is renamed.
        return [s for action in self._actions for s in action.option_strings]

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _base_type(kind: Any) -> Any:
    """int for `int | None`, str for a Literal of strings, and so on."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if typing.get_origin(kind) is typing.Literal:
        return type(typing.get_args(kind)[0])
    return kind


def _add_option(group: Any, opt: Option) -> None:
    meta, default = opt.meta, opt.default
    kwargs: dict[str, Any] = {"dest": opt.path, "default": argparse.SUPPRESS}
    base, name = _base_type(opt.kind), opt.metavar
    if base is bool:
        kwargs["action"] = "store_false" if default else "store_true"
    elif typing.get_origin(base) is tuple:
        size = len(typing.get_args(base))
        kwargs.update(type=typing.get_args(base)[0], nargs=size, metavar=(name,) * size)
    else:
        kwargs.update(type=base, metavar=name)
    if opt.choices:
        kwargs["choices"] = opt.choices
        kwargs.pop("metavar", None)
    said = base is bool or default in (None, "") or "default" in meta["help"]
    shown = "" if said else f" (default: {_shown(default)})"
    kwargs["help"] = meta["help"] + shown
    group.add_argument(opt.flag, **kwargs)


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="launch_single_task",
        description="Train one timm Swin/ViT job on the chosen backend. USE_ACCEL=1 selects the "
        "XLA compiler path when --backend is not given.",
    )
    parser.add_argument(
        "--compare",
        default="",
        help="run the same job on each of these backends (e.g. eager,xla) and print a table",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,  # None: not given, which --repeats without --compare is told from
        metavar="N",
        help="with --compare: run each backend N times, interleaved, and print the medians with "
        "the spread of the speed-up (default: 1; 3 or more for a figure worth quoting)",
    )
    parser.add_argument(
        "--backends", action="store_true", help="print what each backend supports, and exit"
    )
    groups = {key: parser.add_argument_group(title) for key, title in SECTIONS.items()}
    for opt in options():
        _add_option(groups[opt.section], opt)
    return parser


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The options given on the command line over the dataclass defaults (unresolved)."""
    nested: dict[str, Any] = {}
    for dotted, value in vars(args).items():
        if "." not in dotted and dotted in ("compare", "repeats", "backends"):
            continue
        set_nested(nested, dotted, value)
    return from_dict(RunConfig, apply_recipe(nested))
