"""Errors that speak to the user: which key, what value, what was expected."""
from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input. The CLI prints ``str(err)`` on one line and exits with code 2."""


class ConfigError(UserError):
    """A config key has a value the run cannot use."""

    def __init__(self, key: str, value: object, expected: str):
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"config error: {key} = {value!r}: expected {expected}")
