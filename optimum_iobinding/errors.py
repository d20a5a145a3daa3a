"""The refusals of bad arguments, carrying the argument's name as data: each surface (Python, the command line, the
HTTP API) names the argument in its own words by looking ``argument`` up in a table, never by reading the text."""

from __future__ import annotations


class ArgumentError(ValueError):
    """An argument refused: ``str(error)`` is ``"argument: reason"``, as every check of the project words it;
    ``argument`` and ``reason`` are kept apart so that :meth:`renamed` can call the argument otherwise (``--provider``
    on the command line for ``provider``) and keep the reason."""

    def __init__(self, argument: str, reason: str):
        super().__init__(f"{argument}: {reason}")
        self.argument = argument
        self.reason = reason

    def renamed(self, name: str) -> "ArgumentError":
        """The same refusal, of the same class, naming ``name`` instead of :attr:`argument`."""
        return type(self)(name, self.reason)

    def __reduce__(self):  # picklable across processes (a Ray replica's error reaches the driver)
        return type(self), (self.argument, self.reason)


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of the wrong type (a ``TypeError`` too, as the checks raised before)."""


class ArgumentPathError(ArgumentError, FileNotFoundError):
    """A path argument that names nothing there (a ``FileNotFoundError`` too)."""
