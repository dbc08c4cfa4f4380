"""One registry style for everything pluggable (methods, rewards, caches): a table from name to entry.

A plug-in is one module with its config dataclass; its entry (an Estimator class, a reward factory, a
cache's config class and installer) is registered under its name, directly or as a decorator. An entry
given as ``"module:attr"`` is imported on first use, so optional extras cost nothing until chosen; the
``modules`` of a registry, whose import registers plug-ins, are imported on its first lookup; given as
``{name: module}``, a lookup of one name imports only that name's module (a run imports only its own
method's code). An unknown name is a ConfigError naming the config key, the name and the known names.
"""
from __future__ import annotations

import importlib
from typing import Any

from .errors import ConfigError


class Registry(dict):
    """``{name: entry}`` for the config key ``key`` (e.g. ``method.name``); read it with :meth:`resolve`."""

    def __init__(self, key: str, entries: dict[str, Any] | None = None,
                 modules: tuple[str, ...] | dict[str, str] = ()):
        super().__init__()
        self.key = key
        self.modules = modules
        self._loaded = not modules
        for name, entry in (entries or {}).items():
            self.register(name, entry)

    def register(self, name: str, entry: Any = None) -> Any:
        """Register ``entry`` under ``name``; without ``entry``, a decorator that registers what it decorates.
        A name already taken by another entry is refused, so one plug-in never silently replaces another."""
        def add(obj: Any) -> Any:
            if dict.get(self, name, obj) is not obj:
                raise ValueError(f"{self.key}: {name!r} is already registered ({self[name]!r})")
            self[name] = obj
            return obj

        return add if entry is None else add(entry)

    def load(self) -> None:
        """Import the modules whose import registers entries (once)."""
        if not self._loaded:
            for module in dict.fromkeys(self.modules.values() if isinstance(self.modules, dict) else self.modules):
                importlib.import_module(module)
            self._loaded = True  # only once every module imported: a failed import is raised again

    def names(self) -> list[str]:
        self.load()
        return sorted(self)

    def resolve(self, name: str) -> Any:
        """The entry registered as ``name`` (a ``"module:attr"`` entry imported now), or a ConfigError."""
        if isinstance(self.modules, dict) and isinstance(name, str) and name in self.modules and name not in self:
            importlib.import_module(self.modules[name])  # this name's module only
        if not isinstance(name, str) or name not in self:
            self.load()  # every module: the name may be registered elsewhere; the error lists them all
        if not isinstance(name, str) or name not in self:
            raise ConfigError(self.key, name, f"one of {sorted(self)}")
        entry = self[name]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module), attr)
            self[name] = entry
        return entry


__all__ = ["Registry"]
