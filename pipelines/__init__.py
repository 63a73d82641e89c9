"""Named pipelines: each module defines `Config` (its typed config, with a `model` section) and
`build(cfg) -> app.pipeline.Pipeline`. Models know nothing of distribution; `app.parallel` wraps them.
torch is imported inside `build` so that validating a config never pays for it."""
