"""Errors that speak to the user: which key, what value, what was expected.

A message stays one short line whatever the input: a ConfigError quotes at most :data:`QUOTE_CHARS`
characters of a key or value (and says how long it was), and any UserError keeps at most
:data:`MESSAGE_CHARS` characters on one line. Quoting costs bounded work even for a value that is huge
when written out, such as a YAML document whose aliases nest (only its first items are looked at).
"""
from __future__ import annotations

import itertools
import reprlib

QUOTE_CHARS = 200  # of one quoted key or value
MESSAGE_CHARS = 1000  # of a whole message (a safety net for messages that quote values themselves)
_ITEMS = 12  # items of a list or mapping written out before '...'


class _BoundedRepr(reprlib.Repr):
    """``repr`` that writes out at most :data:`_ITEMS` items per list or mapping, 4 levels deep; mappings in
    their own order (reprlib sorts them), subclasses of dict, list and tuple (OrderedDict, RunConfig) as those."""

    def __init__(self):
        super().__init__()
        self.maxlevel = 4
        self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = self.maxdeque = self.maxdict = _ITEMS
        self.maxstring = self.maxother = self.maxlong = QUOTE_CHARS

    def repr1(self, x, level):
        for kind, write in ((dict, self.repr_dict), (list, self.repr_list), (tuple, self.repr_tuple)):
            if isinstance(x, kind):
                return write(x, level)
        return super().repr1(x, level)

    def repr_dict(self, x, level):
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                  for k, v in itertools.islice(x.items(), self.maxdict)]
        return "{" + ", ".join(pieces + (["..."] if len(x) > self.maxdict else [])) + "}"


_REPR = _BoundedRepr()


def clip(text: str, limit: int = QUOTE_CHARS, unit: str = "characters") -> str:
    """``text`` itself, or its first ``limit`` characters, an ellipsis and how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} {unit})"


def quote(value: object) -> str:
    """``repr(value)`` for a message: at most :data:`QUOTE_CHARS` characters of it, then an ellipsis and
    how long the value is (characters of a string, items of a list or mapping)."""
    if isinstance(value, str):
        return repr(value) if len(value) <= QUOTE_CHARS else f"{value[:QUOTE_CHARS]!r}... ({len(value)} characters)"
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 (a value whose repr fails still gets a message)
        text = f"<{type(value).__name__}>"
    if not isinstance(value, (list, tuple, dict, set, frozenset)):
        return clip(text)
    shown = text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "..."
    # reprlib writes '...' for what it leaves out
    return shown if "..." not in shown else f"{shown} ({type(value).__name__} of {len(value)} items)"


class UserError(Exception):
    """A problem with the user's input. The CLI prints ``str(err)`` on one line and exits with code 2."""

    def __init__(self, message: object = ""):
        super().__init__(clip(" ".join(str(message).splitlines()), MESSAGE_CHARS))


class ConfigError(UserError):
    """A config key has a value the run cannot use."""

    def __init__(self, key: str, value: object, expected: str):
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"config error: {clip(str(key))} = {quote(value)}: expected {expected}")
