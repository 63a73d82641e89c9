"""What raylane knows of Ray clusters without importing Ray: the addresses a command is given,
checked before anything starts (`addresses`), and the persistent head `raylane up` starts on this
machine (`local`). Joining and starting a cluster in-process, with Ray, is raylane.onray.cluster's.

Internal: not raylane's public API (see raylane.__all__); it may change in any release."""

__all__: list[str] = []
