"""`raylane autotune`: the fastest configuration of a pipeline that fits, found in one worker group.

- `driver`: the launch's driver side (the search space, the MLflow parent and child runs, the
  table, the plot, the winner's YAML and the summary); it starts Ray only through raylane.onray.
- `search`: the search itself, run by every rank (Ray-free: the same under Ray, torchrun or in
  one process); `order` plans the candidates and keeps the record a relaunch replays, `ranking`
  turns measured windows into intervals and a winner, `costs` measures evaluation and saves.
- `report`: the driver's table, plot and YAML."""
