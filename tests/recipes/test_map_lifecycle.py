"""A PulsarMap dropped without aclose() warns through its manager (ResourceWarning)."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from pulsar_state import SharedStateManager
from recipes import PulsarMap
from tests.recipes.helpers import new_map


def forget(holder: list[PulsarMap[Any, Any]]) -> None:
    holder.clear()
    gc.collect()


async def test_an_open_map_dropped_without_aclose_warns(
    service_url: str, admin_url: str, topic: str
) -> None:
    holder = [new_map(service_url, topic, admin_url)]
    await holder[0].open()
    await holder[0].put("k", 1)
    parts = dict(vars(holder[0].manager))
    with pytest.warns(ResourceWarning, match="unclosed SharedStateManager"):
        forget(holder)
    # Close what the dropped map left running, from a copy of its manager's attributes.
    shell: SharedStateManager[Any, Any] = SharedStateManager.__new__(SharedStateManager)
    vars(shell).update(parts)
    await shell.aclose()
