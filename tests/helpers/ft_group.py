"""One rank of a replica group, through raylane's own loop as a torchrun rank runs it (prelude,
launch_local), for tests/e2e/test_ft_loop.py: `python ft_group.py CONFIG.json EVENTS.jsonl [TRAIN]`
(TRAIN: JSON of changes to the config's train section).
The launcher's contract comes in the environment (RAYLANE_REPLICA_GROUP, RAYLANE_REPLICA_GROUPS,
TORCHFT_LIGHTHOUSE, MASTER_ADDR/MASTER_PORT, RANK/WORLD_SIZE). Rank 0 writes each event it
publishes as a JSON line: its kind and its fields that JSON holds."""

from __future__ import annotations

import dataclasses
import json
import sys


def main() -> int:
    from raylane.config import validate
    from raylane.loop.distributed.groups import leave_process_group
    from raylane.loop.run import launch_local, prelude

    raw = json.loads(open(sys.argv[1]).read())
    raw["train"].update(json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
    cfg = validate(raw)
    out = open(sys.argv[2], "a")

    def on_event(event: object) -> None:
        fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}  # type: ignore[arg-type]
        plain = {k: v for k, v in fields.items() if _jsonable(v)}
        out.write(json.dumps({"kind": type(event).__name__, **plain}) + "\n")
        out.flush()

    prelude(cfg, None)
    result = launch_local(cfg, on_event)
    on_event(result)
    leave_process_group(wait_for_peers=False)
    return 0


def _jsonable(value: object) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
