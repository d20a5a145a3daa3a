"""What the command tests share: reading a command's error."""

from __future__ import annotations


def error_line(capsys) -> str:
    """The one line a refused command wrote to stderr (no traceback, no usage block)."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines  # one line, no traceback
    return lines[0]
