"""MLflow: a run's lifecycle and rank 0's metrics (`runs`), the end-of-run records (`records`),
and the live progress display (`progress`)."""
