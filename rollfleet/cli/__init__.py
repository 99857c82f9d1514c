"""The ``rollfleet`` command line: ``broker``, ``declare``, ``worker``, ``up``, ``gateway``, ``permissions``,
``status``."""

from rollfleet.cli.main import main

__all__ = ["main"]
