"""Errors shared across the package.

UserError lives here rather than in cli.py so that `python -m verispec.cli` (where cli.py
runs as __main__) and the modules that import it agree on one class.
"""


class UserError(Exception):
    """A mistake the user can fix; the CLI prints it as one line and exits 2."""
