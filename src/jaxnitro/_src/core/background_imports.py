"""Slow imports run in a background thread while the main thread works (XLA compiles without
the GIL), and the wait for them that must come first when a process forks: a child forked
amid an import could inherit its import locks, held forever.

`observe.plot` imports matplotlib this way during a run; `data.workers` waits before it forks
its transform workers. Both sit above `core`, neither imports the other.

A process waits for them at exit, too: a daemon thread still running Python when the
interpreter finalizes may run the garbage collector, and freeing a JAX array there (the
arrays of a failed run's traceback, say) ends the thread inside a C++ destructor, which
aborts the process (SIGABRT, "FATAL: exception not rethrown") instead of exiting with its
status.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import threading
from collections.abc import Sequence

_threads: dict[str, threading.Thread] = {}


def start(name: str, modules: Sequence[str]) -> None:
    """Import `modules` in a daemon thread called `name`, once per process per name. A module
    that fails to import is skipped: the code that needs it reports what is wrong."""
    if name in _threads:
        return
    if not _threads:
        atexit.register(wait)  # before the interpreter finalizes (see the module's docstring)
    thread = threading.Thread(target=_import, args=(tuple(modules),), name=name, daemon=True)
    _threads[name] = thread
    thread.start()


def started(name: str) -> bool:
    """Whether `start(name, ...)` ran in this process."""
    return name in _threads


def wait() -> None:
    """Wait for every background import this process started."""
    for thread in list(_threads.values()):
        thread.join()


def _import(modules: tuple[str, ...]) -> None:
    with contextlib.suppress(Exception):
        for module in modules:
            importlib.import_module(module)
