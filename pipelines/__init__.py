"""Named pipelines: each module defines `Config` (its typed config, with a `model` section) and
`build(cfg) -> raylane.loop.pipeline.Pipeline`. Models know nothing of distribution; `raylane.loop.parallel` wraps them.
torch is imported inside `build` so that validating a config never pays for it."""
