"""Everything that imports Ray: the embedded or joined cluster, the Ray Train launcher, Tune
sweeps, Ray jobs, and the sweep file's schema beside them. (Not named `ray`: that would shadow
the library inside the package.)"""
