"""A sweep's state outside Ray, beside its schema (raylane.config.sweep): the record in its folder
that a rerun is checked against (`record`), what a trial reports beside its metrics (`objective`),
and the finished sweep's rows, best trial and parent-run records (`results`). Running the trials
under Tune is raylane.onray.tune's; drawing them with Tune's search, raylane.onray.sweep_plan's.

Internal: not raylane's public API (see raylane.__all__); it may change in any release."""

__all__: list[str] = []
