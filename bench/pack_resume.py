"""What pack's resume costs: the same pack run with its commit records and
checkpoints, and with them turned off, side by side.

    python -m bench.pack_resume                  # ~60 MB, both shapes, 3 interleaved rounds
    python -m bench.pack_resume --mb 20 --rounds 1

The corpora are bench.data's (the standard library's source, rot-k copies: few
long documents, and many short ones), packed with the shipped params but
``shard_tokens``, at the default (8 Mi tokens: a few shards, so a few
checkpoints) and at 256 Ki tokens (about a hundred shards and checkpoints: the
overhead made visible). "off" is the same code with each shard written without
its record and no checkpoint taken (the monkeypatched child below): the
difference is the resume's own cost (the fingerprint's hash of the input, the
records, the sidecars, their fsyncs). Every run is a fresh process; the runs of
a round alternate, and medians over rounds are reported, with the stage's main
process CPU seconds (where the resume's work is done) beside the wall time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARDS = {"default": 1 << 23, "256Ki": 1 << 18}


def _child(mode: str, corpus: str, tokenizer: str, out: str, shard_tokens: int, workers: int) -> None:
    from pipeline.data import pack

    if mode == "off":
        pack.Checkpoints.save = lambda self, fields, writers: None  # type: ignore[method-assign]
        pack.pack_fingerprint = lambda cfg, docs, tokenizer: ""  # no hash of the input either
        init = pack.SplitWriter.__init__

        def no_log(self, out_dir, split, row_len, shard_rows, eot_id=pack.EOT_ID, log=None):
            init(self, out_dir, split, row_len, shard_rows, eot_id)

        pack.SplitWriter.__init__ = no_log  # type: ignore[method-assign]
    # wall and CPU over the same span, the stage's run: not the interpreter's start-up and imports,
    # which both modes pay alike and which would pull the on/off CPU ratio towards 1
    t0, cpu0 = time.perf_counter(), time.process_time()
    m = pack.run_pack(pack.PackConfig(num_workers=workers, shard_tokens=shard_tokens), corpus, tokenizer, out)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    print("RESULT " + json.dumps({"wall_s": wall, "main_cpu_s": cpu, "shards": m["shards"],
                                  "shards_sha256": shards_digest(Path(out))}), flush=True)


def shards_digest(out: Path) -> str:
    """One sha256 over every shard's path and bytes: the packed data, without
    the records and checkpoints that only "on" writes."""
    h = hashlib.sha256()
    for f in sorted(out.glob("*/shard-*.arrow")):
        h.update(f.relative_to(out).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def same_shards(results: dict[tuple[str, str, str], list[dict]]) -> None:
    """Stop the bench unless every run of a corpus and shard size, on and off,
    wrote the same shards: "off" must save only the resume's work."""
    for shape, shards in {(shape, shards) for shape, shards, _ in results}:
        runs = results[shape, shards, "off"] + results[shape, shards, "on"]
        if len({r["shards_sha256"] for r in runs}) != 1:
            raise SystemExit(f"{shape} documents, shard_tokens {shards}: the runs wrote different shards")


def measure(mode: str, corpus: Path, tokenizer: Path, work: Path, shard_tokens: int, workers: int) -> dict:
    out = work / f"out-{mode}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    r = subprocess.run([sys.executable, "-m", "bench.pack_resume", "--child", mode, str(corpus), str(tokenizer),
                        str(out), str(shard_tokens), str(workers)], cwd=ROOT, capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or not lines:
        raise SystemExit(f"{mode} failed:\n{r.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=60, help="corpus size (MB of text), both shapes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, corpus, tokenizer, out, shard_tokens, workers = args.child
        _child(mode, corpus, tokenizer, out, int(shard_tokens), int(workers))
        return

    from bench.data import build_corpora
    from pipeline.config import parse_section
    from pipeline.data.tokenizer import TokenizerConfig, train_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpora = build_corpora(work, [args.mb])
        tok = work / "tokenizer" / "tokenizer.json"
        train_tokenizer(parse_section(TokenizerConfig, {}, "tokenizer"), corpora["long", args.mb]["path"], tok)
        results: dict[tuple[str, str, str], list[dict]] = {}
        for _ in range(args.rounds):
            for (shape, mb), c in corpora.items():
                for shards, n in SHARDS.items():
                    for mode in ("off", "on"):
                        results.setdefault((shape, shards, mode), []).append(
                            measure(mode, c["path"], tok, work, n, args.workers))
    same_shards(results)
    print(f"pack with resume (on) vs without (off), {args.mb:g} MB asked (at least one whole copy of the "
          f"standard library: the sizes below are what was packed), {args.workers} workers, "
          f"medians of {args.rounds} round(s); the same shards from every run, on and off")
    print(f"{'corpus':<8}{'MB':>6}  {'shard_tokens':<14}{'shards':>7}{'off s':>9}{'on s':>9}{'on/off':>8}"
          f"{'off cpu':>9}{'on cpu':>9}{'on/off':>8}")
    for shape in ("long", "short"):
        for shards in SHARDS:
            off, on = results[shape, shards, "off"], results[shape, shards, "on"]
            w = [statistics.median(r["wall_s"] for r in x) for x in (off, on)]
            c = [statistics.median(r["main_cpu_s"] for r in x) for x in (off, on)]
            mb = corpora[shape, args.mb]["bytes"] / 1e6
            print(f"{shape:<8}{mb:>6.1f}  {shards:<14}{on[0]['shards']:>7}{w[0]:>9.2f}{w[1]:>9.2f}{w[1] / w[0]:>8.3f}"
                  f"{c[0]:>9.2f}{c[1]:>9.2f}{c[1] / c[0]:>8.3f}")


if __name__ == "__main__":
    main()
