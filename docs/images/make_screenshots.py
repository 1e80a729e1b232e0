"""Regenerate the display screenshots of docs/display.md from real runs of examples/mnist.py.

- `terminal-live.svg`, `terminal-done.svg`: `python examples/mnist.py --epochs 3` on a real
  pseudo-terminal (120 x 24), its screen read back with pyte mid-epoch and at the end, drawn
  by rich's own SVG export.
- `notebook-live.svg`, `notebook-done.svg`: the same training executed in a real Jupyter
  kernel (nbclient + ipykernel): the run's display as one of its in-place updates showed it,
  then its final state with the curves and `jn.history(n)`, the kernel's own HTML and PNG
  outputs wrapped in an SVG (no browser needed to make it; any browser shows it).

    python docs/images/make_screenshots.py        # from the repository root, about a minute
"""

from __future__ import annotations

import base64
import html
import io
import os
import re
import select
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
COLUMNS, ROWS = 120, 24
EPOCHS = 3


# ---------------------------------------------------------------- the terminal
def _pty_screens(cwd: Path) -> tuple[list, list]:
    """(the screen mid-way through epoch 2, the screen at the end) of a real run on a pty."""
    import fcntl
    import termios

    import pyte

    screen = pyte.Screen(COLUMNS, ROWS)
    stream = pyte.ByteStream(screen)
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")}
    env.update(PYTHONPATH=str(ROOT / "src"), TERM="xterm-256color", JAXNITRO_NO_PLOT="1")
    script = ROOT / "examples" / "mnist.py"
    proc = subprocess.Popen(
        [sys.executable, str(script), "--epochs", str(EPOCHS)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=cwd,
        env=env,
        close_fds=True,
    )
    os.close(slave)
    live = None
    bar = re.compile(rf"epoch 2/{EPOCHS} .*?(\d+)/(\d+)")
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            stream.feed(chunk.replace(b"\n", b"\r\n"))  # the pty's onlcr
            if live is None:
                for line in screen.display:
                    m = bar.search(line)
                    if m and 2 * int(m.group(1)) >= int(m.group(2)):
                        live = _snapshot(screen)
    finally:
        os.close(master)
        proc.wait(timeout=120)
    if proc.returncode != 0 or live is None:
        text = "\n".join(screen.display)
        raise SystemExit(f"the run failed or showed no epoch-2 bar (rc {proc.returncode}):\n{text}")
    return live, _snapshot(screen)


def _snapshot(screen) -> list:
    rows = [[screen.buffer[y][x] for x in range(screen.columns)] for y in range(screen.lines)]
    while rows and not "".join(c.data for c in rows[-1]).strip():
        rows.pop()
    return rows


def _color(name: str) -> str | None:
    if name == "default":
        return None
    return f"#{name}" if re.fullmatch(r"[0-9a-fA-F]{6}", name) else name.replace("brown", "yellow")


def _terminal_svg(rows: list, out: Path, title: str) -> None:
    from rich.console import Console
    from rich.style import Style
    from rich.text import Text

    console = Console(record=True, width=COLUMNS, file=io.StringIO(), force_terminal=True)
    for row in rows:
        text = Text(no_wrap=True, end="\n")
        for char in row:
            style = Style(color=_color(char.fg), bold=char.bold, dim=False)
            text.append(char.data, style=style)
        text.rstrip()
        console.print(text)
    console.save_svg(str(out), title=title)


# ---------------------------------------------------------------- the notebook
def _notebook_outputs(cwd: Path) -> dict:
    """The kernel's outputs for a short training: the HTML of one in-place update mid-way
    through epoch 2, the final display, the curves PNG and the history table."""
    import nbclient
    import nbformat

    class Recording(nbclient.NotebookClient):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.updates: list[str] = []

        def process_message(self, msg, cell, cell_index):
            data = msg.get("content", {}).get("data", {})
            if msg["msg_type"] == "update_display_data" and "text/html" in data:
                self.updates.append(data["text/html"])
            return super().process_message(msg, cell, cell_index)

    cells = [
        f"import sys\nsys.path[:0] = [{str(ROOT / 'src')!r}, {str(ROOT / 'examples')!r}]\n"
        f"import jaxnitro as jn\nfrom mnist import MnistMLP",
        f"n = jn.Nitro(MnistMLP(max_epochs={EPOCHS}))\nresult = jn.train(n)",
        "jn.history(n)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = Recording(nb, timeout=600, kernel_name="python3")
    client.execute(cwd=str(cwd))
    train = nb.cells[1].outputs
    html_out = [o.data["text/html"] for o in train if "text/html" in o.get("data", {})]
    pngs = [o.data["image/png"] for o in train if "image/png" in o.get("data", {})]
    mid = [u for u in client.updates if f"epoch 2/{EPOCHS}</b> <progress" in u]
    history = [o.data["text/html"] for o in nb.cells[2].outputs if "text/html" in o.get("data", {})]
    if not (html_out and pngs and mid and history):
        raise SystemExit(f"the notebook showed no live display, curves or history: {train}")
    return {
        "cells": cells,
        "live": mid[len(mid) // 2],
        "done": html_out[-1],
        "png": pngs[-1],
        "history": history[-1],
    }


_CSS = """
div.nb { font: 13px/1.45 -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif;
         background: #fff; color: #222; padding: 12px 16px; }
pre.in { font: 12px/1.4 Menlo, Consolas, monospace; background: #f5f5f5;
         border: 1px solid #e0e0e0; padding: 6px 8px; margin: 0 0 8px 0; }
table { border-collapse: collapse; margin: 4px 0 10px 0; font-size: 12px; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 10px; text-align: left; }
progress { width: 260px; vertical-align: middle; }
"""


def _notebook_svg(parts: list[tuple[str, str]], out: Path, height: int, width: int = 900) -> None:
    """An SVG page showing notebook cells: (their code, the HTML of their output)."""
    body = "".join(
        f"<pre class='in'>{html.escape(code)}</pre><div>{output}</div>" for code, output in parts
    )
    page = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
        f'<rect width="100%" height="100%" fill="#fff" stroke="#ccc"/>'
        f'<foreignObject x="0" y="0" width="{width}" height="{height}">'
        f'<div xmlns="http://www.w3.org/1999/xhtml" class="nb"><style>{_CSS}</style>{body}'
        f"</div></foreignObject></svg>"
    )
    out.write_text(_xhtml(page))


def _xhtml(text: str) -> str:
    """HTML void elements closed, so the page parses as the XML an SVG is."""
    return re.sub(r"<(img|br)([^>]*?)(?<!/)>", r"<\1\2/>", text)


def _png_size(data: bytes) -> tuple[int, int]:
    return struct.unpack(">II", data[16:24])


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        live, done = _pty_screens(Path(tmp))
        command = f"python examples/mnist.py --epochs {EPOCHS}"
        _terminal_svg(live, HERE / "terminal-live.svg", f"{command} (mid-epoch)")
        _terminal_svg(done, HERE / "terminal-done.svg", command)
        nb = _notebook_outputs(Path(tmp))
    code = nb["cells"][1]
    _notebook_svg([(code, nb["live"])], HERE / "notebook-live.svg", height=190)
    png = base64.b64decode(nb["png"])
    w, h = _png_size(png)
    shown_w = min(w, 860)
    image = f"<img src='data:image/png;base64,{nb['png']}' width='{shown_w}'/>"
    rows = nb["done"].count("<tr>") + nb["history"].count("<tr>")
    height = 140 + 26 * rows + h * shown_w // w
    parts = [(code, nb["done"] + image), ("jn.history(n)", nb["history"])]
    _notebook_svg(parts, HERE / "notebook-done.svg", height=height)
    for name in ("terminal-live", "terminal-done", "notebook-live", "notebook-done"):
        print(f"wrote {HERE / name}.svg")


if __name__ == "__main__":
    main()
