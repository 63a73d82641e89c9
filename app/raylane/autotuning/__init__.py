"""`raylane autotune`: the fastest configuration of a pipeline that fits, found in one worker group.

- `driver`: the launch's driver side (the search space, the MLflow parent and child runs, the
  table, the plot, the winner's YAML and the summary); it starts Ray only through raylane.onray.
- `search`: the search itself, run by every rank (Ray-free: the same under Ray, torchrun or in
  one process), given its settings (raylane.config.autotune.SearchSettings); `profile` measures one candidate,
  `agree` is how the ranks agree on it, `memory` its peak and out-of-memory errors, `costs` its
  evaluation and saves; `order` plans the candidates, `record` keeps what a relaunch replays,
  `ranking` turns measured windows into intervals and a winner.
- What a candidate measured (Outcome, and how it ended: Fit) and the search's result
  (SearchResult) cross processes in rank 0's events: raylane.loop.protocols.result.
- `report`: the driver's lines, table, plot, MLflow metrics and YAML."""
