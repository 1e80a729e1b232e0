"""A real Jupyter kernel (nbclient + ipykernel) runs a notebook: the run's display is one
output updated in place, `jn.inspect`, the compile report and the history render as HTML,
and the curves show as an inline image."""

from __future__ import annotations

import pytest
from helpers.paths import SRC, TESTS

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")


class _Recording(nbclient.NotebookClient):
    """Records every message type the kernel sent per cell (the in-place updates among
    them: `update_display_data` changes an output, it adds none)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: dict[int, list[str]] = {}

    def process_message(self, msg, cell, cell_index):
        self.seen.setdefault(cell_index, []).append(msg["msg_type"])
        return super().process_message(msg, cell, cell_index)


@pytest.mark.slow
def test_a_notebook_shows_a_live_display_html_tables_and_the_curves(tmp_path):
    cells = [
        f"""
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path[:0] = [{str(SRC)!r}, {str(TESTS)!r}]
from conftest import Tiny
os.environ.pop("JAXNITRO_NO_PLOT", None)  # conftest turns drawing off
import jaxnitro as jn
n = jn.Nitro(Tiny(n_train=640, max_epochs=2), run_dir={str(tmp_path / "run")!r})
""",
        "result = jn.train(n)",
        "jn.inspect(n, show=False)",
        "jn.compile_report(n)",
        "jn.history(n)",
        "jn.plot(n)",
        "metrics = jn.validate(n)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = _Recording(nb, timeout=300, kernel_name="python3")
    client.execute(cwd=str(tmp_path))
    outs = [c.outputs for c in nb.cells]

    # jn.train: one display, updated in place; its final state keeps the summary table
    displays = [o for o in outs[1] if o.output_type == "display_data"]
    html_displays = [o for o in displays if "text/html" in o.data]
    assert len(html_displays) == 1, outs[1]
    assert client.seen[1].count("update_display_data") >= 3, client.seen[1]
    final = html_displays[0].data["text/html"]
    assert "<table>" in final and "epoch 1/2" in final and "epoch 2/2" in final
    # Nitro(show_curves=...) defaults on in a kernel: the curves inline when train returns
    assert any("image/png" in o.data for o in displays), outs[1]

    def result_html(cell: int) -> str:
        res = [o for o in outs[cell] if o.output_type == "execute_result"]
        assert res and "text/html" in res[0].data, outs[cell]
        return res[0].data["text/html"]

    assert "<table>" in result_html(2) and "binding" in result_html(2)
    assert "<table>" in result_html(3) and "<td>train</td>" in result_html(3)
    hist = result_html(4)
    assert "<table>" in hist and "train_loss" in hist and "<b>" in hist  # the best row
    res = [o for o in outs[5] if o.output_type == "execute_result"]
    assert res and "image/png" in res[0].data, outs[5]
    # a later cell's work shows in that cell, not as an update of the training's output
    later = [o for o in outs[6] if o.output_type == "display_data" and "text/html" in o.data]
    assert len(later) == 1, outs[6]
    assert "epoch 1/2" not in later[0].data["text/html"]
    assert "<table>" in html_displays[0].data["text/html"]  # train's output is as it ended
