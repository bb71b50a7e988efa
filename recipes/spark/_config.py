"""SharedConfig: a typed config (a dataclass) kept in a map, re-read by streaming jobs per batch."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pulsar_state import ConfigurationError
from recipes import SyncPulsarMap

from ._specs import MapSpec, get_map

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["SharedConfig"]

C = TypeVar("C")


_SIMPLE_TYPES: tuple[type, ...] = (bool, int, float, str)


class SharedConfig(Generic[C]):
    """A typed configuration, an instance of a dataclass, kept in a PulsarMap.

    Each field is one key (``prefix + field name``) holding a JSON value; a field with no key
    in the map takes the dataclass's default (a field with no default must be set before it
    is read). Keys of the map that are not fields are ignored, so a newer job may add fields.
    Fields annotated ``bool``, ``int``, ``float`` or ``str`` are type-checked when written
    and read; the dataclass's own ``__post_init__`` validation runs on every change, on the
    up-to-date config, before anything is written.

    ::

        @dataclass(frozen=True)
        class JobConfig:
            delay_threshold_min: int = 15

        config = SharedConfig(MapSpec(url, "job-config"), JobConfig)
        config.read().delay_threshold_min                      # batch job: read at start
        query = df.writeStream.foreachBatch(config.foreach_batch(process)).start()  # streaming
        config.update(delay_threshold_min=60)                  # any process, any time

    A SharedConfig pickles (it holds the spec, the type and the prefix).
    """

    def __init__(
        self,
        spec: MapSpec,
        config_type: type[C],
        *,
        prefix: str = "",
        timeout: float | None = None,
    ) -> None:
        if not (isinstance(config_type, type) and dataclasses.is_dataclass(config_type)):
            raise ConfigurationError("config_type must be a dataclass type")
        self.spec = spec
        self.config_type = config_type
        self.prefix = prefix
        self.timeout = timeout
        self._fields = {f.name: f for f in dataclasses.fields(config_type) if f.init}
        self._keys = {prefix + name: name for name in self._fields}
        self._types = _simple_field_types(config_type)

    @property
    def map(self) -> SyncPulsarMap[Any, Any]:
        """This process's cached map holding the config."""
        return get_map(self.spec, timeout=self.timeout)

    def read(self, *, latest: bool = True, timeout: float | None = None) -> C:
        """The current config, from one consistent state of the map.

        ``latest=True`` (default) is linearizable: it reflects every change that completed
        before this call, in any process. ``latest=False`` reads this process's replica only
        (no I/O; it may lag other processes).
        """
        values: dict[str, Any] = {}
        keys = self._keys

        def collect(key: Any, value: Any) -> None:
            values[keys[key]] = value

        self.map.scan(
            lambda key: key in keys,
            collect,
            latest=latest,
            timeout=self._timeout(timeout),
        )
        return self._build(values)

    def update(
        self,
        changes: Mapping[str, Any] | None = None,
        /,
        *,
        timeout: float | None = None,
        **fields: Any,
    ) -> C:
        """Change some fields in ONE atomic write, validated on the up-to-date config:
        ``update(batch_size=500)``, or ``update({"timeout": 60})`` (a mapping names any field,
        one called ``timeout`` too; the keyword ``timeout`` is the call's own).

        Unknown field names and values of the wrong type raise :class:`ConfigurationError`
        before anything is written; so does the dataclass's own validation (its exception
        is raised as is). Returns the config as this process sees it right after the write
        (so it includes the change).
        """
        merged = {**(changes or {}), **fields}
        if not merged and timeout is not None and "timeout" in self._fields:
            # update(timeout=60) meant for the field would otherwise change nothing.
            raise ConfigurationError(
                "update(timeout=...) is the call's timeout and changes nothing: the field "
                'named timeout is changed as update({"timeout": ...})'
            )
        return self._update(merged, timeout)

    def _update(self, changes: dict[str, Any], timeout: float | None) -> C:
        unknown = sorted(set(changes) - set(self._fields))
        if unknown:
            raise ConfigurationError(
                f"{self.config_type.__name__} has no field {', '.join(unknown)}"
            )
        for name, value in changes.items():
            self._check_type(name, value)
        keys = self._keys
        prefix = self.prefix

        def fn(view: Mapping[Any, Any]) -> Mapping[Any, Any]:
            current = {keys[k]: view[k] for k in keys if k in view}
            self._build({**current, **changes})  # validate the result before writing
            return {prefix + name: value for name, value in changes.items()}

        self.map.transact(fn, timeout=self._timeout(timeout))
        return self.read(latest=False)

    def write(self, config: C, *, timeout: float | None = None) -> C:
        """Store every field of ``config`` in ONE atomic write (defaults included)."""
        if not isinstance(config, self.config_type):
            raise ConfigurationError(f"expected a {self.config_type.__name__}")
        values = {name: getattr(config, name) for name in self._fields}
        return self._update(values, timeout)

    def foreach_batch(
        self, fn: Callable[[DataFrame, int, C], object]
    ) -> Callable[[DataFrame, int], None]:
        """Wrap ``fn(batch_df, batch_id, config)`` for ``writeStream.foreachBatch``.

        At the start of each micro-batch the config is re-read with a linearizable read
        (``read(latest=True)``), so a change that completed before a batch starts is in force
        for that whole batch and every later one, and never changes in the middle of a
        batch. Spark runs foreachBatch functions on the driver, so this is one read per batch.
        """

        def run(batch: DataFrame, batch_id: int) -> None:
            fn(batch, batch_id, self.read(latest=True))

        return run

    # -------------------------------------------------------------- helpers

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _check_type(self, name: str, value: Any) -> None:
        expected = self._types.get(name)
        if expected is None:
            return
        ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ConfigurationError(
                f"{self.config_type.__name__}.{name} is {expected.__name__}, "
                f"not {type(value).__name__} ({value!r})"
            )

    def _build(self, values: Mapping[str, Any]) -> C:
        kwargs: dict[str, Any] = {}
        for name, value in values.items():
            self._check_type(name, value)
            kwargs[name] = float(value) if self._types.get(name) is float else value
        missing = [
            name
            for name, f in self._fields.items()
            if name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ConfigurationError(
                f"{self.config_type.__name__} field(s) {', '.join(missing)} have no default and "
                f"are not set in {self.spec.topic}"
            )
        return self.config_type(**kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "config_type": self.config_type,
            "prefix": self.prefix,
            "timeout": self.timeout,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["spec"], state["config_type"], prefix=state["prefix"], timeout=state["timeout"]
        )

    def __repr__(self) -> str:
        return f"SharedConfig({self.config_type.__name__}, topic={self.spec.topic!r})"


def _simple_field_types(config_type: type[Any]) -> dict[str, type]:
    try:
        hints = typing.get_type_hints(config_type)
    except Exception:  # unresolvable annotations: no type checks, the dataclass validates
        return {}
    return {name: hint for name, hint in hints.items() if hint in _SIMPLE_TYPES}
