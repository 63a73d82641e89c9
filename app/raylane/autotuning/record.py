"""The search's record in the run's folder: a line per candidate started and measured (and per
later round), so that a relaunch after the group died replays what was measured and marks the
candidate it died on failed instead of trying it again. Pure Python (no torch, no Ray); rank 0
writes it."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from raylane.config.autotune import SearchSettings
from raylane.loop.protocols.result import Fit, Outcome

log = logging.getLogger("raylane")

RECORD_FILE = "autotune.jsonl"
DIED = "the worker group died while profiling it"


# Config keys added after searches were recorded, with their defaults.
LATER_KEYS: dict[str, Any] = {"strategy.ep": 1, "strategy.ep_capacity_factor": None}


def fingerprint(flat: dict[str, Any], settings: SearchSettings) -> str:
    """What an earlier launch's record must match to be replayed: the config (but its run
    section) and the space and how it is measured."""
    # A search never has replica groups (config.autotune refuses them): their keys, added to the
    # config after records were written, change nothing measured, and would stop every earlier
    # record from replaying.
    # So do keys added since at their defaults (expert parallelism off), which measure as before.
    same = {
        k: v
        for k, v in flat.items()
        if not k.startswith(("run.", "fault_tolerance.")) and not (k in LATER_KEYS and v == LATER_KEYS[k])
    }
    return hashlib.sha256(
        json.dumps(
            [
                same,
                settings.space,
                settings.global_batch.model_dump(),
                settings.warmup_steps,
                settings.profile_steps,
                settings.windows,
                settings.min_window_s,
            ],
            sort_keys=True,
            default=str,
        ).encode()
    ).hexdigest()[:16]


class SearchRecord:
    """Rank 0's record of one search (`path` None: none is kept, as for s3:// storage)."""

    def __init__(self, path: str | None, fingerprint: str) -> None:
        self.path, self.fingerprint = (Path(path) if path else None), fingerprint

    def replay(self) -> tuple[list[Outcome], list[tuple[int, Outcome]]]:
        """What an earlier launch of this search measured: each candidate's first outcome, and
        the later rounds in order, as (candidate index, that round's outcome). A candidate it
        started but never finished (its group died) is recorded failed, so it is not tried
        again; a round that never finished ends that candidate's rounds."""
        if self.path is None or not self.path.exists():
            return [], []
        done, rounds, started, round_started = read_record(self.path, self.fingerprint)
        if started is not None:
            failed = Outcome(started, Fit.FAILED, error=DIED)
            self.outcome(failed)
            done.append(failed)
        if round_started is not None:
            self.round_of(round_started, Outcome({}, Fit.FAILED, error=DIED))
            rounds.append((round_started, Outcome({}, Fit.FAILED, error=DIED)))
        return done, rounds

    def started(self, values: dict[str, Any]) -> None:
        self._append({"started": values})

    def outcome(self, outcome: Outcome) -> None:
        self._append(outcome.to_dict())

    def started_round(self, index: int) -> None:
        self._append({"started_round": index})

    def round_of(self, index: int, outcome: Outcome) -> None:
        self._append({"round_of": index, "outcome": outcome.to_dict()})

    def _append(self, entry: dict[str, Any]) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps({**entry, "fingerprint": self.fingerprint}) + "\n")


def read_record(
    path: Path, fingerprint: str
) -> tuple[list[Outcome], list[tuple[int, Outcome]], dict[str, Any] | None, int | None]:
    """An earlier launch's record (its lines of `fingerprint`): (each candidate's first outcome;
    the later rounds in order, as (candidate index, that round's outcome); the values of a
    candidate started and never finished, or None; the index of such a round, or None)."""
    done: list[Outcome] = []
    rounds: list[tuple[int, Outcome]] = []
    started: dict[str, Any] | None = None
    round_started: int | None = None
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:  # a line cut short when the group died: the candidate is redone
            continue
        if entry.get("fingerprint") != fingerprint:
            continue  # an earlier search of this name over another config or space
        if "started" in entry:
            started = entry["started"]
        elif "started_round" in entry:
            round_started = entry["started_round"]
        elif "round_of" in entry:
            if (again := _outcome(entry["outcome"], path)) is not None:
                rounds.append((entry["round_of"], again))
            round_started = None
        else:
            if (first := _outcome({k: v for k, v in entry.items() if k != "fingerprint"}, path)) is not None:
                done.append(first)
            started = None
    return done, rounds, started, round_started


def _outcome(data: dict[str, Any], path: Path) -> Outcome | None:
    """A recorded outcome, or None (said) when it has keys this raylane does not know: that
    candidate is measured again rather than replayed without them."""
    try:
        return Outcome.from_dict(data)
    except (TypeError, ValueError) as exc:
        log.warning("%s: an outcome measured again: %s", path, exc)
        return None
