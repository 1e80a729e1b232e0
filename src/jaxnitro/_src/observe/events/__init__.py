"""What happens during a run, as it happens: phases (and their monitors), step events (`jn.every`),
and the signals that stop a run (Ctrl-C, SIGTERM → `jn.Preempted`)."""

from jaxnitro._src.observe.events.phases import PhaseTracker, on_phase, set_phase
from jaxnitro._src.observe.events.signals import (
    Preempted,
    StopControl,
    graceful_stop,
    terminate_during_setup,
)
from jaxnitro._src.observe.events.steps import StepRecord, every

__all__ = [
    "PhaseTracker",
    "Preempted",
    "StepRecord",
    "StopControl",
    "every",
    "graceful_stop",
    "on_phase",
    "set_phase",
    "terminate_during_setup",
]
