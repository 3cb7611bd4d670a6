"""The one idiom of dlm's extension points: a registry of named items of one kind.

Noise schedules, optimizers, remasking strategies, training loggers, sampler strategies and corpus
formats each keep one `Registry` and offer `register_*` (refusing a taken name unless
`replace=True`), `unregister_*` and the registered names, in registration order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Items of one `kind` ("optimizer", "noise schedule", ...) by name, in registration order."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def add(self, name: str, item: T, *, replace: bool = False) -> T:
        """Register `item` as `name`."""

        if not name or name != name.strip():
            raise ValueError(f"{self.kind} name {name!r} is empty or has surrounding spaces")
        if name in self._items and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered; pass replace=True to override it")
        self._items[name] = item
        return item

    def remove(self, name: str) -> None:
        """Forget `name` (a plugin unloading, a test cleaning up); an unknown name is ignored."""

        self._items.pop(name, None)

    def get(self, name: str) -> T | None:
        return self._items.get(name)

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def items(self) -> Iterator[tuple[str, T]]:
        yield from self._items.items()

    def copy(self) -> Registry[T]:
        """An independent registry with the same items (a test that registers into a private copy)."""

        twin: Registry[T] = Registry(self.kind)
        twin._items = dict(self._items)
        return twin

    def __contains__(self, name: object) -> bool:
        return name in self._items
