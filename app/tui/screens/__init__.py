"""Screens of the chat TUI: the main screen and its modal dialogs, one per module."""
