"""The manager's settings: a bad value is refused where it is given, at construction or when
set on a running manager, not when it is first used (no broker)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pulsar_state import ConfigurationError, SharedStateManager


def manager(**options: Any) -> SharedStateManager[dict[str, Any], Any]:
    return SharedStateManager(
        "pulsar://127.0.0.1:1", "t", initial_state=dict, apply=lambda s, o: s, **options
    )


BAD = [
    # Before: each was accepted. A NaN acquire_timeout_s never stopped an attempt at the
    # writer; a negative timeout failed every call at once; a string failed deep inside.
    ("acquire_timeout_s", math.nan),
    ("acquire_timeout_s", -1),
    ("acquire_timeout_s", 0),
    ("acquire_timeout_s", True),
    ("write_timeout_s", math.nan),
    ("read_timeout_s", -2.0),
    ("open_timeout_s", "30"),
    ("max_hold_s", math.nan),
    ("max_hold_s", math.inf),
    ("takeover_after_s", -1),
    ("takeover_after_s", math.nan),
    ("snapshot_every_records", 0),
    ("snapshot_every_bytes", 1.5),
    ("max_writes_per_record", 0),
    ("max_record_bytes", 100),
    ("idle_release_s", -0.1),
]


@pytest.mark.parametrize(("name", "value"), BAD)
def test_a_bad_setting_is_refused_at_construction(name: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=name):
        manager(**{name: value})


@pytest.mark.parametrize(("name", "value"), BAD)
def test_a_bad_setting_is_refused_when_set_and_the_old_one_stays(name: str, value: object) -> None:
    running = manager()
    before = getattr(running, name)
    with pytest.raises(ConfigurationError, match=name):
        setattr(running, name, value)
    assert getattr(running, name) == before


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("acquire_timeout_s", math.inf),
        ("write_timeout_s", 0.5),
        ("takeover_after_s", 0.0),
        ("takeover_after_s", None),
        ("snapshot_every_records", None),
        ("max_hold_s", 0),
        ("relay_idle_release_s", None),
    ],
)
def test_good_settings_are_kept(name: str, value: object) -> None:
    assert getattr(manager(**{name: value}), name) == value
    running = manager()
    setattr(running, name, value)
    assert getattr(running, name) == value


@pytest.mark.parametrize(
    ("name", "value"),
    [
        # Before: accepted; 0 made a streamed snapshot send empty chunks until its timeout,
        # and a whole-bytes one raise ZeroDivisionError (review 45b F2).
        ("snapshot_chunk_bytes", 0),
        ("snapshot_chunk_bytes", -5),
        ("snapshot_chunk_bytes", 1.5),
        ("snapshot_chunk_bytes", True),
        ("keep_snapshots", 1.5),
    ],
)
def test_a_bad_open_option_is_refused_at_construction(name: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=f"{name} must be an int >= 1"):
        manager(**{name: value})


def test_snapshots_of_a_trial_state_need_a_copy_of_the_state() -> None:
    # copy_state=None shares the live state with a snapshot, encoded in a thread while
    # records change it; with trial_state nothing checks that apply never mutates it, and a
    # snapshot held records past its position (applied twice on load; review 45b F1).
    from pulsar_state import DictOverlay, JsonCodec

    with pytest.raises(ConfigurationError, match="copy_state"):
        manager(trial_state=DictOverlay, copy_state=None, snapshot_codec=JsonCodec())
    manager(trial_state=DictOverlay, copy_state=None)  # no snapshots: copy_state is unused
    manager(trial_state=DictOverlay, copy_state=dict.copy, snapshot_codec=JsonCodec())
