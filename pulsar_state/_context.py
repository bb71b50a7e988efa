"""What every part of one manager shares: its identity, settings, counters and lifecycle.

The settings are exposed on the manager as plain attributes (``manager.max_hold_s = 2.0`` works
as it always did, through :class:`Tunables`); the parts read the same object, so a change
applies from their next step on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
        for name in _RULES:
            check_setting(name, getattr(self, name))


def _number(value: object) -> float | None:
    return float(value) if _seconds(value) else None  # type: ignore[arg-type]


def _finite_seconds(value: object) -> bool:
    number = _number(value)
    return number is not None and math.isfinite(number) and number >= 0


def _any_seconds(value: object) -> bool:  # inf allowed (never); NaN is not >= 0
    number = _number(value)
    return number is not None and number >= 0


def _timeout(value: object) -> bool:  # inf: no limit
    number = _number(value)
    return number is not None and number > 0


def _count(least: int) -> Callable[[object], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= least


# Each setting: whether a value is allowed, what it must be (the error says), and whether
# None is allowed. Checked at construction and whenever one is set on a running manager.
_RULES: dict[str, tuple[Callable[[object], bool], str, bool]] = {
    "idle_release_s": (_finite_seconds, "a finite number of seconds >= 0", False),
    "relay_idle_release_s": (_finite_seconds, "a finite number of seconds >= 0", True),
    "max_hold_s": (_finite_seconds, "a finite number of seconds >= 0", False),
    "acquire_timeout_s": (_timeout, "a number of seconds > 0", False),
    "takeover_after_s": (_any_seconds, "a number of seconds >= 0", True),
    "write_timeout_s": (_timeout, "a number of seconds > 0", False),
    "read_timeout_s": (_timeout, "a number of seconds > 0", False),
    "open_timeout_s": (_timeout, "a number of seconds > 0", False),
    "max_record_bytes": (_count(1024), "an int >= 1024", False),
    "max_writes_per_record": (_count(1), "an int >= 1", False),
    "max_writes_per_batch": (_count(1), "an int >= 1", False),
    "snapshot_every_records": (_count(1), "an int >= 1", True),
    "snapshot_every_bytes": (_count(1), "an int >= 1", True),
}


def check_count(name: str, value: object, least: int) -> None:
    """ConfigurationError unless ``value`` is an int (not a bool) of at least ``least``."""
    if not _count(least)(value):
        raise ConfigurationError(f"{name} must be an int >= {least}, not {value!r}")


def check_setting(name: str, value: object) -> None:
    """ConfigurationError unless ``value`` is allowed for the setting ``name`` (a timeout of
    NaN or -1, or a string, slipped through and failed later, far from its cause)."""
    allowed, must_be, none_allowed = _RULES[name]
    if value is None and none_allowed:
        return
    if not allowed(value):
        none = " or None" if none_allowed else ""
        raise ConfigurationError(f"{name} must be {must_be}{none}, not {value!r}")


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
        check_setting(self._name, value)
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
