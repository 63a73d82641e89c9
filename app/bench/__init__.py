"""`raylane bench`: raylane against a hand-written torchrun DDP loop and plain Ray (B1-B9)."""
