"""Name-to-builder registries whose errors list the valid names."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Registry", "RegistryError"]

T = TypeVar("T")


class RegistryError(KeyError):
    """An unknown name was looked up; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError quotes its argument; show the message as written
        return str(self.args[0])


class Registry(Generic[T]):
    """Maps names to builders (models, datasets, optimizers, schedules, modes)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        """Decorator registering an object under one or more names."""

        def deco(obj: T) -> T:
            for name in names:
                if name in self._items:
                    raise ValueError(f"{self.kind} {name!r} is registered twice")
                self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise RegistryError(
                f"unknown {self.kind} {name!r}; valid {self.kind}s: {', '.join(self._items)}"
            ) from None

    def names(self) -> list[str]:
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)
