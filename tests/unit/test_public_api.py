"""The public surface: what ``pulsar_state`` exports reports itself as ``pulsar_state.X``."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

import pulsar_state
import recipes

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


def test_only_one_module_imports_pulsar() -> None:
    # The client's behaviour (exceptions, logger, close at exit) is handled in one place; a
    # second client elsewhere (the CLI had one, with a Python logger: an abort at exit) escapes it.
    repo = Path(pulsar_state.__file__).resolve().parents[1]
    importers = []
    for path in sorted(
        [*repo.joinpath("pulsar_state").rglob("*.py"), *repo.joinpath("recipes").rglob("*.py")]
    ):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            if any(name == "pulsar" or name.startswith("pulsar.") for name in names):
                importers.append(str(path.relative_to(repo)))
    assert sorted(set(importers)) == ["pulsar_state/_pulsar.py"]


RECIPES_PUBLIC = [name for name in recipes.__all__ if hasattr(getattr(recipes, name), "__module__")]


@pytest.mark.parametrize("name", RECIPES_PUBLIC)
def test_recipes_objects_report_the_public_package(name: str) -> None:
    assert getattr(recipes, name).__module__ == "recipes"


def test_a_recipes_value_pickles_through_the_public_path() -> None:
    version = pickle.loads(pickle.dumps(recipes.MapVersion.of(7, 3)))
    assert type(version) is recipes.MapVersion
    assert (version.position, version.index) == (7, 3)
    assert repr(recipes.PulsarMap) == "<class 'recipes.PulsarMap'>"
