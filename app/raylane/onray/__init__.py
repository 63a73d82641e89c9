"""Everything that imports Ray: the embedded or joined cluster, the Ray Train launcher, Tune
sweeps and Ray jobs. (Not named `ray`: that would shadow the library inside the package.) Ray's
own internals are named in one module of it, raylane.onray.internals. What needs no Ray lives
beside it: the sweep file's schema (raylane.config.sweep), a sweep's record and results
(raylane.sweeps), cluster addresses and the `raylane up` head (raylane.clusters).

Internal: not raylane's public API (see raylane.__all__); it may change in any release."""

__all__: list[str] = []
