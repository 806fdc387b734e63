"""What ``peerdcp run`` and ``peerdcp generate`` share on the terminal: argument types, table cells, the progress
display."""

from __future__ import annotations

import argparse
import textwrap

__all__ = ["positive_int", "progress", "short"]


def short(reason: object, width: int = 160) -> str:
    """A table cell: the reason cut at a word boundary, marked, not mid-word."""
    return textwrap.shorten(str(reason), width, placeholder=" …")


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (anything else is a usage error, exit 2, before any rank starts)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def progress():
    """A rich progress bar (not yet started), or None where rich is missing."""
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        return Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), transient=False)
    except ImportError:  # pragma: no cover
        return None
