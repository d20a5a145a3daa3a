"""The refusals of bad arguments, carrying the argument's name as data: each surface (Python, the command line, the
HTTP API) names the argument in its own words by looking ``argument`` up in a table, never by reading the text.
:func:`did_you_mean` words the suggestion for a misspelled name (a keyword, a provider, a command-line flag) the
same way on every surface. The commands' parser (one-line refusals) and their quieting of the libraries' notices are
here too, for the command line and the bench alike. Standard library only: the command line imports this module at
start-up."""

from __future__ import annotations

import argparse
import difflib
from typing import Any, Iterable, List, NoReturn, Sequence

PROGRAM = "optimum-iobinding"  # the command's name, first on every line it writes about an error


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


class ModelFileError(ValueError):
    """A model file (an ONNX graph, a component's config.json, a LoRA's weights) that cannot serve: ``str(error)``
    is ``"file: reason"``, naming the file or component as the folder names it. Not an argument's fault: the same
    call with a sound model runs."""

    def __init__(self, file: str, reason: str):
        super().__init__(f"{file}: {reason}")
        self.file = file
        self.reason = reason

    def __reduce__(self):  # picklable across processes, as ArgumentError
        return type(self), (self.file, self.reason)


def close_matches(word: str, choices: Iterable[str], n: int = 3, cutoff: float = 0.6) -> List[str]:
    """The choices ``word`` most likely misspells, best first: those equal to it but for case, then
    ``difflib.get_close_matches``' (compared case-insensitively, so ``cuda_GRAPH`` finds ``cuda_graph``); at most
    ``n``, none equal to ``word`` itself."""
    by_folded = {}
    for choice in choices:
        by_folded.setdefault(choice.casefold(), choice)
    folded = word.casefold()
    matches = [by_folded[folded]] if folded in by_folded else []
    matches += [
        by_folded[match]
        for match in difflib.get_close_matches(folded, list(by_folded), n + 1, cutoff)
        if by_folded[match] not in matches
    ]
    return [match for match in matches if match != word][:n]


def did_you_mean(word: str, choices: Iterable[str], n: int = 1) -> str:
    """``"did you mean io_binding?"`` for ``word="io_bindng"`` among ``choices`` (with ``n`` > 1 up to ``n`` near
    ones: ``"did you mean a or b?"``), or ``""`` where no choice is close: a refusal appends it to what it says is
    wrong."""
    matches = close_matches(word, choices, n)
    if not matches:
        return ""
    return f"did you mean {' or '.join(matches)}?"


def unrecognized_arguments(unknown: Sequence[str], options: Iterable[str]) -> str:
    """argparse's ``unrecognized arguments: …`` for the arguments ``unknown`` that no parser took, with the options
    among ``options`` that the misspelled ones are close to (``(did you mean --steps?)``), their names compared
    without the dashes (which every option shares: ``--frobnicate`` is close to no ``--frames``)."""
    by_name = {option.lstrip("-"): option for option in options}
    close = list(
        dict.fromkeys(
            by_name[match]
            for word in unknown
            if word.startswith("-")
            for match in close_matches(word.partition("=")[0].lstrip("-"), by_name, n=1)
        )
    )
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    return f"unrecognized arguments: {' '.join(unknown)}{hint}"


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with each option's default after its text where the text does not give it (options whose
    default is ``None`` or ``False`` have none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or any(default is none for none in (None, False, argparse.SUPPRESS)):
            return text
        if "default" in text:
            return text
        shown = repr(default).replace("%", "%%") if isinstance(default, str) and " " in default else "%(default)s"
        return f"{text} (default {shown})" if text else f"default {shown}"


class RawDescriptionHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """:class:`HelpFormatter` keeping the description's own line breaks."""


DEBUG_HELP = "show the traceback of an error (before or after the command's name)"


class CommandLineParser(argparse.ArgumentParser):
    """argparse's parser, refusing a mistake in one line, ``optimum-iobinding: error: …`` (exit status 2), as every
    other refusal of the command line: no usage block before it (``--help`` shows the usage), and argparse's
    ``argument --steps: …`` worded as the project's checks word theirs, ``--steps: …``. The parsers of the commands
    (``add_subparsers``) are of the same class. Its help shows the options' defaults (:class:`HelpFormatter`)."""

    def __init__(self, *args: Any, formatter_class: type = HelpFormatter, **kwargs: Any):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str) -> NoReturn:
        prefix = "argument "  # argparse's own words before an option's name: "argument --steps: invalid int value"
        if message.startswith(prefix):
            message = message[len(prefix) :]
        self.exit(2, f"{PROGRAM}: error: {message}\n")


def quiet_libraries() -> None:
    """A command prints its own results and errors: the libraries' notices (transformers' "requires torchvision",
    diffusers' dtype notes while the tiny model is built) are for library users, so the command shows their errors
    only; this project's own warnings still show. Each command calls this once its arguments passed their checks,
    before it loads anything: it imports diffusers and transformers (each sets its own level when imported), which
    --help and a mistake in the arguments need not wait for. ONNX Runtime's Python tools (the symbolic shape inference
    the export runs: "Cannot determine if floor(height/2) + … < 0", a slice it leaves unresolved and the export does
    not need) log through ``logging``, under their package's name or, imported by its transformer tools, their own."""
    import logging

    for name in ("onnxruntime", "symbolic_shape_infer"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import diffusers.utils.logging as diffusers_logging
        import transformers.utils.logging as transformers_logging

        diffusers_logging.set_verbosity_error()
        transformers_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover — both are requirements
        pass
