# `python -m app ...` and `torchrun --nproc_per_node N -m app train CONFIG`.
import os
import sys

from app.cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
    # A torchrun rank that has left its process group: skip the interpreter's teardown, where
    # gloo's threads were seen to abort the process ("terminate called without an active
    # exception", about 1 run in 15) after the run had finished and its results were written.
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
raise SystemExit(code)
