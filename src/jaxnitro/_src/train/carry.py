"""The train state as an epoch's program takes it, from call to call.

A train program takes the state's leaves as two lists (`steps/leaf_layout.py`): those a call
changes, donated and replaced by the call's outputs, and those it keeps. Where the program
keeps the step counter, the host counts the steps; the counter is brought up to date where
the state handed over is first read (one compiled addition, `Layout.merge`). `StateCarry`
holds both lists for the epoch loop, runs each call on them, and gives the state's leaves,
in order, wherever the loop hands them over (`handed`: merged only where they are read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxnitro._src.steps.leaf_layout import Unmerged

if TYPE_CHECKING:
    from jaxnitro._src.steps.leaf_layout import Layout


class StateCarry:
    """The state's leaves as the loop's programs take them, and the steps they ran.

    Example:
        >>> carry = StateCarry(n.state_leaves, n.step)
        >>> out = carry.run(fn, train_layout(prog), 1, batch, extras, hyper)
        >>> n.take(leaves=carry.handed(), ...)
    """

    def __init__(self, leaves: list, step: int):
        self.moving = list(leaves)  # what the next call donates (all leaves, until a layout)
        self.kept: list = []  # what it keeps (takes, or not where idle: `Layout.taken`)
        self._taken: list = []  # what of `kept` a call takes
        self.layout: Layout | None = None
        self.step = step  # the steps run, as the host counts them
        self._counted = step  # the count the kept step counter is right at (the start)

    def run(self, fn: Any, layout: Layout, steps: int, *inputs: Any) -> Any:
        """One call of `fn` (a train program of `layout`, `steps` steps per call) on the
        state: its new leaves replace the changed ones. Returns its outputs."""
        if layout is not self.layout and layout != self.layout:  # the first call's program
            leaves = self.leaves()
            self.layout, self._counted = layout, self.step
            self.moving, self.kept = layout.split(leaves)
            self._taken = layout.taken(self.kept)
        self.moving[:], out = fn(self.moving, self._taken, *inputs)
        self.step += steps
        return out

    def leaves(self) -> list:
        """The state's leaves, in order; a kept step counter is first advanced by the steps
        run since it was last right (`Layout.merge`), and kept so."""
        layout = self.layout
        if layout is None:
            return list(self.moving)
        leaves = layout.merge(self.moving, self.kept, self.step - self._counted)
        if layout.uncounted:
            self.kept[layout.fixed_at.index(layout.step_at)] = leaves[layout.step_at]
            self._taken = layout.taken(self.kept)
            self._counted = self.step
        return leaves

    def handed(self) -> list | Unmerged:
        """The state's leaves for the handle: merged when first read, where a kept step
        counter is behind (`Unmerged`: no device work until then); else `leaves()`."""
        layout = self.layout
        if layout is None or not layout.uncounted or self.step == self._counted:
            return self.leaves()
        return Unmerged(layout, self.moving, self.kept, self.step - self._counted)
