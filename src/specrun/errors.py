"""Domain errors. Raised in the core, turned into one-line messages only at the CLI edge."""

from __future__ import annotations


class SpecrunError(Exception):
    """A runtime error the user can act on: printed as one line, exit code 1."""

    exit_code = 1


class UsageError(SpecrunError):
    """Bad options or arguments: exit code 2."""

    exit_code = 2


class ModelError(SpecrunError):
    """A model file is missing, unreadable, invalid or cannot be loaded."""


class RegistryError(SpecrunError):
    """models.toml is malformed, or a name does not resolve."""


class PullError(SpecrunError):
    """Fetching a model failed (network, checksum, disk)."""


class IncompatiblePairError(SpecrunError):
    """The draft model cannot speculate for the target (vocabularies differ, ...)."""
