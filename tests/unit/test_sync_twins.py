"""Every blocking twin offers what its async original does, with the same parameters: a
method added to one and forgotten in the other fails here (no broker needed)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import pulsar_state
import recipes

# What a twin leaves out on purpose, and why.
_ASYNC_ONLY = {
    # close() is the twin's aclose(); the async object underneath is its async_* property.
    "aclose",
    "manager",
    # Callbacks run on the event loop's thread: register them on the async object.
    "add_halt_listener",
    "add_listener",
    "add_state_replaced_listener",
    "subscribe",
    "on_close",
    # A stream's producer side, used by the recipe that feeds it.
    "fail",
    "push",
    # The class's fixed options (a constant of the recipe, not of an instance).
    "reserved_options",
    # The election's and membership's Ownership underneath.
    "ownership",
}
# SharedStateManager's configuration, read from the async manager (``twin.manager``).
_CONFIGURATION = {
    "acquire_timeout_s",
    "idle_release_s",
    "max_hold_s",
    "max_record_bytes",
    "max_writes_per_batch",
    "max_writes_per_record",
    "open_timeout_s",
    "read_timeout_s",
    "relay_idle_release_s",
    "snapshot_every_bytes",
    "snapshot_every_records",
    "takeover_after_s",
    "write_timeout_s",
}


def _twins() -> list[tuple[type, type]]:
    pairs = []
    for module in (pulsar_state, recipes):
        for name in module.__all__:
            if name.startswith("Sync") and name[4:] in module.__all__:
                pairs.append((getattr(module, name[4:]), getattr(module, name)))
    return pairs


def test_every_public_class_with_a_blocking_twin_is_checked() -> None:
    names = {original.__name__ for original, _twin in _twins()}
    assert {"SharedStateManager", "PulsarMap", "Ownership", "Counter", "MapWatch"} <= names


@pytest.mark.parametrize(
    ("original", "twin"), _twins(), ids=[twin.__name__ for _original, twin in _twins()]
)
def test_a_blocking_twin_offers_every_public_member_with_the_same_parameters(
    original: type, twin: type
) -> None:
    missing, differing = [], []
    for name, member in inspect.getmembers(original):
        if name.startswith("_") or name in _ASYNC_ONLY or name in _CONFIGURATION:
            continue
        if not hasattr(twin, name):
            missing.append(name)
            continue
        if isinstance(inspect.getattr_static(original, name), property) or not callable(member):
            continue
        ours = _parameters(member)
        theirs = _parameters(getattr(twin, name))
        # The twin may add parameters (a timeout for a call the async one leaves unbounded).
        if any(parameter not in theirs for parameter in ours):
            differing.append(f"{name}: {ours} vs {theirs}")
    assert not missing, f"{twin.__name__} lacks {missing}"
    assert not differing, f"{twin.__name__} differs: {differing}"


def _parameters(function: Any) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def test_a_facade_is_closed_once_what_it_wraps_is_closed() -> None:
    class Closable:
        closed = False
        open_timeout_s = read_timeout_s = write_timeout_s = 1.0

    wrapped = Closable()
    facade: Any = pulsar_state.SyncFacade(wrapped, wrapped, portal=None)  # type: ignore[type-var]
    try:
        assert not facade.closed
        wrapped.closed = True  # closed through the portal, or by the exit hook
        assert facade.closed
    finally:
        facade.portal.stop()
