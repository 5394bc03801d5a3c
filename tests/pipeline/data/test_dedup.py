"""pipeline/data/dedup.py: the sharded dedup steps keep exactly the documents the
in-memory indexes keep, with the same quarantine and report."""

import os

import numpy as np
import pytest

from pipeline.data import clean, dedup
from pipeline.data.docs import SPLIT, TASKS_PER_WORKER, identity, read_units, unit_tasks
from tests.pipeline.data import test_clean
from tests.pipeline.data.test_clean import cfg, code, prose, report, run, write_docs


def edited(words: list[str], positions, tag: str) -> list[str]:
    out = list(words)
    for p in positions:
        out[p] = f"{tag}{p}"
    return out


A = prose(400, seed=7).split()
B = edited(A, range(10, 400, 67), "b")   # A~B (estimated Jaccard 0.83)
C = edited(B, range(40, 400, 67), "c")   # B~C (0.88), but A and C are not (0.73)
D = prose(300, seed=8).split()

PLANTED = [
    " ".join(A),                 # 0 kept
    code(1),                     # 1 kept
    " ".join(B),                 # 2 near duplicate of 0
    code(1),                     # 3 exact duplicate of 1
    " ".join(C),                 # 4 kept: its only near match (2) was dropped
    "lorem ipsum dolor sit amet",  # 5 filtered
    " ".join(D),                 # 6 kept
    " ".join(D) + " tail",       # 7 near duplicate of 6
    " ".join(B),                 # 8 exact duplicate of 2 (a dropped document)
    " ".join(D) + " end",        # 9 near duplicate of 6
    code(2),                     # 10 kept
    "",                          # 11 filtered (too_short)
    " ".join(C) + " more",       # 12 near duplicate of 4
    code(3).replace("\n", "  \r\n"),  # 13 kept, changed by normalisation
]


def outputs(tmp_path, texts, **kw):
    metrics, docs, quarantine = run(tmp_path, texts, **kw)
    metrics.pop("mb_per_s")
    shards = [f.read_bytes() for f in sorted((tmp_path / "out" / "docs").glob("shard-*.parquet"))]
    return metrics, report(tmp_path), docs, quarantine, (tmp_path / "out" / "quarantine.jsonl").read_bytes(), shards


def both(tmp_path, texts, **kw):
    (tmp_path / "memory").mkdir()
    (tmp_path / "sharded").mkdir(exist_ok=True)
    memory = outputs(tmp_path / "memory", texts, **kw)
    sharded = outputs(tmp_path / "sharded", texts, dedup={"method": "sharded", "partition_docs": 3}, **kw)
    return memory, sharded


@pytest.mark.parametrize("shard_bytes", [1 << 26, 1])  # one output shard, one per batch
def test_planted_duplicates_and_a_chain_keep_the_same_documents(tmp_path, shard_bytes):
    memory, sharded = both(tmp_path, PLANTED, batch_docs=4, shard_bytes=shard_bytes)
    assert sharded == memory
    assert memory[0]["shards"] == (1 if shard_bytes > 1 else 4)
    _, rep, docs, quarantine, _, _ = memory
    # The greedy rule, not clusters: C's only match B was dropped, so C stays.
    assert [d["id"] for d in docs] == ["id000", "id001", "id004", "id006", "id010", "id013"]
    kept_of = {q["source"]: q["detail"].rsplit(" ", 1)[1] for q in quarantine if q["reason"] == "near_duplicate"}
    assert kept_of == {"src/2.py": "id000", "src/7.py": "id006", "src/9.py": "id006", "src/12.py": "id004"}
    assert rep["dropped"]["exact_duplicate"] == 2 and rep["near_dedup"]["kept_in_index"] == 6
    assert rep["docs_changed_by_normalise"] >= 1
    assert rep["near_dedup"]["candidates_checked"] >= 4


def test_many_duplicates_many_batches_and_partitions(tmp_path):
    texts = PLANTED * 3 + [prose(120, seed=s) for s in range(20)] + [prose(120, seed=3) + f" v{k}" for k in range(6)]
    memory, sharded = both(tmp_path, texts, batch_docs=5, quarantine_per_reason=2)
    assert sharded == memory
    assert memory[1]["dropped"]["near_duplicate"] > 6 and memory[1]["dropped"]["exact_duplicate"] > 6


def test_band_hash_collisions_make_no_candidates(tmp_path, monkeypatch):
    # Every band of every document gets the same key: the band step must still
    # pair only documents whose band is equal.
    monkeypatch.setattr(dedup, "band_keys", lambda sigs, bands: np.zeros((len(sigs), bands), np.uint64))
    memory, sharded = both(tmp_path, PLANTED)
    assert sharded == memory


@pytest.mark.parametrize("resolve_docs, resolve_pairs", [(2, 1 << 20), (1 << 20, 3)])
def test_spilled_runs_and_ranges_give_the_same_decisions(tmp_path, monkeypatch, resolve_docs, resolve_pairs):
    monkeypatch.setattr(dedup, "PAIRS_PER_RUN", 1)
    monkeypatch.setattr(dedup, "RESOLVE_DOCS", resolve_docs)
    monkeypatch.setattr(dedup, "RESOLVE_PAIRS", resolve_pairs)
    cluster = [" ".join(edited(A, [k, 200 + k], "x")) for k in range(25)]  # one large bucket
    memory, sharded = both(tmp_path, PLANTED + cluster + PLANTED, batch_docs=3)
    assert sharded == memory
    assert memory[1]["dropped"]["near_duplicate"] > 25


def test_the_decision_pass_takes_a_bounded_number_of_pairs_at_a_time(monkeypatch):
    monkeypatch.setattr(dedup, "RESOLVE_DOCS", 50)
    monkeypatch.setattr(dedup, "RESOLVE_PAIRS", 40)
    pairs = np.array([(j, i, 1) for j in range(200) for i in range(j if 20 <= j < 40 else min(j, 1))], dedup.PAIR)
    runs = [pairs[k::3] for k in range(3)]  # three sorted runs
    ranges = list(dedup.resolve_ranges(runs, 200))
    assert ranges[0][0] == 0 and ranges[-1][1] == 200 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for lo, hi in ranges:
        n = int(((pairs["j"] >= lo) & (pairs["j"] < hi)).sum())
        assert hi - lo <= 50 and (n <= 40 or hi - lo == 1), (lo, hi, n)
    assert (39, 40) in ranges  # document 39 alone: its 39 pairs


def test_a_large_bucket_spills_its_pairs_as_it_goes(tmp_path, monkeypatch):
    """A bucket of m documents gives m(m-1)/2 pairs: the band task must not hold
    them all before it writes a run."""
    monkeypatch.setattr(dedup, "PAIRS_PER_RUN", 100)
    m = 60
    work = dedup.WorkDir(tmp_path / "w", num_docs=m, num_perm=8, bands=2, partition_docs=1000)
    writer = dedup.SignatureWriter(work, exact=False, near=True)
    sigs = np.random.default_rng(0).integers(0, 2**32, size=(m, 8), dtype=np.uint32)
    sigs[:, :4] = sigs[0, :4]  # band 0 equal for all: one bucket
    writer.add(np.full(m, dedup.CANDIDATE, np.uint8), None, sigs)
    writer.close()
    runs = [np.load(r) for r in dedup.band_pairs(work, 0, 0, writer.size(work.band_path(0, 0)))]
    assert sum(len(r) for r in runs) == m * (m - 1) // 2
    assert len(runs) > 10 and max(len(r) for r in runs) < 100 + m  # a run, plus one document's pairs


@pytest.mark.parametrize("large", [1, 3])
def test_large_buckets_keep_the_same_documents(tmp_path, monkeypatch, large):
    """Buckets of more than LARGE_BUCKET documents give their members, checked in
    the decision pass against the kept ones only: 1 sends every bucket that
    way, 3 mixes both kinds (a pair found in a small bucket of one band and a
    large one of another is counted once)."""
    monkeypatch.setattr(dedup, "LARGE_BUCKET", large)
    monkeypatch.setattr(dedup, "RESOLVE_PAIRS", 7)  # ranges cut between a bucket's members
    cluster = [" ".join(edited(A, [k, 200 + k], "x")) for k in range(25)]
    texts = PLANTED + cluster + PLANTED * 2 + [prose(120, seed=3) + f" v{k}" for k in range(6)]
    memory, sharded = both(tmp_path, texts, batch_docs=3, quarantine_per_reason=40)
    assert sharded == memory
    assert memory[1]["dropped"]["near_duplicate"] > 25
    kept_of = {q["source"]: q["detail"].rsplit(" ", 1)[1] for q in memory[3] if q["reason"] == "near_duplicate"}
    assert kept_of["src/2.py"] == "id000" and "src/4.py" not in kept_of  # the chain: C stays


def test_band_hash_collisions_split_large_buckets_by_their_band(tmp_path, monkeypatch):
    monkeypatch.setattr(dedup, "LARGE_BUCKET", 1)
    monkeypatch.setattr(dedup, "band_keys", lambda sigs, bands: np.zeros((len(sigs), bands), np.uint64))
    memory, sharded = both(tmp_path, PLANTED)
    assert sharded == memory


def test_a_large_bucket_gives_its_members_not_its_pairs(tmp_path, monkeypatch):
    """A cluster of m copies: m member records, not m(m-1)/2 pairs, and each
    copy is compared with the one kept document only."""
    monkeypatch.setattr(dedup, "LARGE_BUCKET", 10)
    m = 60
    work = dedup.WorkDir(tmp_path / "w", num_docs=m, num_perm=8, bands=2, partition_docs=1000)
    writer = dedup.SignatureWriter(work, exact=False, near=True)
    sigs = np.random.default_rng(0).integers(0, 2**32, size=(m, 8), dtype=np.uint32)
    sigs[:, :7] = sigs[0, :7]  # band 0 equal for all, 7 of 8 slots: estimated Jaccard 0.875
    writer.add(np.full(m, dedup.CANDIDATE, np.uint8), None, sigs)
    writer.close()
    runs = dedup.band_pairs(work, 0, 0, writer.size(work.band_path(0, 0)))
    assert [os.path.basename(r) for r in runs] == ["members-0000-00000.npy"]
    members = np.load(runs[0])
    assert members["doc"].tolist() == list(range(m)) and set(members["last"].tolist()) == {m - 1}
    res = dedup.resolve(work, runs, 0.8, ids_wanted=3)
    assert res["near"] == m - 1 and res["candidates_checked"] == m - 1
    assert res["detail"] == {1: (7 / 8, 0), 2: (7 / 8, 0), 3: (7 / 8, 0)}
    assert work.state().tolist() == [dedup.CANDIDATE] + [dedup.NEAR] * (m - 1)


def test_a_large_bucket_is_checked_against_every_member_kept_before(tmp_path, monkeypatch):
    """In one large bucket (band 1 equal): 0 and 1 are kept (estimated Jaccard
    0.5), 2 matches 1 only, 3 matches 0 only, 4 is a copy of 1 (band 0 equal
    too: a pair as well)."""
    monkeypatch.setattr(dedup, "LARGE_BUCKET", 2)
    rng = np.random.default_rng(1)
    sigs = rng.integers(0, 2**32, size=(5, 8), dtype=np.uint32)
    sigs[:, 4:] = sigs[0, 4:]
    sigs[2, :3] = sigs[1, :3]  # 7 of 8 with 1, 4 of 8 with 0
    sigs[3, :3] = sigs[0, :3]  # 7 of 8 with 0
    sigs[4] = sigs[1]
    work = dedup.WorkDir(tmp_path / "w", num_docs=5, num_perm=8, bands=2, partition_docs=1000)
    writer = dedup.SignatureWriter(work, exact=False, near=True)
    writer.add(np.full(5, dedup.CANDIDATE, np.uint8), None, sigs)
    writer.close()
    runs = [r for b in range(2) for r in dedup.band_pairs(work, b, 0, writer.size(work.band_path(b, 0)))]
    assert sorted(os.path.basename(r)[:8] for r in runs) == ["members-", "pairs-00"]
    res = dedup.resolve(work, runs, 0.8, ids_wanted=10)
    assert work.state().tolist() == [dedup.CANDIDATE, dedup.CANDIDATE, dedup.NEAR, dedup.NEAR, dedup.NEAR]
    assert res["detail"] == {2: (7 / 8, 1), 3: (7 / 8, 0), 4: (1.0, 1)}
    # 1: {0}; 2: {0, 1}; 3: {0, 1}; 4: {0, 1}, 1 both by its pair and by the bucket, counted once
    assert (res["candidates_checked"], res["candidates_below_threshold"]) == (7, 4)


MANY_RUNS = PLANTED + [" ".join(edited(A, [k, 200 + k], "x")) for k in range(12)] + PLANTED


def test_many_runs_are_merged_before_the_decision_pass(tmp_path, monkeypatch):
    """More than MERGE_RUNS runs of a kind are merged, level by level, into at
    most MERGE_RUNS: the decision pass gets few runs, with the same records."""
    monkeypatch.setattr(dedup, "PAIRS_PER_RUN", 1)  # a run per document's pairs
    monkeypatch.setattr(dedup, "LARGE_BUCKET", 3)   # and member runs
    monkeypatch.setattr(dedup, "MERGE_RUNS", 2)
    monkeypatch.setattr(dedup, "RESOLVE_PAIRS", 5)  # each merge in several ranges
    given, merge = [], dedup.merge
    monkeypatch.setattr(dedup, "merge", lambda work, runs, m: given.append(list(runs)) or merge(work, runs, m))
    seen, resolve = [], dedup.resolve
    monkeypatch.setattr(dedup, "resolve", lambda work, runs, *a: seen.append(
        (runs, [np.load(r) for r in runs], sorted(os.listdir(work.root)))) or resolve(work, runs, *a))
    memory, sharded = both(tmp_path, MANY_RUNS, batch_docs=3)
    assert sharded == memory
    (runs,), ((got, records, files),) = given, seen
    kinds = [dedup._kind(r) for r in runs]
    assert kinds.count("pairs") > 4 and kinds.count("members") > 16, kinds
    assert sorted(dedup._kind(r) for r in got) == ["members", "members", "pairs", "pairs"]
    assert any("-merged-03-" in r for r in got)  # members: four levels
    # every level's inputs deleted; the merged runs hold every record, each sorted by document
    assert [f for f in files if f.startswith(("pairs-", "members-"))] == sorted(os.path.basename(r) for r in got)
    for kind, dtype, doc in (("pairs", dedup.PAIR, "j"), ("members", dedup.MEMBER, "doc")):
        merged = [x for r, x in zip(got, records) if dedup._kind(r) == kind]
        assert sum(len(x) for x in merged) > 4 and all((np.diff(x[doc]) >= 0).all() for x in merged)
        assert all(x.dtype == dtype for x in merged)


def test_the_decision_pass_keeps_few_files_open_however_many_runs(tmp_path, monkeypatch):
    """Each mapped run holds a file descriptor: without the merge, a run per
    document's pairs (80 of them here) passes a limit of 40 more open files."""
    import resource

    monkeypatch.setattr(dedup, "PAIRS_PER_RUN", 1)
    monkeypatch.setattr(dedup, "MERGE_RUNS", 8)
    for way in ("memory", "sharded"):
        (tmp_path / way).mkdir()
    texts = [prose(150, seed=1000 + k) + end for k in range(80) for end in ("", " tail")]
    memory = outputs(tmp_path / "memory", texts, batch_docs=3)
    assert memory[1]["dropped"]["near_duplicate"] == 80
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 40, hard))
    try:
        sharded = outputs(tmp_path / "sharded", texts, batch_docs=3,
                          dedup={"method": "sharded", "partition_docs": 3})
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert sharded == memory


def test_a_run_missing_where_the_decision_pass_runs_stops_in_one_line(tmp_path):
    work = dedup.WorkDir(tmp_path / "w", num_docs=3, num_perm=8, bands=2, partition_docs=100)
    work.root.mkdir()
    np.full(3, dedup.CANDIDATE, np.uint8).tofile(work.state_path)
    with pytest.raises(dedup.DedupError, match=r"pairs-0000-00000-0000.npy is missing on .*, where a dedup step "
                                               r"ran; dedup.method: sharded on a Ray cluster needs"):
        dedup.resolve(work, [str(work.pairs_path(0, 0, 0))], 0.8, ids_wanted=1)


@pytest.mark.parametrize("order", [1, -1])
def test_decisions_do_not_depend_on_the_order_of_the_runs(tmp_path, monkeypatch, order):
    monkeypatch.setattr(dedup, "PAIRS_PER_RUN", 1)
    resolve = dedup.resolve
    monkeypatch.setattr(dedup, "resolve", lambda work, runs, *a: resolve(work, runs[::order], *a))
    memory, sharded = both(tmp_path, PLANTED)
    assert sharded == memory


def test_each_dedup_pass_can_be_off(tmp_path):
    for exact, near in ((False, True), (True, False), (False, False)):
        d = tmp_path / f"{exact}-{near}"
        d.mkdir()
        memory, sharded = both(d, PLANTED, exact_dedup={"enabled": exact}, near_dedup={"enabled": near})
        assert sharded == memory


def test_the_workers_read_the_input_in_tasks_that_need_not_match_the_runs(tmp_path, monkeypatch):
    """Pass 1 reads ranges of row groups (here of 3 rows: test_clean's
    write_docs; those of more than task_bytes in parts), pass 2 whole runs up
    to a read unit's end, at most TASK_RUNS (here 1 and 2) of them; the pieces
    the stage writes are still the runs of the in-memory method, so every
    byte is the same."""
    texts = PLANTED * 2 + [prose(80, seed=s) for s in range(20, 40)]
    calls = {"spill_rows": [], "cut_rows": []}
    for name, rows in (("spill_rows", slice(1, 3)), ("cut_rows", slice(0, 2))):  # the (start, stop) arguments
        real = getattr(clean, name)
        monkeypatch.setattr(clean, name, lambda *a, real=real, name=name, rows=rows:
                            calls[name].append(tuple(a[rows])) or real(*a))
    for task_runs in (1, 2):
        monkeypatch.setattr(clean, "TASK_RUNS", task_runs)
        for v in calls.values():
            v.clear()
        (tmp_path / str(task_runs)).mkdir()
        memory, sharded = both(tmp_path / str(task_runs), texts, batch_docs=4, task_bytes=900, shard_bytes=2500)
        assert sharded == memory and len(sharded[-1]) > 3
        for tasks in calls.values():  # each pass's tasks cover the input once, in order
            assert tasks[0][0] == 0 and tasks[-1][1] == len(texts) and len(tasks) > 5
            assert [b for _, b in tasks[:-1]] == [a for a, _ in tasks[1:]]
        assert calls["cut_rows"] != calls["spill_rows"]


def test_a_large_row_group_is_read_in_parts(tmp_path, monkeypatch):
    """An input of one row group, fewer than the tasks the workers want: pass 1
    reads it in parts, each decoding the group up to its end; the same bytes
    as the in-memory method."""
    texts = PLANTED * 2 + [prose(80, seed=s) for s in range(20, 40)]
    seen = []
    real = clean.spill_rows
    monkeypatch.setattr(clean, "spill_rows", lambda work, a, b: seen.append((a, b)) or real(work, a, b))
    monkeypatch.setattr(test_clean, "write_docs", lambda path, t: write_docs(path, t, row_group_size=len(t)))
    memory, sharded = both(tmp_path, texts, batch_docs=4, task_bytes=900, shard_bytes=2500)
    assert sharded == memory
    # one worker, one row group: TASKS_PER_WORKER parts
    assert len(seen) == TASKS_PER_WORKER < SPLIT and seen[0][0] == 0 and seen[-1][1] == len(texts)


def test_read_units_and_the_tasks_of_both_passes():
    groups = np.array([0, 10, 20, 50, 100])
    ends = np.array([3, 6, 9, 12, 25, 30, 35, 40, 60, 100])
    assert list(clean._pass2_tasks(groups, ends, 0, 100)) == [(0, 12), (12, 25), (25, 60), (60, 100)]
    assert list(clean._pass2_tasks(groups, ends, 25, 40)) == [(25, 40)]  # a stop before the unit ends
    old, clean.TASK_RUNS = clean.TASK_RUNS, 2
    try:
        assert list(clean._pass2_tasks(groups, ends, 0, 100)) == [
            (0, 6), (6, 12), (12, 25), (25, 35), (35, 60), (60, 100)]
    finally:
        clean.TASK_RUNS = old
    # groups of at most 1000 bytes are read whole; one of 2500 in 2 parts; one of 10^6 in SPLIT (8) parts,
    # when the 5 groups (and an empty one) are fewer than TASKS_PER_WORKER (4) tasks for each of 3 workers
    starts, sizes = np.array([0, 10, 20, 50, 100, 100, 180]), np.array([500, 600, 2500, 100, 0, 10 ** 6])
    assert read_units(starts, sizes, 1000, workers=1)[0].tolist() == [0, 10, 20, 50, 100, 180]
    assert read_units(starts, sizes, 1000, workers=2)[0].tolist() == [0, 10, 20, 35, 50, 100, 140, 180]
    bounds, sizes = read_units(starts, sizes, 1000, workers=10)
    assert bounds.tolist() == [0, 10, 20, 35, 50, 100, 110, 120, 130, 140, 150, 160, 170, 180]  # no empty unit
    assert sizes.tolist() == [500, 600, 1250, 1250, 100] + [125_000] * 8
    assert unit_tasks(bounds, sizes, 1000) == [(0, 20), (20, 35), (35, 50), (50, 110)] + [
        (a, a + 10) for a in range(110, 180, 10)]
    assert read_units(np.array([0, 3]), np.array([10 ** 6]), 1, 4)[0].tolist() == [0, 1, 2, 3]  # a part a row


def test_a_worker_reads_the_input_only_if_it_is_the_one_the_stage_read(tmp_path):
    """As on a Ray node without the stage's storage, or with a stale view of it:
    one line, not rows read from another file."""
    path = write_docs(tmp_path / "in.parquet", PLANTED)
    table = clean._open_input(path)
    for seen, why in [
        (identity(table), None),
        ([[str(path), 1, 2]], rf"{path} is \d+ bytes, modified at \d+ ns here, not as the stage saw it"),
        (identity(table) * 2, r"1 file\(s\) here, 2 for the stage"),
    ]:
        clean._init_worker(cfg(dedup={"method": "sharded"}), (str(path), seen))
        if why is None:
            assert clean._input().num_rows == len(PLANTED)
            continue
        with pytest.raises(dedup.DedupError, match=rf"^the clean input {path} is not readable as the stage read it "
                                                   rf"on \S+, where a dedup task ran \({why}\); dedup.method: "
                                                   r"sharded on a Ray cluster needs the input and output folders"):
            clean._input()
    clean._init_worker(cfg(), (str(tmp_path / "gone.parquet"), []))
    with pytest.raises(dedup.DedupError, match=r"\(CleanError: documents not found: .*gone.parquet"):
        clean._input()


def test_work_folder_is_removed(tmp_path):
    both(tmp_path, PLANTED)
    assert sorted(p.name for p in (tmp_path / "sharded" / "out").iterdir()) == [
        "docs", "quarantine.jsonl", "report.json"]
    assert sorted(p.name for p in (tmp_path / "sharded" / "out" / "docs").iterdir()) == [
        "decisions-00000.json", "decisions-00000.u8", "manifest.json", "shard-00000.json", "shard-00000.parquet"]


def test_sketch_batch_is_process_batch_as_arrays():
    """Pass 1 of the sharded method gets, as arrays, what the in-memory method
    gets per document: the state (the k-th enabled filter's code, or a candidate
    with a signature), the digest, the signature and the changed count."""
    clean._init_worker(cfg())
    texts = PLANTED + [None]  # and a null text (too short)
    chunks = [False] * len(texts)
    chunks[13] = True  # a chunk of a text keeps its blank edges
    per_doc = clean.process_batch(texts, chunks)
    sk = clean.sketch_batch(texts, chunks)
    names = [name for name, _, _ in clean._worker["filters"]]
    assert sk.changed == sum(r[3] for r in per_doc) > 0
    assert sk.filtered == [(k, r[1], r[2]) for k, r in enumerate(per_doc) if r[1] is not None]
    assert len({r[1] for r in per_doc if r[1]}) >= 2  # two different filters fired
    for k, (_, reason, _, _, digest, mh, _) in enumerate(per_doc):
        if reason is not None:
            assert sk.states[k] == dedup.FILTERED + names.index(reason)
            continue
        assert sk.digests[k].tobytes() == digest
        assert sk.states[k] == (dedup.CANDIDATE if mh is not None else dedup.KEEP)
        assert sk.sigs[k].tolist() == (mh.digest() if mh is not None else [0] * sk.sigs.shape[1])
    clean._init_worker(cfg(near_dedup={"enabled": False}))
    assert clean.sketch_batch(texts).sigs is None


def test_exact_partition_keeps_the_first_of_each_digest(tmp_path):
    work = dedup.WorkDir(tmp_path / "w", num_docs=6, num_perm=8, bands=2, partition_docs=100)
    writer = dedup.SignatureWriter(work, exact=True, near=False)
    d1, d2 = [np.frombuffer(bytes(range(k, 16 + k)), "<u8") for k in (0, 1)]
    # Document 2 is filtered (its digest row is ignored): 5 is the second of d2, not the third.
    writer.add(np.array([dedup.KEEP, dedup.CANDIDATE, dedup.FILTERED], np.uint8), np.stack([d2, d1, d2]), None)
    writer.add(np.zeros(3, np.uint8), np.stack([d1, d2, d2]), None)
    writer.close()
    assert dedup.exact_partition(work, 0, writer.size(work.exact_path(0))).tolist() == [3, 4, 5]


def test_a_step_whose_work_file_is_not_the_one_written_stops_in_one_line(tmp_path):
    """As on a Ray node that does not mount the work folder: no records found must
    not read as no duplicates."""
    work = dedup.WorkDir(tmp_path / "w", num_docs=2, num_perm=8, bands=2, partition_docs=100)
    writer = dedup.SignatureWriter(work, exact=True, near=True)
    d = np.frombuffer(bytes(range(16)), "<u8")
    writer.add(np.array([dedup.CANDIDATE] * 2, np.uint8), np.stack([d, d]), np.ones((2, 8), np.uint32))
    writer.close()
    exact, band = work.exact_path(0), work.band_path(0, 0)
    sizes = writer.size(exact), writer.size(band)
    assert sizes == (2 * dedup.EXACT_RECORD.itemsize, 2 * dedup.BAND_RECORD.itemsize)
    assert dedup.exact_partition(work, 0, sizes[0]).tolist() == [1]
    assert len(dedup.band_pairs(work, 0, 0, sizes[1])) == 1  # one run: the pair (1, 0)
    assert dedup.exact_partition(work, 1, 0).tolist() == []  # a partition the stage wrote nothing to
    with open(exact, "ab") as f:
        f.write(b"\0" * dedup.EXACT_RECORD.itemsize)
    with pytest.raises(dedup.DedupError, match=r"^the dedup work file .*exact-00000.bin is 72 bytes, not the 48 "
                                               r"the stage wrote, on .*, where a dedup task ran; dedup.method: "
                                               r"sharded on a Ray cluster needs the output folder on storage"):
        dedup.exact_partition(work, 0, sizes[0])
    band.unlink()
    with pytest.raises(dedup.DedupError, match=r"band-0000-00000.bin is missing on "):
        dedup.band_pairs(work, 0, 0, sizes[1])


def test_band_keys_are_equal_for_equal_bands_only():
    rng = np.random.default_rng(0)
    sigs = rng.integers(0, 2**32, size=(50, 16), dtype=np.uint32)
    sigs[1, :8] = sigs[0, :8]
    keys = dedup.band_keys(sigs, 2)
    assert keys[0, 0] == keys[1, 0] and keys[0, 1] != keys[1, 1]
    assert len(np.unique(keys[:, 1])) == 50


def resolved(tmp_path, pairs, num_docs=3):
    work = dedup.WorkDir(tmp_path / "w", num_docs=num_docs, num_perm=128, bands=16, partition_docs=100)
    work.root.mkdir()
    np.full(num_docs, dedup.CANDIDATE, np.uint8).tofile(work.state_path)
    run_file = work.root / "pairs.npy"
    np.save(run_file, np.array(sorted(pairs), dtype=dedup.PAIR))
    res = dedup.resolve(work, [str(run_file)], 0.8, ids_wanted=10)
    return res, work.state().tolist()


def test_resolve_is_greedy_in_document_order(tmp_path):
    # 0~1 and 1~2 but not 0~2: 1 goes, and 2 stays since its only match is gone.
    res, state = resolved(tmp_path, [(1, 0, 110), (2, 0, 50), (2, 1, 110)])
    assert state == [dedup.CANDIDATE, dedup.NEAR, dedup.CANDIDATE]
    assert (res["candidates_checked"], res["candidates_below_threshold"]) == (2, 1)
    assert res["detail"] == {1: (110 / 128, 0)}


def test_resolve_names_the_best_match_and_the_earliest_on_a_tie(tmp_path):
    res, _ = resolved(tmp_path, [(3, 0, 105), (3, 1, 120), (3, 2, 120)], num_docs=4)
    assert res["detail"] == {3: (120 / 128, 1)}


def test_a_killed_runs_work_folder_is_removed_by_the_next_run(tmp_path):
    out = tmp_path / "sharded" / "out"
    stale, live = out / ".dedup-999999999", out / f".dedup-{os.getppid()}"
    for d in (stale, live):
        d.mkdir(parents=True)
        (d / "state.u8").write_bytes(b"\0")
    both(tmp_path, PLANTED)
    assert not stale.exists() and (live / "state.u8").exists()  # a running process's folder is left alone


def test_exact_duplicates_need_the_whole_128_bit_digest_equal(tmp_path):
    """Digests equal in their first 64 bits only are different documents: among some 2**32 documents two
    share a 64-bit prefix by chance, and each such pair would drop a distinct document."""
    work = dedup.WorkDir(tmp_path / "w", num_docs=3, num_perm=8, bands=2, partition_docs=100)
    writer = dedup.SignatureWriter(work, exact=True, near=False)
    digests = np.array([[7, 1], [7, 2], [7, 1]], "<u8")
    writer.add(np.zeros(3, np.uint8), digests, None)
    writer.close()
    assert dedup.exact_partition(work, 0, writer.size(work.exact_path(0))).tolist() == [2]


def test_a_match_at_exactly_the_threshold_is_a_near_duplicate(tmp_path):
    """96 of 128 equal slots is an estimated Jaccard of exactly 0.75: at the threshold, so dropped."""
    work = dedup.WorkDir(tmp_path / "w", num_docs=3, num_perm=128, bands=16, partition_docs=100)
    work.root.mkdir()
    np.full(3, dedup.CANDIDATE, np.uint8).tofile(work.state_path)
    np.save(work.root / "pairs.npy", np.array([(1, 0, 96), (2, 0, 95)], dtype=dedup.PAIR))
    res = dedup.resolve(work, [str(work.root / "pairs.npy")], 0.75, ids_wanted=10)
    assert work.state().tolist() == [dedup.CANDIDATE, dedup.NEAR, dedup.CANDIDATE]
    assert res["detail"] == {1: (0.75, 0)} and res["candidates_below_threshold"] == 1


def test_documents_with_no_shingles_are_not_counted_in_the_near_index(tmp_path):
    """With too_short off, empty documents pass the filters but have no words, so no MinHash: kept, and
    not in the near-dedup index, by either method. The first is kept, the second an exact duplicate."""
    memory, sharded = both(tmp_path, PLANTED[:5] + ["", ""], filters={"too_short": {"enabled": False}})
    assert sharded == memory
    assert memory[0]["docs"] == 4  # 0, 1, 4 and the first empty one
    assert memory[1]["near_dedup"]["kept_in_index"] == 3  # 0, 1 and 4: 2 is a near duplicate of 0, 3 a copy of 1


def _written(tmp_path, sigs, states=None):
    """A work folder with the step-1 files of ``sigs`` (num_perm 8, 2 bands, one partition)."""
    work = dedup.WorkDir(tmp_path / "w", num_docs=len(sigs), num_perm=8, bands=2, partition_docs=1000)
    writer = dedup.SignatureWriter(work, exact=False, near=True)
    writer.add(np.full(len(sigs), dedup.CANDIDATE, np.uint8) if states is None else states, None, sigs)
    writer.close()
    return work, writer


def test_band_keys_differ_when_only_the_last_slot_of_a_band_does():
    sigs = np.random.default_rng(2).integers(0, 2**32, size=(2, 8), dtype=np.uint32)
    sigs[1] = sigs[0]
    sigs[1, 3] += 1  # the last slot of band 0
    keys = dedup.band_keys(sigs, 2)
    assert keys[0, 0] != keys[1, 0] and keys[0, 1] == keys[1, 1]


def test_only_candidates_get_band_records(tmp_path):
    """A document without a signature (KEEP: no shingles) is in no band bucket: its zero row is not a band."""
    sigs = np.zeros((3, 8), np.uint32)
    work, writer = _written(tmp_path, sigs, np.array([dedup.KEEP, dedup.CANDIDATE, dedup.KEEP], np.uint8))
    band = np.fromfile(work.band_path(0, 0), dedup.BAND_RECORD)
    assert band["doc"].tolist() == [1] and writer.size(work.band_path(1, 0)) == dedup.BAND_RECORD.itemsize


def test_a_pair_equal_in_two_bands_is_written_by_the_first_only(tmp_path):
    sigs = np.random.default_rng(3).integers(0, 2**32, size=(2, 8), dtype=np.uint32)
    sigs[1] = sigs[0]
    work, writer = _written(tmp_path, sigs)
    runs = [[np.load(r).tolist() for r in dedup.band_pairs(work, b, 0, writer.size(work.band_path(b, 0)))]
            for b in range(2)]
    assert runs == [[[(1, 0, 8)]], []]


def test_a_band_key_collision_with_some_slots_equal_makes_no_pair(tmp_path, monkeypatch):
    """Two bands under one key that agree in three of four slots are not equal bands."""
    monkeypatch.setattr(dedup, "band_keys", lambda sigs, bands: np.zeros((len(sigs), bands), np.uint64))
    sigs = np.random.default_rng(4).integers(0, 2**32, size=(2, 8), dtype=np.uint32)
    sigs[1, :3] = sigs[0, :3]
    work, writer = _written(tmp_path, sigs)
    assert dedup.band_pairs(work, 0, 0, writer.size(work.band_path(0, 0))) == []


def test_a_range_may_hold_exactly_resolve_pairs_records(monkeypatch):
    monkeypatch.setattr(dedup, "RESOLVE_PAIRS", 4)
    pairs = np.array([(j, 0, 1) for j in range(1, 5)], dedup.PAIR)
    assert list(dedup.resolve_ranges([pairs], 5)) == [(0, 5)]


def test_a_tie_between_a_pair_and_a_large_bucket_names_the_earliest(tmp_path, monkeypatch):
    """Document 2 matches 1 (by a pair: band 0 equal, a bucket of two) and 0 (by
    its large bucket of band 1, with 0 and 3) in 7 of 8 slots each: 0 is named,
    though the pair is found first."""
    monkeypatch.setattr(dedup, "LARGE_BUCKET", 2)
    sigs = np.random.default_rng(5).integers(0, 2**32, size=(4, 8), dtype=np.uint32)
    sigs[1, :7] = sigs[2, :7]  # band 0 and three slots of band 1
    sigs[0, :3] = sigs[2, :3]
    sigs[0, 4:] = sigs[2, 4:]  # three slots of band 0 and band 1
    sigs[3, 4:] = sigs[2, 4:]
    work, writer = _written(tmp_path, sigs)
    runs = [r for b in range(2) for r in dedup.band_pairs(work, b, 0, writer.size(work.band_path(b, 0)))]
    assert sorted(os.path.basename(r)[:8] for r in runs) == ["members-", "pairs-00"]
    res = dedup.resolve(work, runs, 0.8, ids_wanted=10)
    assert res["detail"] == {2: (7 / 8, 0)}
    assert work.state().tolist() == [dedup.CANDIDATE, dedup.CANDIDATE, dedup.NEAR, dedup.CANDIDATE]


def test_the_large_buckets_let_go_of_a_kept_member_when_its_last_bucket_closes():
    large = dedup._LargeBuckets()
    sig = np.arange(8, dtype=np.uint32)
    large.keep(5, sig, [(0, 1), (1, 1)])
    large.close((0, 1))
    assert large.candidates([(1, 1)], {}) == [5] and 5 in large.sig
    large.close((1, 1))
    assert large.sig == {} and large.listed == {} and large.kept == {}


def test_the_work_folder_of_a_run_with_large_buckets_and_merges_is_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(dedup, "LARGE_BUCKET", 1)
    monkeypatch.setattr(dedup, "MERGE_RUNS", 2)
    both(tmp_path, MANY_RUNS, batch_docs=3)
    assert not [p for p in (tmp_path / "sharded" / "out").iterdir() if p.name.startswith(".dedup-")]


def test_the_work_folder_of_another_users_live_process_is_left_alone(tmp_path, monkeypatch):
    def kill(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    (tmp_path / ".dedup-4242").mkdir()
    (tmp_path / ".dedup-4242" / "state.u8").write_bytes(b"\0")
    monkeypatch.setattr(os, "kill", kill)
    assert dedup.remove_stale(tmp_path, ".dedup-") == []
    assert (tmp_path / ".dedup-4242" / "state.u8").exists()



def test_work_folder_names_that_no_process_can_have_do_not_stop_the_run(tmp_path):
    """A number past any pid (os.kill raised OverflowError) is no live process's: removed as stale, a
    user's file in it kept; a name of other digits than 0-9 is no name a run makes: left alone."""
    for name in (".dedup-99999999999999999999", ".dedup-²"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.u8").write_bytes(b"\0")
    (tmp_path / ".dedup-99999999999999999999" / "notes.txt").write_text("mine")
    assert dedup.remove_stale(tmp_path, ".dedup-") == [tmp_path / ".dedup-99999999999999999999"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == [
        ".dedup-99999999999999999999", ".dedup-²", "notes.txt", "state.u8"]


def test_removing_a_work_folder_touches_only_what_a_stage_makes(tmp_path):
    """A link named as a dead run's work folder is not followed into the user's folder it points to, and a
    user's subfolder named as a work file is not a work file: both left, and neither stops the run."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "state.u8").write_bytes(b"user")
    (tmp_path / ".dedup-999999998").symlink_to(mine)
    stale = tmp_path / ".dedup-999999999"
    (stale / "pairs-notes").mkdir(parents=True)
    (stale / "state.u8").write_bytes(b"\0")
    assert dedup.remove_stale(tmp_path, ".dedup-") == [stale]
    assert (mine / "state.u8").read_bytes() == b"user"
    assert sorted(p.name for p in stale.iterdir()) == ["pairs-notes"]


def test_the_driver_writes_the_partition_files_once_it_holds_flush_bytes(tmp_path, monkeypatch):
    """Step 1's records reach the disk as the batches come, not all at close: the driver's memory is bounded."""
    monkeypatch.setattr(dedup, "FLUSH_BYTES", 2 * dedup.EXACT_RECORD.itemsize)
    work = dedup.WorkDir(tmp_path / "w", num_docs=4, num_perm=8, bands=2, partition_docs=100)
    writer = dedup.SignatureWriter(work, exact=True, near=False)
    digests = np.arange(4, dtype="<u8").reshape(2, 2)
    writer.add(np.zeros(1, np.uint8), digests[:1], None)
    assert not work.exact_path(0).exists()  # 24 bytes held
    writer.add(np.zeros(1, np.uint8), digests[1:], None)
    assert work.exact_path(0).stat().st_size == 2 * dedup.EXACT_RECORD.itemsize
    writer.close()


def test_a_killed_run_of_the_same_pid_leaves_nothing_the_next_run_reads(tmp_path):
    """A restarted container (after an OOM kill, a SIGKILL) gives the stage the pid it had: the work folder
    it finds under its own name is a dead run's, whose partition files it must not append to."""
    own = tmp_path / "sharded" / "out" / f".dedup-{os.getpid()}"
    own.mkdir(parents=True)
    for name in ("state.u8", "signatures.u32", "exact-00000.bin", "band-0000-00000.bin", "pairs-0000-00000-0000.npy"):
        (own / name).write_bytes(b"\1" * 48)
    memory, sharded = both(tmp_path, PLANTED)
    assert sharded == memory and not own.exists()


def test_a_short_state_or_signature_file_stops_a_step_in_one_line(tmp_path):
    """As a partition file: a state or signature file of another size than the stage wrote (truncated, or a
    stale view of shared storage) is one line naming it, not a reshape or mmap traceback."""
    sigs = np.random.default_rng(6).integers(0, 2**32, size=(3, 8), dtype=np.uint32)
    sigs[1] = sigs[0]
    work, writer = _written(tmp_path, sigs)
    size = writer.size(work.band_path(0, 0))
    one_line = r" on \S+, where a dedup task ran; dedup.method: sharded on a Ray cluster needs"
    with open(work.state_path, "r+b") as f:
        f.truncate(2)
    with pytest.raises(dedup.DedupError, match=r"^the dedup work file \S+state.u8 is 2 bytes, not the 3 the stage "
                                               r"wrote," + one_line):
        dedup.band_pairs(work, 0, 0, size)
    with pytest.raises(dedup.DedupError, match=r"state.u8 is 2 bytes, not the 3"):
        dedup.mark(work, np.array([1]), dedup.EXACT)
    np.full(3, dedup.CANDIDATE, np.uint8).tofile(work.state_path)
    with open(work.sig_path, "r+b") as f:
        f.truncate(64)
    with pytest.raises(dedup.DedupError, match=r"^the dedup work file \S+signatures.u32 is 64 bytes, not the 96 the "
                                               r"stage wrote," + one_line):
        dedup.band_pairs(work, 0, 0, size)
    work.sig_path.unlink()
    with pytest.raises(dedup.DedupError, match=r"signatures.u32 is missing" + one_line):
        dedup.band_pairs(work, 0, 0, size)


@pytest.mark.parametrize("keep", [0, 30, -5])  # empty, a cut header, a cut record
def test_a_truncated_run_stops_the_decision_pass_in_one_line(tmp_path, keep):
    work = dedup.WorkDir(tmp_path / "w", num_docs=3, num_perm=8, bands=2, partition_docs=100)
    work.root.mkdir()
    np.full(3, dedup.CANDIDATE, np.uint8).tofile(work.state_path)
    run_file = work.pairs_path(0, 0, 0)
    np.save(run_file, np.array([(1, 0, 8), (2, 0, 8)], dedup.PAIR))
    run_file.write_bytes(run_file.read_bytes()[:keep])
    with pytest.raises(dedup.DedupError, match=r"^the dedup work file \S+pairs-0000-00000-0000.npy is unreadable "
                                               r"\(.+\) on \S+, where a dedup step ran; dedup.method: sharded"):
        dedup.resolve(work, [str(run_file)], 0.8, ids_wanted=1)


@pytest.mark.skipif(dedup._started(os.getpid()) is None, reason="no /proc: the pid alone tells")
def test_a_work_folder_whose_pid_names_another_process_now_is_stale(tmp_path):
    """A killed run's pid given again to a process that started since (after a reboot, say): its folder is
    removed; the folder of the process that made it and runs is kept."""
    reused, live = tmp_path / f".dedup-{os.getppid()}", tmp_path / f".dedup-{os.getpid()}"
    for d, started in ((reused, "12"), (live, dedup._started(os.getpid()))):
        d.mkdir()
        (d / "state.u8").write_bytes(b"\0")
        (d / dedup.OWNER).write_text(started)
    assert dedup.remove_stale(tmp_path, ".dedup-") == [reused]
    assert sorted(p.name for p in live.iterdir()) == ["owner", "state.u8"]
    work = dedup.WorkDir(tmp_path / "w", num_docs=1, num_perm=8, bands=2, partition_docs=100)
    dedup.SignatureWriter(work, exact=True, near=False).close()
    assert (work.root / dedup.OWNER).read_text() == dedup._started(os.getpid())


@pytest.mark.skipif(dedup._started(os.getpid()) is None, reason="no /proc: the pid alone tells")
def test_a_process_start_is_the_one_the_kernel_gives_and_is_checked_for_another_users_pid(tmp_path, monkeypatch):
    import psutil

    for pid in (os.getpid(), os.getppid()):
        at = int(dedup._started(pid)) / os.sysconf("SC_CLK_TCK") + psutil.boot_time()
        assert abs(at - psutil.Process(pid).create_time()) < 1
    d = tmp_path / ".dedup-4242"
    d.mkdir()
    (d / dedup.OWNER).write_text("12")

    def kill(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", kill)
    monkeypatch.setattr(dedup, "_started", lambda pid: "13")
    assert dedup.remove_stale(tmp_path, ".dedup-") == [d]


def test_hostile_documents_each_leave_kept_or_dropped_with_a_reason_the_same_by_both_methods(tmp_path):
    """Blank, replacement-character, zero-width, one-line and NUL-laden documents, mixed scripts, and a
    document that is an exact duplicate of a near duplicate: each is accounted for, alike by both methods."""
    base, mixed = code(1), code(1) + " Привет мир 你好世界 مرحبا"
    texts = ["   \n\t \n  ", "\ufffd" * 200, "\u200b" * 50, "\u200b".join(base.split(" ")), mixed, "x" * 300_000,
             "a\x00b " * 100, base, base.replace("\n", "\r\n"), None, "", code(2), code(2) + "\u200b",
             code(3) + "\x00"]
    memory, sharded = both(tmp_path, texts)
    assert memory == sharded
    metrics, rep, docs, quarantine, _, _ = memory
    assert [(d["id"], d["text"]) for d in docs] == [("id004", mixed), ("id011", code(2)), ("id013", code(3))]
    assert [(q["reason"], q["detail"].split(":")[0]) for q in quarantine] == [
        ("too_short", "id id000"), ("gopher_mean_word_length", "id id001"), ("gopher_mean_word_length", "id id002"),
        ("gopher_mean_word_length", "id id003"), ("gopher_mean_word_length", "id id005"),
        ("gopher_mean_word_length", "id id006"), ("near_duplicate", "id id007"), ("exact_duplicate", "id id008"),
        ("too_short", "id id009"), ("too_short", "id id010"), ("near_duplicate", "id id012")]
    assert rep["docs_in"] == len(texts) == metrics["docs"] + sum(rep["dropped"].values())
