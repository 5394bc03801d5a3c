import pytest

from bench.train import timed_tokens_per_s


def rows(*logged: tuple[int, float]) -> list[dict]:
    """Rows as csv.DictReader gives them from plots/pretrain.csv."""
    return [{"step": str(step), "tokens_per_s": str(rate)} for step, rate in logged]


def test_timed_windows_exclude_the_warmup_window():
    # windows of 5 steps at 200 and 300 tok/s: 10 steps' tokens over their time
    assert timed_tokens_per_s(rows((5, 1.0), (10, 200.0), (15, 300.0)), warmup=5) == pytest.approx(240.0)


def test_a_short_last_window_counts_by_its_steps():
    # 5 steps at 200 tok/s, then 2 steps (max_steps 12) at 50: 7 steps over 5/200 + 2/50 step-seconds per token
    got = timed_tokens_per_s(rows((5, 1.0), (10, 200.0), (12, 50.0)), warmup=5)
    assert got == pytest.approx(7 / (5 / 200 + 2 / 50))
