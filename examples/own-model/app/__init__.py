"""This project's own code. The folder is named `app` on purpose: raylane installs as `raylane`
only, so a user's `app` (or `pipelines`) package never meets raylane's own code."""
