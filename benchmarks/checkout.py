"""Importing from this checkout: in this process, run as a script, and in the processes it starts.

The device scripts run as ``python3 benchmarks/gpu_check.py`` from a checkout that is not
installed. Python then puts benchmarks/ at the head of ``sys.path``, where ``benchmarks``
itself does not import and this folder's modules would shadow any others of their names.
Such a script imports this module by its bare name, the one import that works there, and
lets it put the checkout's root in that place before it imports anything else of the tree:

    if __name__ == "__main__" and not __package__:  # run as a script
        from checkout import import_from_checkout

        import_from_checkout()

Not in the copy of the script that multiprocessing's spawn runs in a child process first
(named ``__mp_main__``): the child starts with the parent's ``sys.path``, the root already
at its head.

This module imports only the standard library.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_from_checkout() -> None:
    """Put the checkout's root where Python put the script's folder (``sys.path[0]``)."""
    sys.path[0] = str(ROOT)


def pythonpath(*after_root: str) -> str:
    """A ``PYTHONPATH`` for a child process: the checkout's root, ``after_root``, then this
    process's own ``PYTHONPATH``."""
    return os.pathsep.join(filter(None, [str(ROOT), *after_root, os.environ.get("PYTHONPATH")]))


def ctrl_c_reaches_it() -> None:
    """``preexec_fn`` of a child process that is stopped with Ctrl-C (SIGINT), as ``serve
    run`` is: a shell runs background jobs (``command &`` in a script, a CI step sent to
    the background) with SIGINT ignored, and a child inherits that, so Python would never
    raise KeyboardInterrupt in it and the stop would wait out its deadline and kill it.
    Restore the default disposition."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
