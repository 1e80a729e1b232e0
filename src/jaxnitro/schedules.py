"""Schedule factories for `schedules()` / `Nitro(schedules=...)`.

Each returns a factory `f(total_steps) -> (step -> value)`. For `opt.learning_rate` keys the
value multiplies the group's `learning_rate`, so these peak at 1.
"""

from jaxnitro._src.optim.schedules import constant, linear, one_cycle, step_decay, warmup_cosine

__all__ = ["constant", "linear", "one_cycle", "step_decay", "warmup_cosine"]
