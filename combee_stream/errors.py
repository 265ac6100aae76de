"""Errors a user can act on; the CLI prints them without a traceback."""


class UserError(Exception):
    """Something the user can fix (bad input, missing setting, broker down)."""
