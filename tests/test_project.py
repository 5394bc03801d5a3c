"""The project's own files agree with each other: one name per stage everywhere,
every shipped params section validates, each DVC stage depends on exactly its own
params section (its code deps: tests/test_deps.py), and the import graph has the
shape of the design: stages/ and flows/ call into pipeline/, never the reverse,
and pipeline/ has no import cycles."""

import ast
import importlib.util
import re
import subprocess
import tomllib
from importlib import metadata
from importlib.metadata import packages_distributions

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pipeline import layout
from pipeline.config import SCHEMAS, load_params
from tests.conftest import BIN, ROOT
from tests.imports import imported_modules, module_name, pipeline_modules, rel, third_party_imports

DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())
EXPECTED_ORDER = ["ingest", "clean", "tokenizer", "pack", "pretrain", "sft", "evaluate", "export"]


def test_stage_names_agree_everywhere():
    assert list(DVC) == [s for s in EXPECTED_ORDER if s in DVC]
    for stage in DVC:
        assert stage in PARAMS, f"params.yaml has no section {stage!r}"
        assert stage in SCHEMAS, f"pipeline.config.SCHEMAS has no schema for {stage!r}"
        assert importlib.util.find_spec(f"stages.{stage}") is not None, f"no module stages/{stage}.py"
        assert DVC[stage]["cmd"] == f"python -m stages.{stage}"


@pytest.mark.parametrize("stage", list(DVC))
def test_each_stage_depends_on_its_own_params_code_and_writes_its_metrics(stage):
    spec = DVC[stage]
    assert spec["params"] == [stage], "a stage tracks exactly its own params section"
    deps = spec["deps"]
    assert f"stages/{stage}.py" in deps  # and the rest of its code: tests/test_deps.py
    metrics = [next(iter(m)) if isinstance(m, dict) else m for m in spec["metrics"]]
    assert metrics == [str(layout.metrics_path(stage))]


@pytest.mark.parametrize("stage", [s for s in PARAMS])
def test_shipped_params_validate(stage):
    cfg = load_params(stage, ROOT / "params.yaml")
    assert type(cfg).__name__.endswith("Config")


def readme_params_excerpts() -> list[dict]:
    """The README's ``params.yaml`` excerpts (yaml blocks whose keys are stage names)."""
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [d for d in map(yaml.safe_load, blocks) if isinstance(d, dict) and set(d) <= set(SCHEMAS)]


def test_readme_recipes_validate_on_top_of_the_shipped_params():
    from pipeline.config import parse_section, schema_for

    def merge(into: dict, excerpt: dict) -> None:
        for key, value in excerpt.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = value

    excerpts = readme_params_excerpts()
    assert len(excerpts) >= 3  # the recipes are there, and each one parses
    for excerpt in excerpts:
        params = yaml.safe_load((ROOT / "params.yaml").read_text())
        merge(params, excerpt)
        for stage in excerpt:
            parse_section(schema_for(stage), params[stage], stage)


def test_gitignore_keeps_generated_state_out_of_git():
    ignored = (ROOT / ".gitignore").read_text()
    for pattern in ("/mlflow.db", "/mlartifacts/", ".venv/"):
        assert pattern in ignored
    # outputs and the user's inputs stay out of git; the inputs' `dvc add` files go in
    paths = ["data/ingest/x", "data/stray.txt", "models/pretrain/x", "data/raw/book.txt", "data/raw/corpus/a.jsonl",
             "models/base/qwen/config.json", "data/raw/README.md", "data/raw/book.txt.dvc", "data/raw/.gitignore",
             "models/base/README.md", "models/base/qwen.dvc"]
    out = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.split() == paths[:6]


def test_dvc_add_of_user_inputs_is_seen_by_dvc(tmp_path):
    """README: put your inputs in data/raw/ and models/base/ and `dvc add` them.
    That failed ("bad DVC file name ... is git-ignored"); and with the .dvc file
    un-ignored below a `/data/raw/*` line DVC still skipped it when it looked for
    .dvc files (its git-ignore check prunes data/raw/), so `dvc exp run --temp` and
    `--queue`, which restore inputs in their copy with a plain `dvc checkout`,
    started without them. Here: the same checkout restores both inputs."""
    import os
    import shutil

    from tests.conftest import project_copy

    root = project_copy(tmp_path / "proj")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    book, model = root / "data/raw/book.txt", root / "models/base/tiny"
    book.write_text("a line of text\n" * 100)
    model.mkdir()
    (model / "config.json").write_text("{}")

    def run(*cmd):
        out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return out.stdout

    run(str(BIN / "dvc"), "add", "data/raw/book.txt", "models/base/tiny")
    run("git", "add", "data/raw/book.txt.dvc", "models/base/tiny.dvc")  # git refuses an ignored path
    assert run("git", "status", "--porcelain", "-uall").split() == [
        "A", "data/raw/book.txt.dvc", "A", "models/base/tiny.dvc"]  # the data itself stays out of git
    book.unlink()
    shutil.rmtree(model)
    run(str(BIN / "dvc"), "checkout", "--allow-missing")  # as `dvc exp run --temp` does in its copy
    assert book.read_text() == "a line of text\n" * 100
    assert (model / "config.json").read_text() == "{}"


def test_metrics_and_plots_stay_visible_to_git():
    # dvc exp run commits them into each experiment; dvc exp show / plots diff read them there
    paths = ["metrics/pretrain.json", "plots/pretrain.csv", "dvc.lock", "models/pretrain/x", "data/packed/x"]
    out = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.split() == ["models/pretrain/x", "data/packed/x"]


def test_readme_params_reference_is_current():
    from pipeline.reference import reference

    readme = (ROOT / "README.md").read_text()
    assert reference(ROOT / "params.yaml") in readme, "run `python -m pipeline.reference --write`"


def test_a_hanging_test_fails_instead_of_holding_the_suite():
    """pytest-timeout (a dev dependency) is set for every test, so a loop that never
    ends fails that test and the suite goes on."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert any(d.startswith("pytest-timeout") for d in project["project"]["optional-dependencies"]["dev"])
    assert 0 < project["tool"]["pytest"]["ini_options"]["timeout"] <= 900


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation (backticks,
    colons, apostrophes, dots) dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def markdown_anchors(text: str) -> set[str]:
    """The anchors of a Markdown text's headings (a repeated heading's get -1,
    -2, ... as on GitHub); lines inside fenced code blocks are not headings."""
    anchors, seen, fenced = set(), {}, False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            slug = github_slug(m.group(1))
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def dead_anchor_links(text: str) -> list[str]:
    """The ``(#anchor)`` links of a Markdown text that no heading of it resolves."""
    anchors = markdown_anchors(text)
    return [a for a in re.findall(r"\]\(#([^)\s]+)\)", text) if a not in anchors]


def test_dead_anchor_links_finds_one():
    text = "# Top\n## Data stages on Ray: `python -m bench.ray_data`\n```\n# not a heading\n```\n## Top\n"
    links = "[a](#data-stages-on-ray-python--m-benchray_data) [b](#top-1) [c](#not-a-heading) [d](#top-2)"
    assert dead_anchor_links(text + links) == ["not-a-heading", "top-2"]


def test_readme_anchor_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert "](#" in readme
    assert dead_anchor_links(readme) == [], "README links to headings it does not have"


def layout_tree_files(text: str) -> set[str]:
    """The files the README's "Project layout" tree names, as paths: a name
    ending in ``/`` opens a folder for the deeper-indented lines below it, and
    ``.py`` names lead a line (several may), or stand in parentheses on a
    folder's own line (``tracking/  MLflow runs (tracker.py)``)."""
    block = text.split("## Project layout", 1)[1].split("```", 2)[1]
    folders: list[tuple[int, str]] = []
    files = set()
    for line in filter(str.strip, block.splitlines()[1:]):
        indent = len(line) - len(line.lstrip(" "))
        while folders and folders[-1][0] >= indent:
            folders.pop()
        parent = folders[-1][1] if folders else ""
        words = line.split()
        for i, word in enumerate(words):
            if not re.fullmatch(r"[\w.-]+(\.py|/)", word):
                break
            if word.endswith("/"):
                folders.append((indent, parent + word))
                files |= {parent + word + f for f in re.findall(r"\((\w+\.py)\)", " ".join(words[i + 1:]))}
            else:
                files.add(parent + word)
    return files


def test_layout_tree_files_reads_a_tree():
    tree = ("## Project layout\n\n```\npipeline/  the library\n  a.py b.py   two\n  data/  data (c.py)\n"
            "    d.py  one\n  e.py  back up\nstages/  glue\n```\n")
    assert layout_tree_files(tree) == {"pipeline/a.py", "pipeline/b.py", "pipeline/data/c.py",
                                       "pipeline/data/d.py", "pipeline/e.py"}


def test_readme_layout_names_every_pipeline_module():
    listed = {f for f in layout_tree_files((ROOT / "README.md").read_text()) if f.startswith("pipeline/")}
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "pipeline").rglob("*.py") if p.name != "__init__.py"}
    assert sorted(modules - listed) == [], "modules the README's Project layout leaves out"
    assert sorted(listed - modules) == [], "files the README's Project layout names that do not exist"


# --------------------------------------------------------------------------- import graph

# which top-level packages each may import (imports inside functions included)
MAY_IMPORT = {"pipeline": {"pipeline"}, "stages": {"pipeline", "stages"}, "flows": {"pipeline", "flows"}}


def test_imports_point_from_stages_and_flows_into_pipeline_never_back():
    problems = []
    for layer, allowed in MAY_IMPORT.items():
        for path in sorted((ROOT / layer).rglob("*.py")):
            for module in sorted(imported_modules(path)):
                if module.split(".")[0] not in allowed:
                    problems.append(f"{rel(path)} imports {module}: {layer}/ may import only {sorted(allowed)}")
    assert not problems, "\n".join(problems)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None (depth-first search)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if cycle := visit(nxt):
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if cycle := visit(node):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_pipeline_has_no_import_cycles():
    """Module-level imports only: an import inside a function runs on call, when
    every module is loaded, so it cannot break an import; it is how a module defers
    a heavy dependency (torch, mlflow). Package ``__init__.py`` files count only
    when an import names the package itself."""
    graph = {module_name(p): {m for m in imported_modules(p, module_level_only=True) if m.startswith("pipeline")}
             for p in pipeline_modules()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# A library the code imports that pyproject.toml does not name, because the
# library named here requires it and it is part of that library's interface:
# imported name -> (the declared distribution that requires it, why we use it).
PROVIDED_BY = {
    "pydantic_core": ("pydantic", "pydantic's compiled core: PydanticCustomError, the error a validator raises"),
    "networkx": ("dvc", "DVC's API hands out the stage graph as a networkx graph"),
    "httpx": ("prefect", "the Prefect client's transport: its connection errors say the server is down"),
}
OPTIONAL = {"ray"}  # extras imported only when a param chooses them, never on import


def requirement_names(specs) -> set[str]:
    return {canonicalize_name(Requirement(s).name) for s in specs}


def test_every_library_the_code_imports_is_a_declared_dependency():
    """`pip install .` (the container image, a user's own environment) installs
    [project.dependencies] and nothing of the dev extras, so a library imported by
    pipeline/, stages/ or flows/ and named only among the dev extras breaks there
    and nowhere in the tests. An optional extra's library is imported only inside
    the function that needs it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = requirement_names(project["dependencies"])
    extras = {extra: requirement_names(specs) for extra, specs in project["optional-dependencies"].items()}
    distributions = packages_distributions()
    problems = []
    for path in sorted(p for layer in ("pipeline", "stages", "flows") for p in (ROOT / layer).rglob("*.py")):
        module_level = third_party_imports(path, module_level_only=True)
        for name in sorted(third_party_imports(path)):
            dists = {canonicalize_name(d) for d in distributions.get(name, [name])}
            if name in PROVIDED_BY:
                provider = PROVIDED_BY[name][0]
                needs = requirement_names(metadata.requires(provider) or [])
                if provider not in declared or not dists & needs:
                    problems.append(f"{rel(path)} imports {name}, which {provider} no longer provides: declare it")
            elif dists & declared:
                continue
            elif any(dists & extras.get(extra, set()) for extra in OPTIONAL):
                if name in module_level:
                    problems.append(f"{rel(path)} imports the optional {name} at module level")
            else:
                where = [extra for extra, names in extras.items() if dists & names]
                problems.append(f"{rel(path)} imports {name} ({', '.join(sorted(dists))}), which is not in "
                                f"[project.dependencies]" + (f" (only in the extras {where})" if where else ""))
    assert not problems, "\n".join(problems)


def test_every_pipeline_module_opens_with_a_docstring():
    missing = [rel(p) for p in pipeline_modules() if not ast.get_docstring(ast.parse(p.read_text(encoding="utf-8")))]
    assert not missing, f"modules without an opening docstring: {', '.join(missing)}"


def test_dvc_hashes_the_data_stages_data_not_their_resume_bookkeeping(tmp_path):
    """Every file ingest, clean and pack leave in their outputs is either data (a
    shard its manifest lists, the manifest, a report), which DVC hashes, or
    bookkeeping that names the fingerprint of the code that wrote it (shard
    records, clean's decisions, pack's checkpoints), which .dvcignore leaves out:
    in DVC's hash it would make a code change that leaves the data byte-identical
    rerun every stage downstream."""
    from pipeline.data.clean import run_clean
    from pipeline.data.ingest import run_ingest
    from pipeline.data.pack import PackConfig, run_pack
    from pipeline.data.shards import MANIFEST
    from pipeline.files import read_json
    from tests.helpers import train_tiny_tokenizer
    from tests.pipeline.data import test_clean, test_ingest

    raw = tmp_path / "raw"
    raw.mkdir()
    for k in range(12):
        (raw / f"doc{k}.txt").write_text(test_clean.prose(300, seed=k) + "\n\n" + test_clean.code(k))
    ingest_dir, clean_dir, packed = (tmp_path / p for p in (layout.INGEST_DIR, layout.CLEAN_DIR, layout.PACKED))
    run_ingest(test_ingest.cfg(sources=[{"path": str(raw / "*.txt")}], shard_bytes=4000), ingest_dir / "docs",
               ingest_dir / "quarantine.jsonl", ingest_dir / "report.json")
    run_clean(test_clean.cfg(dedup={"method": "sharded"}, shard_bytes=4000), ingest_dir / "docs", clean_dir / "docs",
              clean_dir / "quarantine.jsonl", clean_dir / "report.json")
    tok = tmp_path / "tokenizer" / "tokenizer.json"
    train_tiny_tokenizer(tok)
    run_pack(PackConfig(seq_len=15, val_fraction=0.25, shard_tokens=64 * 16, batch_docs=2, task_bytes=2000),
             clean_dir / "docs", tok, packed)

    data = {d / MANIFEST for d in (ingest_dir / "docs", clean_dir / "docs", packed)}
    data |= {d / f for d in (ingest_dir, clean_dir) for f in ("quarantine.jsonl", "report.json")}
    data |= {d / "docs" / s["path"] for d in (ingest_dir, clean_dir) for s in read_json(d / "docs" / MANIFEST)["shards"]}
    data |= {packed / s["path"] for split in read_json(packed / MANIFEST)["splits"].values() for s in split["shards"]}
    written = {p for p in (tmp_path / "data").rglob("*") if p.is_file()}
    assert data <= written and len(written - data) > 6
    names = sorted(p.relative_to(tmp_path).as_posix() for p in written)
    assert any(n.startswith("data/clean/docs/decisions-") for n in names)
    assert any(n.startswith("data/packed/checkpoint-") for n in names)
    out = subprocess.run([str(BIN / "dvc"), "check-ignore", *names], cwd=ROOT,
                         capture_output=True, text=True)
    ignored = set(out.stdout.split())
    assert ignored == {p.relative_to(tmp_path).as_posix() for p in written - data}, out.stderr


# torch APIs the training code calls unconditionally, and the release that brought each:
# an older torch that pyproject.toml admits fails at the first forward or at sharding.
TORCH_APIS = {
    "torch.nn.functional.scaled_dot_product_attention(enable_gqa=...)": "2.5",  # every forward (attention.sdpa)
    "torch.nn.attention.flex_attention": "2.5",
    "torch.distributed.tensor.DTensor": "2.5",
    "torch.distributed.fsdp.fully_shard, MixedPrecisionPolicy, FSDPModule": "2.6",
    "torch.nn.utils.get_total_norm, clip_grads_with_norm_": "2.6",  # FSDP's gradient clipping
}


def test_the_torch_floor_has_every_torch_api_the_training_code_calls():
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_req = next(Requirement(s) for s in project["dependencies"] if Requirement(s).name == "torch")
    for api, release in TORCH_APIS.items():
        older = Version(f"{Version(release).major}.{Version(release).minor - 1}.99")
        assert not torch_req.specifier.contains(older, prereleases=True), \
            f"pyproject.toml admits torch {older}, which lacks {api} (torch {release})"
