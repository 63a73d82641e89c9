# `python -m raylane ...` and `torchrun --nproc_per_node N -m raylane train CONFIG`.
from raylane.cli import run

run()
