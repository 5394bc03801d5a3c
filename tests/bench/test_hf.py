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
