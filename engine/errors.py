"""Errors the engine raises for bad input. Each carries one readable sentence."""


class MlxtermError(Exception):
    """Base for errors shown to the user as one line (no traceback)."""


class ModelLoadError(MlxtermError):
    """A model file or directory is missing, corrupt or unsupported."""


class ProfileError(MlxtermError):
    """A YAML profile is invalid; the message names file:line, key, value and what is allowed."""


class CatalogError(MlxtermError):
    """A catalogue model cannot be installed, verified or found."""
