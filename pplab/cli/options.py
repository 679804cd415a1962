"""What the commands' flags accept, each refused with argparse's error naming the value (a run's
options: the flags made from their fields, `add_field_flags`), and what the commands' reports share."""

from __future__ import annotations

import argparse
import dataclasses
import re

from pplab.base.config import COUNT, NUMBER_OR_ZERO, POSITIVE, sections_of


def positive_int(text: str) -> int:
    """An option's whole number >= 1, or argparse's error naming the value (a count's
    rule, as a run's fields read it)."""
    return text_of_kind(COUNT)(text)


def number(text: str, positive: bool = False) -> float:
    """An option's finite number >= 0 (> 0 when `positive`), or argparse's error naming the value."""
    return text_of_kind(POSITIVE if positive else NUMBER_OR_ZERO)(text)


def arguments_as_json(args: argparse.Namespace) -> dict:
    """The command's arguments as JSON can hold them."""
    return {key: list(value) if isinstance(value, tuple) else value
            for key, value in vars(args).items() if key != "handler"}


def bubble_figure(value: float | None) -> str:
    """A bubble fraction in percent, as the pictures title it ("11.1 %"), or "n/a" when theory has no
    closed form."""
    return "n/a" if value is None else f"{100 * value:.1f} %"


def add_field_flags(parser: argparse.ArgumentParser, config_class, skip=(), title: str | None = None,
                    **changed) -> None:
    """A flag for each field of the dataclass `config_class` (pplab.base.config.option's fields; those in
    `skip` left out), grouped by section as `--help` shows them: `--batch-size` for `batch_size`, with
    the field's help, default and check. `changed` gives a field's flag other argparse settings, a
    default other than the field's with its reason (`backward={"default": None, "because": "..."}`).
    `title`: the groups' title ("{section}" in it); by default a --config file's tables."""
    for section, names in sections_of(config_class).items():
        group = parser.add_argument_group((title or "{section} (a --config file's [{section}] table)")
                                          .format(section=section))
        for name in names:
            if name not in skip:
                add_option_flag(group, config_class, name, **changed.get(name, {}))


def add_option_flag(parser: argparse.ArgumentParser, family, name: str, because: str | None = None,
                    when: str | None = None, **settings) -> argparse.Action:
    """The flag of the option `name` of `family` (a dataclass of pplab.base.config.option fields), on any
    command: its help, kind and default, but for the argparse `settings` given. A default other than
    the field's (`default=8`) needs `because`, the reason, shown in the help ("default 8: ...");
    without one the parser is not built (tests/test_config.py builds every command's). `when`: where
    the flag counts on this command ("with --plan"), before the field's help."""
    field = next(each for each in dataclasses.fields(family) if each.name == name)
    default = settings.get("default", field.default)
    if default != field.default and not settings.get("required") and because is None:
        raise ValueError(f"--{name.replace('_', '-')}: default {default!r}, not {family.__name__}.{name}'s "
                         f"{field.default!r}: say why with because=...")
    action = add_field_flag(parser, field, because=because, when=when, **settings)
    action.option_of = (family, name)  # what tests/test_config.py walks
    return action


def add_field_flag(parser: argparse.ArgumentParser, field: dataclasses.Field, because: str | None = None,
                   when: str | None = None, **settings) -> argparse.Action:
    """One field's flag (see add_field_flags); `because`: why its default here is not the field's;
    `when`: where it counts."""
    kind, default = field.metadata["kind"], settings.pop("default", field.default)
    shown = "" if default is None or settings.get("required") else f" (default {_shown(default)})"
    if because is not None:  # why it is not the field's
        shown = f" (default: {because})" if default is None else f" (default {_shown(default)}: {because})"
    metavar = field.metadata["metavar"] or ("{" + ",".join(kind.choices) + "}" if kind.choices else None)
    said = field.metadata["help"]
    if because is not None:  # the field's own "(default: ...)" is not this flag's
        said = re.sub(r" \(default: [^()]*\)$", "", said)
    said = ((f"{when}: " if when else "") + said + shown).replace("%", "%%")  # argparse %-formats help
    flag = dict(help=said, default=default, metavar=metavar)
    if isinstance(default, bool):
        flag = dict(help=flag["help"].removesuffix(" (default False)"), action="store_true", default=default)
    else:
        flag["type"] = text_of_kind(kind)
    return parser.add_argument("--" + field.name.replace("_", "-"), **{**flag, **settings})


def text_of_kind(kind):
    """argparse's `type` for a field of this kind: the flag's text read as the kind reads it, refused
    in argparse's words ("argument --steps: '0' is not a whole number >= 1")."""
    def read(text: str):
        try:
            value = kind.from_text(text)
            kind.check("value", value, optional=value is None)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind.said}") from None
        return value
    read.__name__ = kind.said
    return read


def _shown(default) -> str:
    return ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
