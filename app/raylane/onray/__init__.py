"""Everything that imports Ray: the embedded or joined cluster, the Ray Train launcher, Tune
sweeps, Ray jobs, and the sweep file's schema beside them. (Not named `ray`: that would shadow
the library inside the package.) Ray's own internals are named in one module of it,
raylane.onray.internals.

Internal: not raylane's public API (see raylane.__all__); it may change in any release."""

__all__: list[str] = []
