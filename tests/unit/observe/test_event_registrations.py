"""`jn.every` and `jn.on_phase` return a remover; a process-wide registration of the same
definition (a notebook cell run again) replaces the earlier one (issue 42)."""

from __future__ import annotations

import jaxnitro as jn
from jaxnitro._src.observe.events.phases import PhaseTracker
from jaxnitro._src.observe.events.steps import has_callbacks


def _cell(seen: list) -> tuple:
    """What a notebook cell does, run once per call: two registrations without a handle."""
    every = jn.every(10, lambda r: seen.append(r.step))
    phase = jn.on_phase(lambda phase, step, epoch, info: seen.append(phase))
    return every, phase


def test_registrations_without_a_handle_do_not_stack_and_can_be_removed():
    seen: list = []
    _cell(seen)
    remove_every, remove_phase = _cell(seen)  # the cell run again
    PhaseTracker().enter("Training", step=0, epoch=0, info={})
    assert seen == ["Training"]  # one monitor, not two
    assert has_callbacks([])
    remove_every()
    remove_phase()
    remove_every()  # twice: nothing more happens
    assert not has_callbacks([])
    PhaseTracker().enter("Training", step=0, epoch=0, info={})
    assert seen == ["Training"]
