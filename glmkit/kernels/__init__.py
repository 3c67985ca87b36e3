"""Kernel backends. Each operator has a pure-torch reference (`naive.py`) beside its fast backends."""
