"""The launcher-agnostic training loop: runs under Ray Train workers, torchrun or one process.
Nothing in this package imports Ray (tests/test_layout.py keeps it so)."""
