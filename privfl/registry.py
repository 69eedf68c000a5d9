"""One small registry class for methods, models, model groups, datasets, partitions, kinds, attacks, defenses.

After timm's ``register_model`` / ``create_model`` / ``list_models``, with three changes: registering a
name twice raises (a plugin must not silently shadow ``fedre``), an unknown name raises
:class:`~privfl.errors.UnknownNameError` listing what is accepted, and a registry of built-ins names
the package(s) its entries live in (``discover=``): on first lookup it imports every module there, so
what a registry holds never depends on which module a caller happened to import first. A built-in
entry is therefore one file in that package with its ``@REGISTRY.register(...)`` line; a user's entry
is registered by the same call from the user's own code.
"""

from __future__ import annotations

import fnmatch
import importlib
import pkgutil
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar, overload

from privfl.errors import UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects (classes or factories) of one kind."""

    def __init__(self, kind: str, discover: Sequence[str] = (), validate: Callable[[str, T], None] | None = None):
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._discover = tuple(discover)
        self._discovered = not self._discover
        self._validate = validate  # raises (TypeError) for an entry that breaks the registry's contract

    def _load_builtins(self) -> None:
        """Import every module of the ``discover`` packages once (their decorators register)."""
        if self._discovered:
            return
        self._discovered = True  # before importing: the modules register into this registry
        for package_name in self._discover:
            package = importlib.import_module(package_name)
            for info in pkgutil.iter_modules(package.__path__):
                if not info.name.startswith("_"):
                    importlib.import_module(f"{package_name}.{info.name}")

    @overload
    def register(self, name: str) -> Callable[[T], T]: ...
    @overload
    def register(self, name: str, obj: T) -> T: ...
    def register(self, name: str, obj: T | None = None) -> Callable[[T], T] | T:
        """Register ``obj`` under ``name``; usable as ``@registry.register("name")``."""

        def add(target: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            if self._validate is not None:
                self._validate(name, target)
            self._entries[name] = target
            return target

        return add(obj) if obj is not None else add

    def unregister(self, name: str) -> T:
        """Remove and return an entry (for tests that register throw-away plug-ins); unknown names raise."""
        self._load_builtins()
        if name not in self._entries:
            raise UnknownNameError(self.kind, name, self._entries)
        return self._entries.pop(name)

    def get(self, name: str) -> T:
        self._load_builtins()
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(self.kind, name, self._entries) from None

    def names(self, pattern: str = "*") -> list[str]:
        self._load_builtins()
        return sorted(n for n in self._entries if fnmatch.fnmatch(n, pattern))

    def __contains__(self, name: object) -> bool:
        self._load_builtins()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        self._load_builtins()
        return len(self._entries)
