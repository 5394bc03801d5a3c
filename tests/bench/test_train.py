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


def test_the_overhead_goal_is_judged_from_the_medians():
    from bench.train import result_line

    r = {"precision": "fp32", "stage_tokens_per_s": 940.0, "plain_tokens_per_s": 1000.0, "stage_over_plain": 0.94,
         "stage_overhead_pct": 6.0, "mfu": 0.1234, "matmul_peak_flops": 2.5e11}
    assert result_line(r) == ("fp32: stage 940 tok/s, plain 1,000 tok/s, stage/plain = 0.940, overhead 6.0% "
                              "(goal <= 5: NOT met); MFU 12.3% of the measured fp32 matmul peak (250.0 GFLOP/s)")
    assert "overhead 5.0% (goal <= 5: met)" in result_line({**r, "stage_overhead_pct": 5.0})


def test_summarise_takes_medians_and_puts_the_stage_over_the_plain_loop():
    from bench.train import summarise

    s = summarise(plain=[1000.0, 10.0, 1100.0], stage=[900.0, 990.0, 5000.0], flops_per_token=1e6, peak=1e10)
    assert (s["plain_tokens_per_s"], s["stage_tokens_per_s"]) == (1000.0, 990.0)  # medians, not means
    assert s["stage_over_plain"] == pytest.approx(0.99) and s["stage_overhead_pct"] == pytest.approx(1.0)
    assert s["mfu"] == pytest.approx(990.0 * 1e6 / 1e10)
    assert s["plain_runs"] == [1000.0, 10.0, 1100.0] and s["stage_runs"] == [900.0, 990.0, 5000.0]
