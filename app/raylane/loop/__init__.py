"""The launcher-agnostic training loop: runs under Ray Train workers, torchrun or one process.
Nothing in this package imports Ray (tests/e2e/test_layout.py keeps it so).

Internal: not raylane's public API (see raylane.__all__); it may change in any release. A
pipeline imports what it needs from `raylane` (Pipeline, FileSource, StepFn, Hook, ...)."""

__all__: list[str] = []
