"""Typed errors. Every message names the artifact, file, column or field it concerns."""

from __future__ import annotations

from collections.abc import Iterator


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, then what it was raised from or during (`__cause__`, else `__context__`), and so on; each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


class R1FlowError(Exception):
    """Base class: the CLI prints these as one clear line instead of a traceback."""


class SchemaError(R1FlowError):
    """A dataset does not match its declared kind (names the column and the problem)."""


class ConfigError(R1FlowError):
    """A recipe, profile, stage config or `--set` override is invalid (names the key)."""


class ArtifactError(R1FlowError):
    """An artifact is missing, incomplete or does not match its fingerprint."""


class ModelError(R1FlowError):
    """A model reference cannot be resolved or loaded."""


class StageError(R1FlowError):
    """A stage failed in a launched process (names the stage and rank; carries the traceback's tail)."""


class EnvironmentCodeError(R1FlowError):
    """An environment's own code (a user's environment file, or a built-in's) raised or broke the protocol: names
    the environment, the method and the line that raised (the exception itself is the cause)."""
