import pyarrow as pa

from bench.ray_data import row_groups


def test_row_groups_cut_at_the_document_or_byte_bound():
    table = pa.table({"text": ["a" * 3, "b" * 3, "c" * 3, None, "d" * 10, "e"]})
    # at most 2 documents, and a group ends at the document that brings it to 5 bytes
    assert row_groups(table, docs=2, text_bytes=5) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert row_groups(table, docs=10, text_bytes=100) == [(0, 6)]
    assert row_groups(table.slice(0, 0)) == []


RUNS = {"local, 1 worker": {"executor": {"kind": "local", "num_workers": 1}},
        "local, 2 workers": {"executor": {"kind": "local", "num_workers": 2}},
        "ray, 1 worker": {"executor": {"kind": "ray", "num_workers": 1}},
        "ray, 2 workers": {"executor": {"kind": "ray", "num_workers": 2}}}


def run_speed(monkeypatch, capsys, walls: dict, files=lambda name: {"a": "1"}) -> str:
    from bench import ray_data
    from pipeline import files as pipeline_files

    calls = {name: 0 for name in RUNS}

    def measure(corpus, section, work, stage, tokenizer):
        name = next(n for n, s in RUNS.items() if s == section)
        calls[name] += 1
        wild = name == "ray, 2 workers" and calls[name] == 3  # one wild run in three: the medians ignore it
        wall = walls[name] * (10 if wild else 1)
        return {"wall_s": wall, "cpu_s": 2 * wall, "files": files(name), "peak_main_mb": 100,
                "peak_worker_mb": 200, "peak_ray-system_mb": 0}

    monkeypatch.setattr(ray_data, "measure", measure)
    monkeypatch.setattr(pipeline_files, "available_cores", lambda: 2)
    ray_data.speed("clean", RUNS, 3, "c", 63.0, "w", "t", {}, 2)
    return capsys.readouterr().out


def test_speed_goals_are_judged_from_the_median_ratios(monkeypatch, capsys):
    out = run_speed(monkeypatch, capsys, {"local, 1 worker": 10.0, "local, 2 workers": 5.0,
                                          "ray, 1 worker": 12.0, "ray, 2 workers": 8.0})
    assert "clean: ray 2 workers / 1 worker speed-up: 1.50x (rounds 0.15-1.50) (goal >= 1.6: NOT met)" in out
    assert "clean: ray / local wall time (2 workers): 1.60x (rounds 1.60-16.00) (goal <= 1.3: NOT met)" in out
    assert "outputs byte-identical across all runs: True" in out
    out = run_speed(monkeypatch, capsys, {"local, 1 worker": 10.0, "local, 2 workers": 5.0,
                                          "ray, 1 worker": 12.0, "ray, 2 workers": 6.0},
                    files=lambda name: {"a": "2" if name == "ray, 1 worker" else "1"})
    assert "speed-up: 2.00x (rounds 0.20-2.00) (goal >= 1.6: met)" in out
    assert "(2 workers): 1.20x (rounds 1.20-12.00) (goal <= 1.3: met)" in out
    assert "outputs byte-identical across all runs: False" in out


def test_every_printout_says_which_mb():
    from bench.ray_data import MB, header

    assert MB == 10**6 and header().endswith("MB = 10**6 bytes, of text and of memory alike")


def test_the_worker_memory_goal_is_judged_on_both_sizes(monkeypatch, capsys):
    from bench import ray_data

    peaks = {("clean", 7): 1001, ("pack", 7): 600}
    monkeypatch.setattr(ray_data, "measure", lambda corpus, section, work, stage, tokenizer: {
        "peak_worker_mb": peaks[stage, corpus], "peak_main_mb": 300, "wall_s": 4.0})
    monkeypatch.setattr(ray_data, "dedup_memory", lambda *a: None)
    worker_peak = {("clean", 2): 500, ("pack", 2): 1200}  # pack: over the goal on the smaller corpus
    ray_data.memory_and_dedup(RUNS, {2: 2, 7: 7}, {2: 63.0, 7: 220.0}, {}, {}, [1, 3], 2, 7, "w", "t", worker_peak)
    out = capsys.readouterr().out
    assert "clean: worker peak 500 -> 1001 MB (1 GB = 1000 MB) (goal < 1000: NOT met); flat? 2.00x for 3.5x" in out
    assert "pack: worker peak 1200 -> 600 MB (1 GB = 1000 MB) (goal < 1000: NOT met); flat? 0.50x for 3.5x" in out


def test_no_worker_seen_is_not_a_met_memory_goal(monkeypatch, capsys):
    from bench import ray_data

    monkeypatch.setattr(ray_data, "measure", lambda corpus, section, work, stage, tokenizer: {
        "peak_worker_mb": 0, "peak_main_mb": 300, "wall_s": 4.0})
    monkeypatch.setattr(ray_data, "dedup_memory", lambda *a: None)
    ray_data.memory_and_dedup(RUNS, {2: 2, 7: 7}, {2: 63.0, 7: 220.0}, {}, {}, [1, 3], 2, 7, "w", "t",
                              {("clean", 2): 0, ("pack", 2): 500})
    out = capsys.readouterr().out
    assert "clean: worker peak 0 -> 0 MB: no worker process seen in a run, goal not measured" in out
    assert "pack: worker peak 500 -> 0 MB: no worker process seen in a run, goal not measured" in out
    assert "met" not in out
