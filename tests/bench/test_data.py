import pytest
import pyarrow.parquet as pq

from bench.data import rot, short_paragraphs, write_copies


def test_rot_copies_differ_and_keep_everything_but_letters():
    text = "Zebra, ábc 42!"
    assert rot(text, 0) == text
    assert rot(text, 1) == "Afcsb, ácd 42!"
    assert rot(text, 27) == rot(text, 1)
    assert len({rot(text, k) for k in range(26)}) == 26


def test_short_paragraphs_are_measured_in_utf8_bytes():
    ok, long_in_bytes = "x" * 100, "é" * 100  # 100 characters either way; the second is 200 bytes
    too_long = "é" * 151  # 302 bytes
    text = "\n\n".join(["x" * 99, ok, long_in_bytes, too_long, "y" * 300])
    assert short_paragraphs([text]) == [ok, long_in_bytes, "y" * 300]


def test_write_copies_counts_the_bytes_it_writes(tmp_path):
    # the corpus bytes are the numerator of every MB/s figure: they must be the text written
    path = tmp_path / "c.parquet"
    docs, nbytes = write_copies(path, ["a", "b"], ["héllo", "wörld!"], min_bytes=20)
    table = pq.read_table(path)
    texts = table.column("text").to_pylist()
    assert (docs, nbytes) == (4, 26) == (len(texts), sum(len(t.encode()) for t in texts))
    assert texts == ["héllo", "wörld!", "iémmp", "xösme!"]
    assert table.column("id").to_pylist() == ["a-0", "b-0", "a-1", "b-1"]


def test_goal_lines_judge_each_goal_on_its_own_figure():
    from bench.data import goal_lines

    shapes = {"short": {"stage_over_raw_cores": 0.84, "own_over_raw_cores": 0.95},
              "long": {"stage_over_raw_cores": 0.96, "own_over_raw_cores": 0.5}}
    memory = [{"stage": "pack", "shape": sh, "corpus_mb": mb, "peak_tree_mb": peak}
              for sh, mb, peak in (("short", 64, 600), ("short", 200, 1030), ("long", 64, 700), ("long", 200, 800))]
    memory.append({"stage": "clean", "shape": "long", "corpus_mb": 300, "peak_tree_mb": 5000})  # not pack's goal
    short, long, mem = goal_lines(shapes, memory, quick=False)
    assert short == ("short: whole stage / raw per core = 0.84 (goal >= 0.85: NOT met), "
                     "own timer = 0.95 (goal >= 0.9: met)")
    # the long documents' goal is the whole stage's; the own timer's 0.5 has none
    assert long == "long:  whole stage / raw per core = 0.96 (goal >= 0.95: met), own timer = 0.50"
    assert mem.startswith("pack peak memory, main + workers, any run = 1030 MiB (goal < 1024: NOT met) "
                          "at up to 200 MB of text; ")
    assert mem.endswith("many short documents 600 -> 1030; few long documents 700 -> 800 MiB")
    unsampled = [dict(memory[0], peak_tree_mb=0), memory[2]]  # a run over before its first sample
    assert "= 700 MiB (a run never sampled: not measured) at up to" in goal_lines(shapes, unsampled, quick=True)[2]
    quick = [dict(memory[0], peak_tree_mb=1000), memory[2]]
    assert "= 1000 MiB (goal < 1024: met) at up to 64 MB of text (--quick: no ~200 MB corpus)" in goal_lines(
        shapes, quick, quick=True)[2]


class FakeProcess:
    def __init__(self, rss, children=(), gone=False):
        self.rss, self._children, self.gone = rss, list(children), gone

    def memory_info(self):
        if self.gone:
            import psutil

            raise psutil.NoSuchProcess(1)
        return type("Info", (), {"rss": self.rss})()

    def children(self, recursive=False):
        assert recursive
        return self._children


def test_tree_rss_sums_the_live_processes_when_one_is_gone_mid_sample():
    from bench.data import tree_rss

    workers = [FakeProcess(300), FakeProcess(999, gone=True), FakeProcess(200)]
    assert tree_rss(FakeProcess(100, workers)) == (100, 600)
    assert tree_rss(FakeProcess(100, gone=True)) == (0, 0)


def test_shape_summary_takes_medians_over_rounds_and_puts_the_stage_on_top():
    from bench.data import shape_summary

    speed = {"stage": [5.0, 1.0, 6.0], "raw-1": [3.0, 2.0, 100.0], "raw-cores": [4.0, 8.0, 6.0],
             "raw-fast-cores": [10.0, 10.0, 10.0], "startup": [1.0, 9.0, 2.0]}
    own = [6.0, 0.5, 7.0]
    cpu = {"stage": [30.0, 20.0, 10.0], "raw-cores": [12.0, 10.0, 11.0]}
    s = shape_summary(speed, own, cpu, {"bytes": 50_000_000, "docs": 7})
    # medians (a mean would give stage 4.0, raw-1 35.0): one wild round moves nothing
    assert s["mb_per_s"]["stage"]["median"] == 5.0 and s["mb_per_s"]["raw-1"]["median"] == 3.0
    assert s["mb_per_s"]["stage"]["runs"] == [5.0, 1.0, 6.0]
    assert s["stage_over_raw_cores"] == 5.0 / 6.0 and s["own_over_raw_cores"] == 6.0 / 6.0
    assert s["stage_over_raw_1"] == 5.0 / 3.0 and s["own_over_raw_1"] == 2.0
    assert s["stage_over_raw_fast_cores"] == 0.5 and s["own_over_raw_fast_cores"] == 0.6
    assert s["raw_cpu_over_stage_cpu"] == 11.0 / 20.0
    # start-up 2 s of a stage that took 50 MB / 5 MB/s = 10 s
    assert s["startup_s"]["median"] == 2.0 and s["startup_share_of_stage"] == 0.2
    assert (s["corpus_mb"], s["docs"]) == (50.0, 7)


@pytest.mark.slow
@pytest.mark.timeout(60)  # the defect was a hang
def test_raw_encode_fails_when_a_process_dies_before_the_start(tmp_path):
    """It used to wait for ever at the common start for the process that died."""
    from bench.data import raw_encode

    corpus = tmp_path / "c.parquet"
    write_copies(corpus, ["a"], ["hello"], min_bytes=1)
    with pytest.raises(RuntimeError, match="raw encode failed: process 0 exited 1"):
        raw_encode(str(corpus), str(tmp_path / "no-tokenizer.json"), 1, fast=False)


@pytest.mark.slow
def test_raw_encode_counts_every_byte_and_token_of_its_processes(tmp_path):
    from bench.data import raw_encode
    from tests.helpers import train_tiny_tokenizer

    corpus, tok = tmp_path / "c.parquet", tmp_path / "tokenizer.json"
    texts = ["hello world", "héllo again", "a third text"]
    write_copies(corpus, ["a", "b", "c"], texts, min_bytes=1)
    tokenizer = train_tiny_tokenizer(tok)
    r = raw_encode(str(corpus), str(tok), 2, fast=False)
    assert r["bytes"] == sum(len(t.encode()) for t in texts)
    assert r["tokens"] == sum(len(tokenizer.encode(t).ids) for t in texts)
    assert r["seconds"] > 0 and r["mb_per_s"] == r["bytes"] / r["seconds"] / 1e6
