"""The memory planner (pipeline/training/memory.py): the estimate against the
measured peak of a CPU step, the table, and ``batch.micro_batch_size: auto``."""

import subprocess
import sys

import pytest
import torch

from pipeline.model.transformer import Transformer, build_config, num_params
from pipeline.training import memory
from tests.pipeline.training.test_trainer import cfg, fit, read_csv, trainer

# Peak resident memory added by building a model and AdamW and running one
# forward + backward + optimizer step, in a fresh process. A warm-up step on a
# throwaway model first pages in torch's code, then the peak (VmHWM) is reset.
MEASURE = r"""
import gc, sys, torch
from pipeline.model.transformer import Transformer, build_config
from pipeline.training.loss import token_loss_sum
torch.set_num_threads(1)
preset, vocab, B, T, precision = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

def step(model, opt, B, V):
    idx = torch.randint(0, V, (B, T + 1))
    seg = torch.cumsum((torch.rand(B, T) < 0.01).long(), 1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits = model(idx[:, :-1], segment_ids=seg)
    loss = token_loss_sum(logits, idx[:, 1:])
    del logits
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

w = Transformer(build_config("tiny", 64, max_seq_len=T))
wo = torch.optim.AdamW(w.parameters())
step(w, wo, 2, 64)
del w, wo
gc.collect()
open("/proc/self/clear_refs", "w").write("5")  # reset the peak
base = status("VmRSS:")
m = Transformer(build_config(preset, vocab, max_seq_len=T))
opt = torch.optim.AdamW(m.parameters())
step(m, opt, B, vocab)
print(status("VmHWM:") - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")
@pytest.mark.parametrize("preset, vocab, micro, seq_len, precision", [
    ("tiny", 8192, 16, 128, "fp32"),
    ("tiny", 8192, 16, 128, "bf16"),
    ("mini", 8192, 16, 256, "bf16"),  # the default run's shape: the output head dominates
    ("mini", 512, 16, 256, "fp32"),  # small vocabulary: the blocks dominate
])
def test_estimate_is_within_25_percent_of_the_measured_peak(preset, vocab, micro, seq_len, precision):
    out = subprocess.run([sys.executable, "-c", MEASURE, preset, str(vocab), str(micro), str(seq_len), precision],
                         capture_output=True, text=True, check=True)
    measured = int(out.stdout.strip())
    c = build_config(preset, vocab, max_seq_len=seq_len)
    estimated = memory.estimate(c, micro, seq_len, precision=precision).total
    assert estimated == pytest.approx(measured, rel=0.25), (estimated, measured)


def test_estimate_shards_state_under_fsdp_and_shrinks_activations_with_checkpointing():
    c = build_config("medium", 50304)
    ddp = memory.estimate(c, 8, 1024)
    fsdp = memory.estimate(c, 8, 1024, gpus=8, fsdp=True)
    ac = memory.estimate(c, 8, 1024, checkpointing=True)
    assert fsdp.optimizer == ddp.optimizer // 8 and fsdp.grads == ddp.grads // 8
    assert fsdp.params < ddp.params / 4
    assert ac.activations < ddp.activations / 2
    assert memory.estimate(c, 16, 1024).activations > 1.9 * memory.estimate(c, 8, 1024).activations


def test_estimate_counts_each_term_of_the_model_of_memory():
    """The module doc's terms, by hand, for a small untied GQA shape (d_model 64,
    q 4 x 16, k and v 2 x 16, ffn 160, vocab 1000), 2 rows of 32 tokens."""
    c = build_config(None, 1000, n_layer=2, d_model=64, n_head=4, n_kv_head=2, ffn_hidden=160, tie_embeddings=False)
    n, block = num_params(c), sum(p.numel() for p in Transformer(c).layers[0].parameters())
    # per token and block: two norms (2 x (fp32 input and normalised value + the output)), q k v and rotated q k,
    # k and v copied to 4 heads, attention output and its copy, four MLP tensors
    per_token = {2: 2 * (512 + 128) + 2 * 128 * 2 + 2 * 2 * 64 + 2 * 2 * 64 + 4 * 2 * 160,
                 4: 2 * (512 + 256) + 4 * 128 * 2 + 2 * 4 * 64 + 2 * 4 * 64 + 4 * 4 * 160}
    assert per_token == {2: 3584, 4: 6144}
    assert [memory.activation_bytes_per_token(c, p) for p in ("bf16", "fp16", "fp32")] == [3584, 3584, 6144]
    tokens, mask = 2 * 32, 2 * 32 * 32 * (1 + 4)  # the bool mask and its float form
    for precision, p in (("bf16", 2), ("fp32", 4)):
        head = tokens * 1000 * ((2 if p == 2 else 0) + 4 + 4 + 4) + tokens * 64 * 4 * 3
        e = memory.estimate(c, 2, 32, precision=precision)
        assert e.activations == 2 * per_token[p] * tokens + head + mask
        for no_mask in ({"doc_mask": False}, {"dense_mask": False}):
            assert memory.estimate(c, 2, 32, precision=precision, **no_mask).activations == e.activations - mask
        ac = memory.estimate(c, 2, 32, precision=precision, checkpointing=True)  # block inputs + one live block
        assert ac.activations == 2 * 4 * 64 * tokens + per_token[p] * tokens + head + mask
    ddp, fsdp = memory.estimate(c, 2, 32), memory.estimate(c, 2, 32, gpus=4, fsdp=True)
    assert (ddp.params, ddp.grads, ddp.optimizer) == (4 * n + 2 * n, 4 * n, 8 * n)  # fp32 master + bf16 copy
    assert memory.estimate(c, 2, 32, gpus=4) == ddp  # DDP: every rank holds it all
    assert (fsdp.grads, fsdp.optimizer) == (n, 2 * n)
    # the fp32 shard, plus what FSDP gathers in the compute dtype: two blocks (prefetch) and the root unit
    # (embeddings, head, final norm), which stays gathered from its forward to its backward
    root = n - 2 * block
    assert fsdp.params == pytest.approx(n + 2 * (2 * block + root), rel=1e-3)
    assert memory.estimate(c, 2, 32, precision="fp32", gpus=4, fsdp=True).params == pytest.approx(
        n + 4 * (2 * block + root), rel=1e-3)  # fp32 blocks are gathered in fp32: not free


def test_the_table_has_a_row_per_precision_sharding_and_checkpointing(capsys):
    memory.main(["--preset", "tiny", "--preset", "small", "--seq-len", "2048", "--gpus", "4"])
    out = capsys.readouterr().out
    assert "small: 123.6M params, micro-batch 8 x 2048 tokens" in out
    rows = [line for line in out.splitlines() if line.startswith(("bf16", "fp32"))]
    assert len(rows) == 2 * 2 * 2 * 2 and sum("fsdp/4" in r for r in rows) == 8


def test_choose_micro_batch_keeps_the_global_batch():
    c = build_config("mini", 8192)
    one_row = memory.estimate(c, 1, 256).total
    assert memory.choose_micro_batch(c, 256, 2, precision="bf16", ranks_per_node=1, available=10**12) == (32, 1)
    available = int(5 * one_row / memory.CPU_HEADROOM)
    micro, accum = memory.choose_micro_batch(c, 256, 2, precision="bf16", ranks_per_node=1, available=available)
    assert micro * accum == 32 and 1 < micro < 32  # the largest divisor of 32 that fits:
    budget = memory.CPU_HEADROOM * available
    assert memory.estimate(c, micro, 256).total <= budget < memory.estimate(c, 2 * micro, 256).total
    # ranks on one node share its memory: four ranks with four times the memory plan as one rank
    assert memory.choose_micro_batch(c, 256, 2, precision="bf16", ranks_per_node=4, available=4 * available) == (
        micro, accum)
    assert memory.choose_micro_batch(c, 256, 2, precision="bf16", ranks_per_node=4, available=available)[0] < micro
    with pytest.raises(MemoryError, match="one row of 256 tokens needs about"):
        memory.choose_micro_batch(c, 256, 1, precision="bf16", ranks_per_node=2, available=one_row)


def test_choose_micro_batch_plans_with_activation_checkpointing_when_it_is_on():
    c = build_config("mini", 8192)
    plain, ac = (memory.estimate(c, 8, 256, checkpointing=on).total for on in (False, True))
    available = int((plain + ac) / 2 / memory.CPU_HEADROOM)  # 8 rows fit only with checkpointing
    assert memory.choose_micro_batch(c, 256, 1, precision="bf16", ranks_per_node=1, available=available)[0] < 8
    assert memory.choose_micro_batch(c, 256, 1, precision="bf16", ranks_per_node=1, available=available,
                                     checkpointing=True) == (8, 2)


def test_probe_takes_the_largest_divisor_that_every_rank_fits():
    tried = []

    def step(m):  # this rank runs out of memory above 4 rows
        tried.append(m)
        if m > 4:
            raise torch.cuda.OutOfMemoryError("out of memory")

    assert memory.probe_micro_batch(step, 16) == 4 and tried == [16, 8, 4]
    assert memory.probe_micro_batch(step, 16, start=6) == 4 and tried[3:] == [4]  # from the largest divisor <= 6
    assert memory.probe_micro_batch(step, 16, start=8) == 4 and tried[4:] == [8, 4]  # start itself is tried
    # another rank fits 2 rows only: the all-reduce (a minimum, 0 where a rank failed) says no to 4
    assert memory.probe_micro_batch(step, 16, agree=lambda m: 0 if m > 2 else m) == 2
    with pytest.raises(MemoryError, match="one row does not fit"):
        memory.probe_micro_batch(step, 16, agree=lambda m: 0)


def test_auto_micro_batch_trains_the_same_run_split_to_fit(tmp_path, monkeypatch):
    fixed = trainer(tmp_path, "fixed", cfg(max_steps=3, micro_batch_size=16))
    auto = trainer(tmp_path, "auto", cfg(max_steps=3, micro_batch_size="auto"))
    assert auto.cfg.batch.micro_batch_size == 16 and auto.fingerprint == fixed.fingerprint
    fit(fixed), fit(auto)
    monkeypatch.setattr(memory, "available_cpu_bytes", lambda: 1)  # nothing fits...
    with pytest.raises(Exception, match="one row of"):
        trainer(tmp_path, "none", cfg(max_steps=3, micro_batch_size="auto"))
    c = cfg(max_steps=3, micro_batch_size="auto")
    four_rows = memory.estimate(c.model.build(64, 32), 4, 32, precision="fp32").total
    monkeypatch.setattr(memory, "available_cpu_bytes", lambda: int(four_rows / memory.CPU_HEADROOM) + 1)
    small = trainer(tmp_path, "small", c)
    assert (small.cfg.batch.micro_batch_size, small.cfg.batch.grad_accum_steps) == (4, 4)
    assert small.fingerprint == fixed.fingerprint
    assert small.run_params() == {}  # track is off in these tests; the request is kept for MLflow
    assert small.requested_micro_batch == "auto"
    fit(small)
    losses = {name: [float(r["loss"]) for r in read_csv(tmp_path / name / "plots.csv")] for name in ("fixed", "auto", "small")}
    assert losses["auto"] == losses["fixed"]
    assert losses["small"] == pytest.approx(losses["fixed"], rel=1e-4)


def test_choose_micro_batch_counts_fsdp_shards():
    """Under FSDP each rank holds 1/N of the weights, gradients and AdamW state,
    so a budget too small for one unsharded row fits one when sharded."""
    c = build_config("small", 8192)
    ddp = memory.estimate(c, 1, 256, precision="fp32").total
    fsdp = memory.estimate(c, 1, 256, precision="fp32", gpus=8, fsdp=True).total
    available = int((ddp + fsdp) / 2 / memory.CPU_HEADROOM)
    with pytest.raises(MemoryError):
        memory.choose_micro_batch(c, 256, 1, precision="fp32", ranks_per_node=1, available=available)
    micro, accum = memory.choose_micro_batch(c, 256, 1, precision="fp32", ranks_per_node=1, available=available,
                                             fsdp_world=8)
    assert micro >= 1 and micro * accum == 16


def test_auto_micro_batch_resumes_with_the_checkpoints_split(tmp_path, monkeypatch, caplog):
    """A resumed run adds its losses up as the run did: auto keeps the
    checkpoint's micro-batch where it fits, though more would fit now."""
    from pipeline.training import checkpoint as ckpt

    c = cfg(max_steps=8, micro_batch_size="auto")
    four_rows = memory.estimate(c.model.build(64, 32), 4, 32, precision="fp32").total
    small = int(four_rows / memory.CPU_HEADROOM) + 1
    monkeypatch.setattr(memory, "available_cpu_bytes", lambda: small)
    fit(trainer(tmp_path, "full", c))
    fit(trainer(tmp_path, "resumed", c))
    for k in ckpt.complete_checkpoints(tmp_path / "resumed" / "models"):  # a crash after step 4
        if k.step > 4:
            ckpt.discard([k])
    monkeypatch.setattr(memory, "available_cpu_bytes", lambda: 10**12)  # now 16 rows would fit
    t = trainer(tmp_path, "resumed", c)
    assert t.step == 4 and (t.cfg.batch.micro_batch_size, t.cfg.batch.grad_accum_steps) == (4, 4)
    fit(t)
    losses = {n: [r["loss"] for r in read_csv(tmp_path / n / "plots.csv")] for n in ("full", "resumed")}
    assert losses["resumed"][-4:] == losses["full"][-4:]  # string-exact
    # a checkpoint whose micro-batch no longer fits: the one that does, with a warning
    fit(trainer(tmp_path, "big", cfg(max_steps=4, micro_batch_size="auto")))
    assert ckpt.load_state(ckpt.resolve(tmp_path / "big" / "models"), "trainer.pt")["micro_batch_size"] == 16
    monkeypatch.setattr(memory, "available_cpu_bytes", lambda: small)
    with caplog.at_level("WARNING"):
        t = trainer(tmp_path, "big", cfg(max_steps=8, micro_batch_size="auto"))
    assert t.step == 4 and t.cfg.batch.micro_batch_size == 4
    assert "the checkpoint's 16 rows per forward do not fit now; continuing with 4" in caplog.text
    t.close()


@pytest.mark.parametrize("flag,value", [("--gpus", "0"), ("--seq-len", "0"), ("--micro-batch", "-1"),
                                        ("--vocab-size", "0"), ("--gpus", "two")])
def test_a_count_below_one_is_refused_in_one_line(flag, value, capsys):
    """--gpus 0 divided by zero (a traceback); negatives printed negative GiB."""
    with pytest.raises(SystemExit) as exit_:
        memory.main(["--preset", "tiny", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}:" in err and "Traceback" not in err


def test_available_cpu_memory_is_in_bytes():
    """/proc/meminfo counts in kB: at least a thousandth of the machine, at most all of it."""
    total = __import__("os").sysconf("SC_PAGE_SIZE") * __import__("os").sysconf("SC_PHYS_PAGES")
    assert total / 1024 < memory.available_cpu_bytes() <= total


def test_optimizer_state_is_two_moments_of_each_parameters_bytes_on_this_rank():
    class Shard(torch.nn.Parameter):  # a DTensor's to_local(): this rank's part of the parameter
        def to_local(self):
            return self[:1]

    model = torch.nn.Linear(4, 3)  # 15 parameters
    assert memory.optimizer_state_bytes(model) == 2 * 15 * 4
    assert memory.optimizer_state_bytes(torch.nn.Linear(4, 3, dtype=torch.bfloat16)) == 2 * 15 * 2
    model.weight = Shard(torch.zeros(3, 4))
    assert memory.optimizer_state_bytes(model) == 2 * (4 + 3) * 4  # one row of the weight, and the bias


def test_only_cuda_is_probed_and_each_oom_empties_the_cache(monkeypatch):
    assert memory.probes(torch.device("cuda", 0)) and not memory.probes(torch.device("cpu"))
    assert not memory.probes(torch.device("meta"))  # no out-of-memory error to back off from
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))

    def step(m):
        if m > 2:
            raise torch.cuda.OutOfMemoryError("out of memory")

    assert memory.probe_micro_batch(step, 8) == 2 and len(emptied) == 3  # after 8 and 4 failed, and after 2


def test_the_table_assumes_no_dense_mask(capsys):
    c = build_config("tiny", 50304, max_seq_len=2048)
    memory.main(["--preset", "tiny", "--seq-len", "2048", "--precision", "fp32"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("fp32") and " ddp " in line)
    e = memory.estimate(c, 8, 2048, precision="fp32", dense_mask=False)
    assert row.split()[-2:] == [f"{e.activations / memory.GIB:.2f}", f"{e.total / memory.GIB:.2f}"]


def test_choose_micro_batch_plans_without_the_mask_when_doc_mask_is_off():
    """data.doc_mask false: the sdpa path builds no (B, 1, T, T) mask, so a budget
    that fits 8 rows only without it gives 8 rows."""
    c = build_config("mini", 512)
    with_mask, without = (memory.estimate(c, 8, 512, precision="fp32", doc_mask=on).total for on in (True, False))
    available = int((with_mask + without) / 2 / memory.CPU_HEADROOM)
    plan = dict(precision="fp32", ranks_per_node=1, available=available)
    assert memory.choose_micro_batch(c, 512, 1, **plan)[0] < 8
    assert memory.choose_micro_batch(c, 512, 1, doc_mask=False, **plan) == (8, 2)


def cgroup_tree(root, files):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_a_containers_memory_limit_caps_what_auto_plans_with(tmp_path, monkeypatch):
    """/proc/meminfo shows the host's memory inside a container: a plan made from
    it is killed by the container's OOM killer (exit 137, no message). The cgroup's
    limit less its working set (usage less inactive file cache) caps it."""
    G = 2 ** 30
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    cgroup_tree(v2, {"a/b/memory.max": "max\n", "a/b/memory.current": str(5 * G),  # unlimited itself
                     "a/memory.max": f"{8 * G}\n", "a/memory.current": str(3 * G),  # a parent's limit applies
                     "a/memory.stat": f"anon {2 * G}\ninactive_file {G}\nactive_file 0\n",
                     "self": "0::/a/b\n"})
    assert memory.cgroup_available_bytes(str(v2), str(v2 / "self")) == 8 * G - (3 * G - G)
    cgroup_tree(v1, {"memory/memory.limit_in_bytes": str(4 * G), "memory/memory.usage_in_bytes": str(G),
                     "self": "5:cpu:/\n4:memory:/docker/abc\n0::/\n"})  # no memory.stat: no cache counted
    assert memory.cgroup_available_bytes(str(v1), str(v1 / "self")) == 3 * G
    unlimited = tmp_path / "none"
    cgroup_tree(unlimited, {"memory.max": "max\n", "memory.current": "1", "self": "0::/\n"})
    assert memory.cgroup_available_bytes(str(unlimited), str(unlimited / "self")) is None
    assert memory.cgroup_available_bytes(str(tmp_path / "missing"), str(tmp_path / "missing" / "self")) is None
    monkeypatch.setattr(memory, "cgroup_available_bytes", lambda: 12345)
    assert memory.available_cpu_bytes() == 12345
    monkeypatch.setattr(memory, "cgroup_available_bytes", lambda: None)
    assert memory.available_cpu_bytes() > 12345
