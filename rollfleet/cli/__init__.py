"""The ``rollfleet`` command line: ``broker``, ``declare``, ``worker``, ``up``, ``status``."""

from rollfleet.cli.main import main

__all__ = ["main"]
