"""Conditions TUI tests wait on instead of fixed pauses."""

from __future__ import annotations


def palette_offers(app, text: str) -> bool:
    """The command palette is open, its search has settled and the highlighted command (what
    Enter runs) contains ``text``."""
    from textual.command import CommandList

    lists = app.screen.query(CommandList)
    if not lists:
        return False
    options = lists.first()
    if options.highlighted is None or options.option_count == 0:
        return False
    return text.lower() in str(options.get_option_at_index(options.highlighted).prompt).lower()
