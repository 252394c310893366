"""The box every explorer widget of the chapters comes in: its rows of controls and figure, and, for a notebook
viewer without a kernel (GitHub, nbviewer), a line that says where the static version is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def explorer_box(rows: Sequence[Any], name: str, static: str) -> Any:
    """``rows`` (controls, then the output area) in a ``VBox`` whose repr reads
    ``<{name}: it needs a live kernel ({static})>``."""
    import ipywidgets as widgets

    class Explorer(widgets.VBox):
        def __repr__(self) -> str:  # what a notebook viewer without a kernel shows instead of the widget
            return f"<{name}: it needs a live kernel ({static})>"

    return Explorer(list(rows))


__all__ = ["explorer_box"]
