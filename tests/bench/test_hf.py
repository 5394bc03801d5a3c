import pytest

from bench.hf import memory_mb

STATUS = """Name:\tpython
VmPeak:\t 9999999 kB
VmHWM:\t  307200 kB
VmRSS:\t  102912 kB
RssAnon:\t   50000 kB
"""


def test_memory_is_current_then_peak_resident_in_mib():
    # /proc's kB are KiB: 102,912 KiB = 100.5 MiB now, 307,200 KiB = 300 MiB at the peak
    assert memory_mb(STATUS) == (pytest.approx(100.5), pytest.approx(300.0))


def test_memory_reads_this_process_by_default():
    current, peak = memory_mb()
    assert 0 < current <= peak


def test_summarise_takes_medians_and_puts_ours_on_top():
    from bench.hf import summarise

    def load(s, before, peak):
        return {"load_s": s, "rss_before_mb": before, "load_peak_mb": peak}

    def train(tps, peak):
        return {"load_s": 0.0, "rss_before_mb": 0.0, "load_peak_mb": 0.0, "tokens_per_s": tps, "train_peak_mb": peak}

    runs = {"load": {"ours": [load(2.0, 100, 400), load(9.0, 100, 400), load(3.0, 100, 400)],
                     "transformers": [load(4.0, 200, 800), load(4.0, 200, 800), load(1.0, 200, 800)]},
            "train": {"ours": [train(100.0, 1000), train(300.0, 1200), train(200.0, 1100)],
                      "transformers": [train(50.0, 2200), train(50.0, 2200), train(999.0, 2200)]}}
    s = summarise(runs, fp32_mb=200.0)
    o, t, r = s["ours"], s["transformers"], s["ours_over_transformers"]
    assert (o["load_s"], t["load_s"]) == (3.0, 4.0)  # medians, not means
    assert (o["load_added_mb"], t["load_added_mb"]) == (300, 600)  # peak less what was resident before
    assert (o["load_added_over_fp32"], o["train_peak_over_fp32"]) == (1.5, 5.5)
    assert r == {"load_s": 0.75, "load_added_mb": 0.5, "train_tokens_per_s": 4.0, "train_peak_mb": 0.5}


def test_loss_line_pairs_each_run_of_ours_with_the_same_run_of_theirs():
    from bench.hf import loss_line

    runs = {"train": {"ours": [{"loss": 9.0157}, {"loss": 8.5}], "transformers": [{"loss": 9.0158}, {"loss": 7.25}]}}
    assert loss_line(runs) == "last training loss, ours / transformers: 9.015700 / 9.015800, 8.500000 / 7.250000"
