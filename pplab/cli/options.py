"""What the commands' flags accept, each refused with argparse's error naming the value, and
what the commands' reports share."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An option's whole number >= 1, or argparse's error naming the value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or str(value) != text.strip().lstrip("+"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def number(text: str, positive: bool = False) -> float:
    """An option's finite number >= 0 (> 0 when `positive`), or argparse's error naming the value."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 if positive else value >= 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number {'> 0' if positive else '>= 0'}")
    return value


def per_stage(text: str) -> float | tuple[float, ...]:
    """One duration for every stage ("1.5"), or one per stage separated by commas ("1,1,2,1")."""
    parts = text.split(",")
    try:
        values = tuple(number(part.strip()) for part in parts)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration >= 0, nor one per stage "
                                         f"separated by commas (e.g. 1 or 1,1,2,1)") from None
    return values[0] if len(values) == 1 else values



def betas(text: str) -> tuple[float, float]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give two numbers, e.g. 0.9,0.95")
    return tuple(number(part) for part in parts)



def balance(text: str) -> tuple[int, ...]:
    return tuple(positive_int(part) for part in text.split(","))



def arguments_as_json(args: argparse.Namespace) -> dict:
    """The command's arguments as JSON can hold them."""
    return {key: list(value) if isinstance(value, tuple) else value
            for key, value in vars(args).items() if key != "handler"}


def bubble_figure(value: float | None) -> str:
    """A bubble fraction as the demo prints it, or "n/a" when theory has no closed form."""
    return "n/a" if value is None else f"{value:.3f}"
