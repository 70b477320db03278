"""`kvpush bench turns`: its table from recorded turns, and its settings."""

from __future__ import annotations

import pytest

from kvpush.bench.turns import Run, Turn, TurnSpec, summary_rows


def turn(conversation: int, number: int, prompt: int, ttft: float, cached: float) -> Turn:
    moved = {"local_cache_hit": cached, "external_kv_transfer": prompt - cached - 1,
             "local_compute": 1.0}  # fmt: skip
    return Turn(conversation, number, prompt, ttft, moved)


def test_the_table_shows_turn_two_transfers_against_its_prompt() -> None:
    turns = [turn(0, 1, 600, 40.0, 0), turn(0, 2, 700, 20.0, 512),
             turn(1, 1, 600, 42.0, 0), turn(1, 2, 700, 22.0, 512)]  # fmt: skip
    on = Run("kvpush-push", True, turns=turns)
    off = Run("kvpush-push", False, turns=[turn(0, 1, 600, 40.0, 0), turn(0, 2, 700, 30.0, 0)])
    failed = Run("kvpush-pull", True, status="failed", reason="chat 0 turn 2: HTTP 502")
    rows = summary_rows([on, off, failed])
    assert rows[0] == ["kvpush-push", "on", "ok", "41.0", "21.0", "1400", "374 (27%)",
                       "1024 / 2"]  # fmt: skip
    assert rows[1][1] == "off" and rows[1][6] == "699 (100%)"
    assert rows[2][:3] == ["kvpush-pull", "on", "failed"] and "HTTP 502" in rows[2][-1]


def test_an_unknown_setup_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="nonsense"):
        TurnSpec(setups=("kvpush-push", "nonsense"))
