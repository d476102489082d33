"""The `streamscope` command's entry point (pyproject's ``streamscope.cli:main``); the commands are in
`streamscope.workflows.cli`."""

from .workflows.cli import main, parser

__all__ = ["main", "parser"]
