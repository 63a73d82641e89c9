"""Named pipelines: each module defines `Config` (its typed config, with a `model` section) and
`build(cfg) -> raylane.Pipeline`, using only raylane's public names (as a pipeline of your own
would) and each other (text builds on gpt's model). Models know nothing of distribution: raylane wraps them.
torch is imported inside `build` so that validating a config never pays for it."""
