"""The attack harness (tests/attacks.py) runs its body in each place: a
harmless body returns what it computed in the handler, and loads cleanly
from a library's init and a module's constructor."""
from __future__ import annotations

import pytest

import attacks
from conftest import SMALL, Device


@pytest.fixture(scope="module")
def dev():
    d = Device(*SMALL)
    yield d
    d.stop()


@attacks.needs_cc
@pytest.mark.parametrize("place", attacks.PLACES)
def test_a_harmless_body_runs_in_each_place(dev, tmp_path, place):
    got = attacks.launch(dev.path, tmp_path, place, "return (long)(ATTACK_ARG * 3 + sc(39, 0, 0, 0, 0, 0, 0) * 0);",
                         arg=14)
    if place == "ctor":  # the fake module is no TVM module: refused after its constructor ran, not by the filter
        assert got.status == "ERR_LOAD" and "dynamic loading failed" in got.error, got
        return
    assert got.status == "", got
    assert got.value == (42 if place == "handler" else None)


@attacks.needs_cc
def test_a_body_that_crashes_the_probe_is_refused_at_load(dev, tmp_path):
    got = attacks.launch(dev.path, tmp_path, "init", "*(volatile int *)0 = 1; return 0;")
    assert got.status == "ERR_LOAD", got
