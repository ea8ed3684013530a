"""The errors of fetching and resolving models; each message is one line meant for the user."""

from __future__ import annotations

__all__ = ["ModelFetchError", "ModelNotFoundError", "RegistryError"]


class RegistryError(RuntimeError):
    """Base class; the message is always one line meant for the user."""


class ModelFetchError(RegistryError):
    """A default model could not be downloaded, assembled, verified or converted."""


class ModelNotFoundError(RegistryError):
    """A model name is neither a registry name, a local model, nor a reachable Hub repo."""
