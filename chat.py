#!/usr/bin/env python
"""Chat with a trained actor: ``python chat.py --path output/step3-models/tiny-opt``.

A thin wrapper of :mod:`inference.chatbot` (same flags), as DeepSpeed-Chat's ``chat.py``.
"""

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

from inference.chatbot import main, parse_args
from utils.entrypoint import run_main

if __name__ == "__main__":
    run_main(main, parse_args())
