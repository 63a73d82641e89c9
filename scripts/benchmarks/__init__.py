"""`raylane bench`: raylane against a hand-written torchrun DDP loop and plain Ray (B1-B9).

Internal: not raylane's public API (see raylane.__all__); it may change in any release."""

__all__: list[str] = []
