"""pipeline/data/remote.py: ingest reads ``s3://`` sources through pyarrow's S3
filesystem, tested against a real S3 server on 127.0.0.1 (moto's, started by
the module): the same documents, skips and quarantine as the same files on
local disk, in one process and with two workers that read the objects
themselves."""

import gzip
import json
import logging
import lzma
import os
import socket

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from moto import server as moto_server

from pipeline.config import ConfigError, parse_section
from pipeline.data import ingest, remote
from pipeline.data.ingest import IngestError, inputs_digest, resolve_sources, run_ingest
from pipeline.data.sft_data import SFTDataError, SFTSource
from tests.pipeline.data.test_ingest import cfg, compress, read_docs
from tests.pipeline.data.test_sft_data import build, read_split, three_formats, tok_path  # noqa: F401 - fixtures

BUCKET = "corpus-bucket"


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with an empty bucket; the AWS_* variables
    that point pyarrow (here and in worker processes) at it."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_EC2_METADATA_DISABLED": "true"}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    fs = pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"], allow_bucket_creation=True)
    fs.create_dir(BUCKET)
    try:
        yield fs
    finally:
        remote._FILESYSTEMS.clear()
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def upload(fs, folder, prefix):
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with fs.open_output_stream(f"{BUCKET}/{prefix}/{p.relative_to(folder).as_posix()}") as out:
                out.write(p.read_bytes())


def corpus(d):
    """Good and bad files of every format that a store can hold, compressed and not."""
    (d / "a" / "nested").mkdir(parents=True)
    for i in range(6):
        (d / "a" / f"good{i}.txt").write_text(f"document {i}\n\nsecond paragraph {i}\n")
    (d / "a" / "nested" / "deep.txt").write_text("deep down\n")
    (d / "a" / ".hidden.txt").write_text("never read\n")
    (d / "a" / "empty.txt").write_bytes(b"")
    (d / "a" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (d / "a" / "blob.txt").write_bytes(b"\x00\x01binary")
    (d / "rows.jsonl").write_text('{"text": "r1"}\n{"oops\n{"text": 3}\n{"text": "r2"}\n')
    compress(d / "rows.jsonl", "gzip")
    (d / "rows.jsonl").unlink()
    (d / "records.json").write_text(json.dumps({"data": [{"text": f"rec {i}"} for i in range(5)]}))
    compress(d / "records.json", "zstd")
    (d / "records.json").unlink()
    (d / "table.csv").write_text('text,n\n"a, quoted\nnewline",1\nplain,2\nshort\n')
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(9)]}), d / "table.parquet", row_group_size=4)
    (d / "book.txt.xz").write_bytes(lzma.compress("".join(f"line {i} of the book\n" for i in range(60)).encode()))
    whole = gzip.compress("".join(f'{{"text": "line {i} {"x" * 200}"}}\n' for i in range(3000)).encode())
    (d / "cut.jsonl.gz").write_bytes(whole[:len(whole) * 2 // 3])  # an interrupted upload


def sources(base):
    return [{"path": f"{base}/a/**/*.txt", "split_by": "paragraph", "name": "text"},
            {"path": f"{base}/rows.jsonl.gz", "name": "rows"},
            {"path": f"{base}/records.json.zst", "name": "records"},
            {"path": f"{base}/table.csv", "name": "csv"},
            {"path": f"{base}/table.parquet", "name": "parquet"},
            {"path": f"{base}/book.txt.xz", "format": "text", "split_by": "chunk", "chunk_bytes": 200,
             "name": "book"},
            {"path": f"{base}/cut.jsonl.gz", "name": "cut"}]


def ingested(tmp_path, name, base, **kw):
    """What ingest made of ``sources(base)``, with ``base`` named BASE and the ids
    (a digest of the source's path) left out, so that two bases compare."""
    out = tmp_path / name
    metrics = run_ingest(cfg(sources=sources(base), max_bytes=None, **kw), out / "docs", out / "q.jsonl",
                         out / "report.json")
    docs = [{k: (v.replace(base, "BASE") if k == "source" else v) for k, v in row.items() if k != "id"}
            for row in read_docs(out / "docs").to_pylist()]
    quarantine = [json.loads(line.replace(base, "BASE")) for line in (out / "q.jsonl").read_text().splitlines()]
    for rec in quarantine:
        rec.pop("id", None)
    report = json.loads((out / "report.json").read_text())
    counts = {"docs": metrics["docs"], "bytes": metrics["bytes"], "files": metrics["files"],
              "skipped": report["skipped"], "docs_per_source": report["docs_per_source"]}
    return counts, docs, quarantine


@pytest.fixture(scope="module")
def stored(s3, tmp_path_factory):
    local = tmp_path_factory.mktemp("local") / "corpus"
    corpus(local)
    upload(s3, local, "corpus")
    return str(local), f"s3://{BUCKET}/corpus"


def test_s3_sources_give_what_the_same_local_files_give(stored, tmp_path, caplog):
    local, url = stored
    here = ingested(tmp_path, "local", local, executor={"num_workers": 1})
    counts, docs, quarantine = here
    assert counts["skipped"] == {"empty_file": 1, "non_utf8": 1, "binary": 1, "malformed_json": 1,
                                 "bad_type": 1, "malformed_csv": 1, "unreadable": 1}, counts
    assert {d["source_name"] for d in docs} == {"text", "rows", "records", "csv", "parquet", "book", "cut"}
    assert not any("hidden" in d["source"] for d in docs)
    assert ingested(tmp_path, "s3-one", url, executor={"num_workers": 1}) == here
    with caplog.at_level(logging.WARNING, logger="pipeline.data.ingest"):
        assert ingested(tmp_path, "s3-two", url, executor={"num_workers": 2}) == here
    assert "read by the stage itself" not in caplog.text  # the workers read the objects


@pytest.fixture(scope="module")
def ray_cluster(s3, ray_instance):
    """A Ray instance started after the AWS_* variables were set, which its
    workers inherit (a cluster's nodes need their own)."""
    return ray_instance.get_runtime_context().gcs_address


@pytest.mark.slow
def test_ray_workers_read_the_objects_themselves(stored, ray_cluster, tmp_path, caplog):
    local, url = stored
    here = ingested(tmp_path, "local", local, executor={"num_workers": 1})
    with caplog.at_level(logging.WARNING, logger="pipeline.data.ingest"):
        assert ingested(tmp_path, "ray", url, executor={"kind": "ray", "address": ray_cluster, "num_workers": 2}
                        ) == here
    assert "read by the stage itself" not in caplog.text


def test_a_worker_reads_an_object_only_if_it_is_the_one_the_stage_listed(stored, s3):
    _, url = stored
    ingest._init_reader(cfg(sources=[{"path": f"{url}/a/good1.txt", "split_by": "paragraph"}]))
    f, = resolve_sources(ingest._WORKER["cfg"])
    st = f.path.stat()
    seen = (st.st_size, st.st_mtime_ns)
    assert [item.text for item in ingest._read_whole(f, seen)] == ["document 1", "second paragraph 1"]
    assert ingest._read_whole(f, (st.st_size + 1, st.st_mtime_ns)) == (
        f"{url}/a/good1.txt on {socket.gethostname()} is not the file the stage sees (size or modification time)")
    s3.delete_file(f"{BUCKET}/corpus/a/good1.txt")
    try:
        assert ingest._read_whole(f, seen).endswith(" (FileNotFoundError)")
    finally:
        with s3.open_output_stream(f"{BUCKET}/corpus/a/good1.txt") as out:
            out.write(b"document 1\n\nsecond paragraph 1\n")


def test_a_rerun_keeps_the_shards_of_unchanged_objects_and_not_of_changed_ones(s3, tmp_path):
    """Per-shard resume over a store: a rerun on the same objects keeps every
    shard; one after an object changed keeps none, and gives what a fresh run
    gives."""
    for i in range(6):
        with s3.open_output_stream(f"{BUCKET}/resume/t{i}.txt") as out:
            out.write(f"paragraph {i}\n\n".encode() * 40)
    sources = [{"path": f"s3://{BUCKET}/resume/*.txt", "split_by": "paragraph"}]

    def run(out, **kw):
        return run_ingest(cfg(sources=sources, shard_bytes=500, row_group_bytes=100, **kw), out / "docs",
                          out / "q.jsonl", out / "report.json")

    first = run(tmp_path / "a")
    again = run(tmp_path / "a")
    assert first["shards"] > 2 and again["shards_resumed"] == first["shards"]
    with s3.open_output_stream(f"{BUCKET}/resume/t3.txt") as out:
        out.write(b"rewritten\n")
    changed = run(tmp_path / "a")
    assert changed["shards_resumed"] == 0 and changed["docs"] < first["docs"]
    fresh = run(tmp_path / "b")
    assert read_docs(tmp_path / "a" / "docs") == read_docs(tmp_path / "b" / "docs")
    assert {k: v for k, v in changed.items() if k != "seconds"} == {k: v for k, v in fresh.items() if k != "seconds"}


def test_an_object_that_changes_changes_the_inputs_digest(s3):
    url = f"s3://{BUCKET}/digest/x.txt"
    with s3.open_output_stream(f"{BUCKET}/digest/x.txt") as out:
        out.write(b"one")
    files = resolve_sources(cfg(sources=[{"path": url}]))
    assert inputs_digest(resolve_sources(cfg(sources=[{"path": url}]))) == inputs_digest(files)
    with s3.open_output_stream(f"{BUCKET}/digest/x.txt") as out:
        out.write(b"three")
    assert inputs_digest(resolve_sources(cfg(sources=[{"path": url}]))) != inputs_digest(files)


@pytest.mark.parametrize("source, message", [
    ({"path": f"s3://{BUCKET}/corpus/nothing/*.txt"}, r"ingest\.sources\.0\.path: 's3://corpus-bucket/corpus/"
                                                       r"nothing/\*\.txt' matched no files"),
    ({"path": f"s3://{BUCKET}/corpus/none.txt"}, r"no such file or folder: 's3://corpus-bucket/corpus/none.txt'"),
    ({"path": f"s3://{BUCKET}/corpus", "format": "hf"}, r"format hf reads a local dataset folder or a dataset name"),
    ({"path": "s3://no-such-bucket/x.jsonl"}, r"no such file or folder: 's3://no-such-bucket/x.jsonl'"),
])
def test_a_url_that_names_nothing_readable_is_one_line(s3, stored, source, message):
    with pytest.raises(IngestError, match=message):
        resolve_sources(cfg(sources=[source]))


def test_other_urls_are_refused_before_any_work():
    with pytest.raises(ConfigError, match=r"a URL \(https://\), but inputs are read from this machine's filesystem "
                                          r"\(and from s3://, gs://, gcs://; "):
        cfg(sources=[{"path": "https://example.org/corpus.jsonl"}])


@pytest.mark.parametrize("path", ["s3://AKIAEXAMPLE:wJalrXUtnFEMI@corpus/x.jsonl", "gs://token@corpus/*.jsonl",
                                  "https://user:wJalrXUtnFEMI@example.org/x.jsonl"])
def test_a_url_with_credentials_in_it_is_refused_without_repeating_them(path):
    """pyarrow reads s3://key:secret@bucket; the URL would have gone to the
    logs, MLflow's params and every document's source column."""
    from pipeline.data.sft_data import SFTDataConfig

    for parse in (lambda: cfg(sources=[{"path": path}]),
                  lambda: parse_section(SFTDataConfig, {"sources": [{"path": path}]}, "sft.data")):
        with pytest.raises(ConfigError) as e:
            parse()
        [line] = str(e.value).splitlines()[1:]
        host = path.split("@")[1].split("/")[0]
        assert line.endswith(f".sources.0.path: a URL with credentials in it ({path.split('://')[0]}://…@{host}), "
                             "which would be written to the logs, to MLflow and to every document's source; remove "
                             "them and give them the store's own way (for S3 the AWS_ACCESS_KEY_ID and "
                             "AWS_SECRET_ACCESS_KEY variables, ~/.aws or the machine's role; for GCS the application "
                             "default credentials)"), line
        assert "wJalr" not in str(e.value) and "token" not in str(e.value) and "AKIA" not in str(e.value)


@pytest.mark.parametrize("path, what", [("s3://", "no bucket name"), ("s3:///x.jsonl", "no bucket name"),
                                        ("S3:///x", "no bucket name"),
                                        ("gs://:8080/x", "':8080' is not a bucket name"),
                                        ("s3://corpus-*/x", "'corpus-\\*' is not a bucket name")])
def test_a_store_url_without_a_bucket_is_refused_before_any_work(path, what):
    """s3:///x was a pyarrow ArrowInvalid traceback; s3:// listed every bucket the credentials reach."""
    with pytest.raises(ConfigError, match=rf"ingest\.sources\.0\.path: (s3|gs|S3):// and then {what}"):
        cfg(sources=[{"path": path}])


def test_a_store_url_with_an_empty_folder_name_is_refused_before_any_work():
    """pyarrow refuses a key with an empty part: s3://b/a//x.txt was an ArrowInvalid traceback."""
    with pytest.raises(ConfigError, match=r"ingest\.sources\.0\.path: an empty folder name \('//'\), which pyarrow "
                                          r"cannot read in a store: write one '/' \(got 's3://b/a//x\.txt'\)$"):
        cfg(sources=[{"path": "s3://b/a//x.txt"}])


def test_a_key_pyarrow_refuses_at_listing_is_one_line(monkeypatch):
    def refused(uri):
        raise pa.ArrowInvalid("Empty path component in path b/a//x.txt")

    monkeypatch.setattr(remote, "list_files", refused)
    with pytest.raises(IngestError, match=r"^where: cannot list 's3://b/a//x\.txt': Empty path component in path "
                                          r"b/a//x\.txt$"):
        remote.listed("s3://b/a//x.txt", "where", IngestError)


def test_a_store_url_with_a_bucket_and_a_local_path_pass_as_they_are():
    for path in ("s3://my-bucket.v2/a/**/*.jsonl.gz", "gs://b_1/x", "GCS://B/x", "data/raw/x.txt", "s3:/x",
                 "data//raw/x.txt"):
        assert remote.check_url(path) == path


def test_sft_sources_in_a_store_give_the_examples_of_the_files_on_disk(s3, tmp_path, tok_path, three_formats):
    """A folder of chat files in S3 (with a hidden file and a file of another
    kind, which a folder source leaves out), a glob, and one file."""
    names = ("alpaca.ndjson", "messages.jsonl", "sharegpt.json")
    upload(s3, three_formats, "chat")
    for name, data in ((".hidden.jsonl", b"{broken"), ("notes.txt", b"not chat")):
        with s3.open_output_stream(f"{BUCKET}/chat/{name}") as out:
            out.write(data)
    want, m_want = build(tmp_path, tok_path, "disk", sources=[SFTSource(path=str(three_formats / n)) for n in names])
    same = lambda m: {k: v for k, v in m.items() if k != "sources"}  # sources: by path
    for name, path in (("folder", f"s3://{BUCKET}/chat"), ("glob", f"s3://{BUCKET}/chat/*.*json*")):
        got, m_got = build(tmp_path, tok_path, name, sources=[SFTSource(path=path)])
        assert same(m_got) == same(m_want) and m_got["examples_in"] == 30 and m_got["skipped"] == {}, name
        assert list(m_got["sources"]) == [path] and m_got["sources"][path]["records"] == 30
        for split in ("train", "val"):
            (ids, labels, starts), (ids0, labels0, starts0) = read_split(got, split), read_split(want, split)
            assert (ids.tolist(), labels.tolist(), starts) == (ids0.tolist(), labels0.tolist(), starts0), name
    _, m_one = build(tmp_path, tok_path, "one", sources=[SFTSource(path=f"s3://{BUCKET}/chat/messages.jsonl")])
    assert m_one["examples_in"] == 10
    with s3.open_output_stream(f"{BUCKET}/chat/.named.jsonl") as out:  # a hidden file named as such is read
        out.write((three_formats / "messages.jsonl").read_bytes())
    _, m_named = build(tmp_path, tok_path, "named", sources=[SFTSource(path=f"s3://{BUCKET}/chat/.named.jsonl")])
    assert m_named["examples_in"] == 10
    with pytest.raises(SFTDataError, match=r"'s3://corpus-bucket/chat/notes.txt' is not .json, .jsonl or .ndjson"):
        build(tmp_path, tok_path, "bad", sources=[SFTSource(path=f"s3://{BUCKET}/chat/*.txt")])
    with pytest.raises(SFTDataError, match=r"sources.0.path: no such file or folder: 's3://corpus-bucket/nochat'"):
        build(tmp_path, tok_path, "none", sources=[SFTSource(path=f"s3://{BUCKET}/nochat")])


@pytest.mark.parametrize("pattern, path, matches", [
    ("a/**/*.txt", "a/x.txt", True),
    ("a/**/*.txt", "a/b/c/x.txt", True),
    ("a/**/*.txt", "b/x.txt", False),
    ("a/**/*.txt", "a/x.txt.gz", False),
    ("a/**/x.txt", "a/x.txt", True),
    ("a/**/x.txt", "a/bx.txt", False),
    ("a/*.txt", "a/b/x.txt", False),
    ("a/?.txt", "a/x.txt", True),
    ("a/?.txt", "a/xy.txt", False),
    ("a/[!x]*.txt", "a/x.txt", False),
    ("a/[!x]*.txt", "a/y.txt", True),
    ("a/**", "a/b/c", True),
    ("a.b/*.txt", "aXb/x.txt", False),
    ("a/f[0-9].txt", "a/f5.txt", True),  # a range, as fnmatch reads it (it read as the three characters 0, - and 9)
    ("a/f[0-9].txt", "a/f-.txt", False),
    ("a/f[!0-9].txt", "a/f5.txt", False),
    ("a/f[!0-9].txt", "a/f-.txt", True),
    ("a/[!]x", "a/[!]x", True),  # no closing bracket: the characters themselves (it was a re.error)
    ("a/**", "a", False),
    ("a/*", "a/b/c", False),  # a key deeper than the pattern
])
def test_a_glob_over_keys_reads_as_python_s_recursive_glob(pattern, path, matches):
    assert remote._glob_matches(pattern.split("/"), path.split("/")) is matches


class Requests:
    """A store's filesystem that notes what each request asked and every name it returned."""

    def __init__(self, fs):
        self.fs, self.asked, self.returned = fs, [], []

    def __getattr__(self, name):
        return getattr(self.fs, name)

    def get_file_info(self, what):
        got = self.fs.get_file_info(what)
        self.asked.append((what.base_dir, what.recursive) if isinstance(what, pafs.FileSelector) else what)
        self.returned += [i.path for i in (got if isinstance(got, list) else [got])]
        return got


GLOBS = ["*/train.jsonl", "**/train.jsonl", "*/*.txt", "?/t*.jsonl", "[ab]/*", "a/**", "*/deep/**/*.txt", "*",
         "**", "*/sub/*.jsonl", "c/*/train.jsonl", "*/nothing/*", "*/deep/*/f?.txt", "*/deep/[p-z]/f[1-3].txt",
         "a/deep/*/f[!0-2].txt"]


@pytest.fixture(scope="module")
def walk(s3, tmp_path_factory):
    """A tree of folders, on disk and under s3://corpus-bucket/walk."""
    tree = tmp_path_factory.mktemp("walk")
    for name in ["a/train.jsonl", "b/train.jsonl", "b/other.txt", "c/sub/train.jsonl", ".h/train.jsonl", "x.txt",
                 *(f"a/deep/{d}/f{i}.txt" for d in "pq" for i in range(5))]:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(name)
    upload(s3, tree, "walk")
    return tree


@pytest.mark.parametrize("pattern", GLOBS)
def test_a_glob_lists_only_as_deep_as_it_reaches_and_matches_what_glob_matches_on_disk(walk, pattern):
    import glob

    on_disk = sorted(os.path.relpath(p, walk) for p in glob.glob(str(walk / pattern), recursive=True)
                     if os.path.isfile(p))
    requests = remote._FILESYSTEMS[f"s3://{BUCKET}"] = Requests(remote.filesystem(f"s3://{BUCKET}")[0])
    try:
        base, found = remote.list_files(f"s3://{BUCKET}/walk/{pattern}")
    finally:
        remote._FILESYSTEMS[f"s3://{BUCKET}"] = requests.fs
    prefix = f"s3://{BUCKET}/walk/"
    assert sorted(f.uri[len(prefix):] for f in found if not f.hidden_below(base)) == on_disk
    if "**" not in pattern:  # a folder level at a time: nothing below the pattern's depth is listed
        depth = pattern.count("/") + 1
        assert not any(what[1] for what in requests.asked if isinstance(what, tuple)), requests.asked
        assert all(p.count("/") - 1 <= depth for p in requests.returned), requests.returned  # bucket/walk/…
    if pattern == "*/train.jsonl":  # the top level listed, then one name asked of each folder
        assert requests.asked[0] == (f"{BUCKET}/walk", False)
        assert sorted(requests.asked[1:]) == sorted(f"{BUCKET}/walk/{d}/train.jsonl" for d in (".h", "a", "b", "c"))
    if pattern == "*/sub/*.jsonl":  # a name after a wildcard is not listed, only appended to each folder
        assert requests.asked[0] == (f"{BUCKET}/walk", False)
        assert sorted(requests.asked[1:]) == sorted((f"{BUCKET}/walk/{d}/sub", False) for d in (".h", "a", "b", "c"))


def test_hidden_names_and_folders_read_as_on_disk(s3, tmp_path):
    """A folder of the user's whose name starts with a dot is named, never a
    hidden part (a glob in it, the folder, a file in it), a dot-name below it
    is left out, a sub-folder is walked, and a hidden file named alone matches
    nothing, on disk and in a store alike. An upper-case scheme reads as the
    lower-case one."""
    tree = tmp_path / "tree"
    (tree / ".corpus" / "sub").mkdir(parents=True)
    for name in (".corpus/a.jsonl", ".corpus/sub/b.jsonl", ".corpus/.hidden.jsonl"):
        (tree / name).write_text('{"text": "x"}\n')
    upload(s3, tree, "dot")
    url = f"s3://{BUCKET}/dot"
    files = lambda path: resolve_sources(cfg(sources=[{"path": path}]))
    for pattern in (".corpus/*.jsonl", ".corpus", ".corpus/", ".corpus/**/*.jsonl", ".corpus/a.jsonl"):
        on_disk = [f.path.relative_to(tree).as_posix() for f in files(f"{tree}/{pattern}")]
        assert [f.path.uri.removeprefix(f"{url}/") for f in files(f"{url}/{pattern}")] == on_disk and on_disk, pattern
    assert [f.path.uri for f in files(f"S3://{BUCKET}/dot/.corpus/a.jsonl")] == [f"{url}/.corpus/a.jsonl"]
    for base in (str(tree), url):
        with pytest.raises(IngestError, match=r"matched no files .*of the 1 it found, 1 hidden"):
            files(f"{base}/.corpus/.hidden.jsonl")


def test_a_remote_path_that_no_listing_gave_asks_the_store(s3):
    import stat

    with s3.open_output_stream(f"{BUCKET}/api/x.txt") as out:
        out.write(b"abc")
    f, folder, gone = (remote.RemotePath(f"s3://{BUCKET}/{key}") for key in ("api/x.txt", "api", "api/none"))
    assert f.is_file() and not f.is_dir() and f.exists() and f.stat().st_size == 3 and stat.S_ISREG(f.stat().st_mode)
    assert folder.is_dir() and not folder.is_file() and stat.S_ISDIR(folder.stat().st_mode)
    assert not gone.exists() and not gone.is_file() and not gone.is_dir()
    with pytest.raises(FileNotFoundError):
        gone.stat()


def test_a_listed_time_is_the_whole_second_a_head_request_gives():
    """S3 lists an object's time to the millisecond and HEAD gives it to the
    second: a worker's check compares the two, so both are whole seconds."""
    info = pafs.FileInfo(f"{BUCKET}/x.txt", pafs.FileType.File, mtime_ns=1_700_000_000_123_456_789, size=3)
    listed = remote._found(f"s3://{BUCKET}", info)
    assert listed.uri == f"s3://{BUCKET}/x.txt"
    assert (listed.stat().st_size, listed.stat().st_mtime_ns) == (3, 1_700_000_000_000_000_000)


def test_a_folder_s_files_come_sorted_whatever_order_the_store_lists_them_in(monkeypatch):
    """The order of the files is the order of the documents: a store that lists
    a folder in another order (pyarrow promises none) changes nothing."""
    class Unsorted:
        def get_file_info(self, what):
            if isinstance(what, pafs.FileSelector):
                return [pafs.FileInfo(f"b/d/{name}", pafs.FileType.File, size=1, mtime_ns=0)
                        for name in ("z.txt", "a/y.txt", "m.txt")] + [pafs.FileInfo("b/d/a", pafs.FileType.Directory)]
            return pafs.FileInfo(what, pafs.FileType.Directory)

    monkeypatch.setitem(remote._FILESYSTEMS, "s3://b", Unsorted())
    base, found = remote.list_files("s3://b/d/")
    assert base.uri == "s3://b/d" and [f.uri for f in found] == ["s3://b/d/a/y.txt", "s3://b/d/m.txt", "s3://b/d/z.txt"]


def test_a_store_that_cannot_be_listed_is_one_line(monkeypatch):
    """No network or no credentials, after pyarrow's own retries: the OSError
    it raises (its messages run over lines) is one line naming the source."""
    def down(uri):
        raise OSError("When listing objects in bucket 'b': AWS Error NETWORK_CONNECTION\nretries spent")

    monkeypatch.setattr(remote, "list_files", down)
    with pytest.raises(IngestError, match=r"^ingest\.sources\.0\.path: cannot list 's3://b/x/\*\.txt': When listing "
                                          r"objects in bucket 'b': AWS Error NETWORK_CONNECTION retries spent$"):
        resolve_sources(cfg(sources=[{"path": "s3://b/x/*.txt"}]))
