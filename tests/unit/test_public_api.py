"""The public surface: what ``pulsar_state`` exports reports itself as ``pulsar_state.X``."""

from __future__ import annotations

import pickle

import pytest

import pulsar_state

PUBLIC = [
    name
    for name in pulsar_state.__all__
    # Constants (e.g. STATE_MACHINE_OPTIONS) have no module of their own.
    if not name.startswith("__") and hasattr(getattr(pulsar_state, name), "__module__")
]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_objects_report_the_public_module(name: str) -> None:
    assert getattr(pulsar_state, name).__module__ == "pulsar_state"


def test_an_error_names_the_public_module_and_pickles() -> None:
    error = pulsar_state.ClosedError("gone")
    assert repr(type(error)) == "<class 'pulsar_state.ClosedError'>"
    # Pickling finds a class by module and name: the public path must resolve.
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is pulsar_state.ClosedError
    assert str(copy) == "gone"


def test_no_private_leftovers_in_the_namespace() -> None:
    assert "_name" not in vars(pulsar_state)
