"""What every part of one manager shares: its identity, settings, counters and lifecycle.

The settings are exposed on the manager as plain attributes (``manager.max_hold_s = 2.0`` works
as it always did, through :class:`Tunables`); the parts read the same object, so a change
applies from their next step on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from ._admin import TopicName
from ._errors import ConfigurationError
from ._types import ManagerStats

__all__ = ["Context", "Settings", "Tunables"]

T = TypeVar("T")


def _seconds(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(slots=True)
class Settings:
    idle_release_s: float
    relay_idle_release_s: float | None
    max_hold_s: float
    acquire_timeout_s: float
    takeover_after_s: float | None
    write_timeout_s: float
    read_timeout_s: float
    open_timeout_s: float
    max_record_bytes: int
    max_writes_per_record: int
    max_writes_per_batch: int
    snapshot_every_records: int | None
    snapshot_every_bytes: int | None

    def __post_init__(self) -> None:
        for name in ("idle_release_s", "relay_idle_release_s"):
            value = getattr(self, name)
            if value is None and name == "relay_idle_release_s":
                continue  # idle_release_s applies
            if not (_seconds(value) and math.isfinite(value) and value >= 0):
                raise ConfigurationError(
                    f"{name} must be a finite number of seconds >= 0, not {value!r}"
                )
        if min(self.max_writes_per_record, self.max_writes_per_batch) < 1:
            raise ConfigurationError("max_writes_per_* must be >= 1")
        if self.max_record_bytes < 1024:
            raise ConfigurationError("max_record_bytes must be >= 1024")


@dataclass(eq=False, slots=True)
class Context:
    """Handed to every part of one manager. The parts never hold the manager itself, so a
    manager dropped without ``aclose()`` is collected (and warns) whatever its tasks hold."""

    topic: TopicName
    writer_id: str
    settings: Settings
    stats: ManagerStats
    closed: bool = False  # set once aclose() starts
    # The labels of this manager's metrics.
    attributes: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.attributes = {"topic": str(self.topic), "writer_id": self.writer_id}


class Setting(Generic[T]):
    """An attribute stored in the owner's :class:`Settings` (``owner._settings``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> Setting[T]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...

    def __get__(self, obj: object | None, objtype: type | None = None) -> Setting[T] | T:
        if obj is None:
            return self
        value: T = getattr(self._settings_of(obj), self._name)
        return value

    def __set__(self, obj: object, value: T) -> None:
        setattr(self._settings_of(obj), self._name, value)

    @staticmethod
    def _settings_of(obj: Any) -> Settings:
        settings: Settings = obj._settings
        return settings


class Tunables:
    """The manager's settings as attributes, readable and writable at any time."""

    _settings: Settings
    idle_release_s: Setting[float] = Setting()
    relay_idle_release_s: Setting[float | None] = Setting()
    max_hold_s: Setting[float] = Setting()
    acquire_timeout_s: Setting[float] = Setting()
    takeover_after_s: Setting[float | None] = Setting()
    write_timeout_s: Setting[float] = Setting()
    read_timeout_s: Setting[float] = Setting()
    open_timeout_s: Setting[float] = Setting()
    max_record_bytes: Setting[int] = Setting()
    max_writes_per_record: Setting[int] = Setting()
    max_writes_per_batch: Setting[int] = Setting()
    snapshot_every_records: Setting[int | None] = Setting()
    snapshot_every_bytes: Setting[int | None] = Setting()
