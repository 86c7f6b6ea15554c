#!/usr/bin/env python
"""Chat with a trained actor: ``python chat.py --path output/step3-models/tiny-opt``.

A thin wrapper of :mod:`inference.chatbot` (same flags), as DeepSpeed-Chat's ``chat.py``.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from inference.chatbot import main, parse_args  # noqa: E402
from utils.utils import run_main  # noqa: E402

if __name__ == "__main__":
    run_main(main, parse_args())
