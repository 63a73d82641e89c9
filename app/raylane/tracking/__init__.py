"""MLflow: a run's lifecycle and rank 0's metrics (`runs`), the end-of-run records (`records`),
and the live progress display (`progress`).

Internal: not raylane's public API (see raylane.__all__); it may change in any release."""

__all__: list[str] = []
