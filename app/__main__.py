# `python -m app ...` and `torchrun --nproc_per_node N -m app train CONFIG`.
from app.cli import run

run()
