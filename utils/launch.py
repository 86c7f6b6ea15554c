"""Starting ranks: a free port for the rendezvous and the ``deepspeed`` launcher script.

Pure module (standard library only, no torch): ``train.py``, the light launcher, uses it
without paying for a torch import; so do ``utils.distributed``, the matrix sweep
(``scripts/gen_matrix_table.py``) and the 2-rank tests.
"""
from __future__ import annotations

import os
import shutil
import socket
import sys


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``--master_port`` / ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_launcher() -> str:
    """The ``deepspeed`` script of this interpreter's environment (works without an activated venv), else the one
    on ``PATH``."""
    beside = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return beside if os.path.isfile(beside) else (shutil.which("deepspeed") or "deepspeed")
