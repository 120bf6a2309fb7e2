"""The command line: `main` parses and dispatches; one module per command, one renderer."""

from cgbuild.cli.main import main

__all__ = ["main"]
