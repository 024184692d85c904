"""Training on several processes (issue 17): torchrun-launched DDP and FSDP runs on the CPU
(gloo, one thread per rank, loopback only) against the one-process trainer, resume across world
sizes, a killed worker restarted by torchrun's agent, two "nodes" on localhost, and kill -9
during checkpoint writes. The reference for every multi-process number is the single-process
trainer run in this test process on the same config."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from processes import DEADLINE_S
from serving import free_port
from test_finetune import smol, tiny_data, tiny_llama  # noqa: F401  (fixtures)

from glassformer.config import ConfigError
from glassformer.data import shakespeare_plays
from glassformer.interop.checkpoint import LATEST_FILE, load_model_weights, resolve_checkpoint
from glassformer.models import build_model
from glassformer.train.checkpoint import read_train_state, save_checkpoint
from glassformer.train.config import load_run_config
from glassformer.train.distributed import Parallel, Ranks, learned_positions, resolve_strategy
from glassformer.train.trainer import Trainer

MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32, "position": "rope",
         "norm": "rms", "ffn": "swiglu"}  # fmt: skip
LOSS_TOL = 1e-5  # the same sums in another order


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    plays = shakespeare_plays("modern")
    path = folder / "hamlet.txt"
    path.write_text(plays[next(k for k in plays if "hamlet" in k)][:30_000], encoding="utf-8")
    return path


def write_config(folder: Path, corpus: Path, name: str = "run", **train) -> Path:
    """A tiny GPT on packed paragraphs of Hamlet (targets are -100 across document boundaries,
    so the rows of a batch learn different numbers of tokens), 2 micro-steps per step."""
    values = {
        "out_dir": str(folder / name), "max_steps": 6, "batch_size": 4, "grad_accum_steps": 2,
        "warmup_steps": 2, "learning_rate": 3e-3, "eval_interval": 1000, "eval_batches": 1,
        "checkpoint_interval": 3, "keep_checkpoints": 5, "threads": 1, **train,
    }  # fmt: skip
    sections = {
        "model": MODEL,
        "data": {"corpus": str(corpus), "chunking": "pack", "documents": "paragraph"},
        "train": values,
    }
    lines = []
    for section, table in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    path = folder / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def single_losses(config: Path, **overrides) -> list[float]:
    """The one-process trainer, in this process: the reference."""
    sets = [f"train.{key}={json.dumps(value)}" for key, value in overrides.items()]
    return Trainer(load_run_config(config, sets), progress=False).fit().train_losses


def saved_losses(out_dir: Path) -> list[float]:
    state, _ = read_train_state(resolve_checkpoint(out_dir))
    return state["train_losses"]


def torchrun_command(nproc: int, *args: str, launcher: list[str] | None = None) -> list[str]:
    launcher = launcher or ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                            "--master-port", str(free_port())]  # fmt: skip
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "glassformer", *args]


def run_env() -> dict[str, str]:
    # Gloo on the loopback interface only; one thread per rank.
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "GLOO_SOCKET_IFNAME": "lo"}


def torchrun(nproc: int, *args: str, timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
    # torchrun in a session of its own: on a timeout its workers are killed with it. (A plain
    # subprocess.run kills the launcher only, and then waits for ever on the pipes its workers
    # still hold.)
    job = subprocess.Popen(
        torchrun_command(nproc, *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=run_env(),
        start_new_session=True,
    )
    stdout, stderr = finish(job, timeout)
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)


def finish(job: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The output of a job started with start_new_session; past the timeout, the job and every
    process it started are killed and the test fails with what it printed."""
    try:
        return job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        _, stderr = job.communicate()
        pytest.fail(f"torchrun ran past {timeout} s:\n{stderr[-3000:]}")


def train_args(config: Path, *sets: str) -> list[str]:
    return ["train", "--config", str(config), "--no-progress", *[f"--set={s}" for s in sets]]


def assert_close(ours: list[float], reference: list[float]) -> None:
    assert len(ours) == len(reference)
    assert ours == pytest.approx(reference, abs=LOSS_TOL, rel=0), (ours, reference)


# --- the bookkeeping, in this process ----------------------------------------------------------


def test_shards_split_the_rows_and_weights_give_the_global_mean():
    torch.manual_seed(0)
    targets = torch.randint(0, 9, (4, 6))
    targets[0, :5] = -100  # rows that learn different numbers of tokens
    targets[3, 2:] = -100
    batch = {"input_ids": torch.randint(0, 9, (4, 6)), "targets": targets}
    per_token_loss = torch.rand(4, 6)
    learned = targets != -100
    global_mean = per_token_loss[learned].mean()

    weighted = []
    rows = []
    for rank in range(2):
        parallel = Parallel("ddp", Ranks(rank, 2, rank), torch.device("cpu"))
        part, weight = parallel.shard(batch)
        rows.append(part["input_ids"])
        keep = part["targets"] != -100
        local = per_token_loss[2 * rank : 2 * rank + 2][keep].mean()  # the rank's own mean
        weighted.append(weight * local)
    # DDP averages the ranks: (w0 L0 + w1 L1) / 2 must be the whole batch's mean.
    assert float(sum(weighted) / 2) == pytest.approx(float(global_mean), rel=1e-6)
    assert torch.equal(torch.cat(rows), batch["input_ids"])  # every row once, in order
    assert learned_positions(batch) == int(learned.sum())


def test_strategy_and_batch_errors_name_the_fix():
    assert resolve_strategy("auto", 1) == "single"
    assert resolve_strategy("auto", 2) == "ddp"
    with pytest.raises(ConfigError, match="strategy='single' under torchrun with 2"):
        resolve_strategy("single", 2)
    parallel = Parallel("ddp", Ranks(0, 2, 0), torch.device("cpu"))
    with pytest.raises(ConfigError, match="batch_size=3 does not split over 2 processes"):
        parallel.check_batch_size(3)


def test_unknown_strategy_is_a_config_error(tmp_path, corpus):
    config = write_config(tmp_path, corpus)
    with pytest.raises(ConfigError, match=r"train\.strategy='zero3' is not known"):
        load_run_config(config, ["train.strategy='zero3'"])


# --- torchrun: DDP and FSDP against one process ------------------------------------------------


@pytest.mark.slow
def test_ddp_two_processes_equal_one_and_resume_on_one(tmp_path, corpus):
    config = write_config(tmp_path, corpus)
    reference = single_losses(config, out_dir=str(tmp_path / "single"))
    result = torchrun(2, *train_args(config, "train.strategy='ddp'"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_close(saved_losses(tmp_path / "run"), reference)
    # Logging on rank 0 only: one "done" line, not two.
    assert result.stdout.count("done: 6 steps") == 1, result.stdout
    # The header says this is one job of 2 ranks; the progress line, that its tok/s counts both.
    assert result.stdout.count("parallel: ddp | world size 2 | backend gloo on cpu") == 1, (
        result.stdout
    )
    assert "tok/s (all 2 ranks)" in result.stdout.split("step 6: train loss")[1], result.stdout

    # 2 -> 1: the DDP run's step 3 resumed by one process ends where the single run ended.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "run" / "step-000003", resumed / "step-000003")
    (resumed / LATEST_FILE).write_text("step-000003\n")
    run = load_run_config(config, [f"train.out_dir={json.dumps(str(resumed))}"])
    assert_close(Trainer(run, resume=True, progress=False).fit().train_losses, reference)


@pytest.mark.slow
def test_fsdp_two_processes_equal_one_and_resume_across_world_sizes(tmp_path, corpus):
    config = write_config(tmp_path, corpus, strategy="fsdp")
    reference = single_losses(config, out_dir=str(tmp_path / "single"), strategy="auto")
    result = torchrun(2, *train_args(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parallel: fsdp | world size 2 | backend gloo on cpu" in result.stdout, result.stdout
    assert_close(saved_losses(tmp_path / "run"), reference)
    step3 = tmp_path / "run" / "step-000003"
    assert sorted(p.name for p in (step3 / "shards").iterdir()) == [
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
    ]
    # The gathered whole weights load into a plain model: what generate reads.
    model = build_model(load_run_config(config).model_config(vocab_size=_vocab(step3)))
    load_model_weights(model, step3)

    # 2 -> 1: the sharded step 3 resumed by one process (torch.distributed.checkpoint reshards).
    two_to_one = _start_from(tmp_path / "run" / "step-000003", tmp_path / "two_to_one")
    run = load_run_config(config, [f"train.out_dir={json.dumps(str(two_to_one))}"])
    run.train.strategy = "auto"
    assert_close(Trainer(run, resume=True, progress=False).fit().train_losses, reference)

    # 1 -> 2: the single run's step 3 (whole weights) resumed by two FSDP processes.
    one_to_two = _start_from(tmp_path / "single" / "step-000003", tmp_path / "one_to_two")
    result = torchrun(2, *train_args(config, f"train.out_dir={json.dumps(str(one_to_two))}"),
                      "--resume")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
    assert_close(saved_losses(one_to_two), reference)


def _start_from(step_dir: Path, out_dir: Path) -> Path:
    out_dir.mkdir()
    shutil.copytree(step_dir, out_dir / step_dir.name)
    (out_dir / LATEST_FILE).write_text(step_dir.name + "\n")
    return out_dir


def _vocab(step_dir: Path) -> int:
    return json.loads((step_dir / "config.json").read_text())["vocab_size"]


# --- faults --------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(t) for t in text]
    return found


def _kill_job(job: subprocess.Popen) -> None:
    """Kill a torchrun job and its workers. torchrun starts each worker in a session of its own,
    so killing the agent alone leaves them running: a worker of a restart round, waiting in its
    rendezvous for a master that was gone, outlived a test by 16 minutes. The agent is stopped
    first, so that it starts no worker while they are killed."""
    if job.poll() is None:
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.kill(job.pid, signal.SIGSTOP)
            for pid in _children(job.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        job.kill()
    job.wait()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc for worker pids")
def test_killed_worker_is_restarted_and_the_run_ends_as_uninterrupted(tmp_path, corpus):
    steps = 240
    config = write_config(
        tmp_path, corpus, strategy="ddp", max_steps=steps, checkpoint_interval=20,
        grad_accum_steps=1, keep_checkpoints=2,
    )  # fmt: skip
    # The reference: the same two-process job, uninterrupted (over 240 steps the last bits in
    # which two processes differ from one grow past a fixed tolerance; resume itself is exact).
    straight = torchrun(
        2, *train_args(config, f"train.out_dir={json.dumps(str(tmp_path / 'straight'))}")
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    reference = saved_losses(tmp_path / "straight")
    # c10d rendezvous: each restart is a new round with its own keys (torchrun's advice for
    # fault-tolerant jobs).
    launcher = ["--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]  # fmt: skip
    command = torchrun_command(2, *train_args(config), launcher=launcher)
    log = open(tmp_path / "log.txt", "w")  # noqa: SIM115
    job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=run_env())
    try:
        latest = tmp_path / "run" / LATEST_FILE
        deadline = time.monotonic() + DEADLINE_S
        while not latest.exists() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.05)
        assert latest.exists(), (tmp_path / "log.txt").read_text()[-3000:]
        workers = [c for c in _children(job.pid) if Path(f"/proc/{c}").exists()]
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)  # rank 1 dies mid-run
        killed_at = latest.read_text().strip()
        assert job.wait(timeout=DEADLINE_S) == 0, (tmp_path / "log.txt").read_text()[-3000:]
    finally:
        _kill_job(job)
        log.close()
    text = (tmp_path / "log.txt").read_text()
    # torchrun's agent restarted the job once, and the restart found the checkpoint.
    assert "restart 1: resuming from the newest checkpoint" in text, text[-3000:]
    assert "resumed from" in text
    assert killed_at != f"step-{steps:06d}"  # the kill landed before the end
    assert saved_losses(tmp_path / "run") == reference  # exact


def _save_forever(out_dir: str, seed: int) -> None:
    """A child process: save checkpoints of a model as fast as it can, until it is killed."""
    torch.manual_seed(seed)
    from glassformer.config import ModelConfig

    cfg = ModelConfig(vocab_size=300, d_model=128, n_layers=4, n_heads=4, max_seq_len=64)
    model = build_model(cfg)
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            model.tok_emb.weight.fill_(float(step))  # each step's weights say which step it is
        extra = {"optimizer.m": torch.full((4096, 64), float(step))}
        save_checkpoint(out_dir, step, model, cfg, train_state={"mark": step},
                        train_tensors=extra, keep_last=2)  # fmt: skip


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks the writer")
def test_kill_during_checkpoint_writes_never_breaks_latest(tmp_path):
    """20 trials: a process writing checkpoints in a loop is killed with SIGKILL after a random
    delay; `latest` must then name a complete step whose weights, trainer state and tensors
    all belong to that one step (never a partial or mixed folder)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    rng = random.Random(17)
    checked = interrupted = 0
    for trial in range(20):
        out_dir = tmp_path / f"trial{trial}"
        child = context.Process(target=_save_forever, args=(str(out_dir), trial))
        child.start()
        deadline = time.monotonic() + 30
        while not (out_dir / LATEST_FILE).exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.25))  # land anywhere inside a write
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        interrupted += any(p.name.startswith(".tmp-step-") for p in out_dir.iterdir())
        step_dir = resolve_checkpoint(out_dir)
        step = int(step_dir.name.split("-")[1])
        assert (out_dir / LATEST_FILE).read_text().strip() == step_dir.name
        state, tensors = read_train_state(step_dir)
        assert state["step"] == state["mark"] == step
        assert torch.all(tensors["optimizer.m"] == step)
        cfg_json = json.loads((step_dir / "config.json").read_text())
        from glassformer.config import ModelConfig

        model = build_model(ModelConfig(**cfg_json))
        load_model_weights(model, step_dir)
        assert torch.all(model.tok_emb.weight == step)
        checked += 1
    assert checked == 20
    print(f"{interrupted} of 20 kills landed inside a write (a .tmp-step-* folder was left)")
    assert interrupted >= 5  # the kills did hit writes, not only the gaps between them


def _sharded_step_is_whole(step_dir: Path, config: Path) -> None:
    """Every file of a committed FSDP step is readable, and its per-rank shards put together
    (in one process) are exactly the weights of its model.safetensors: one step, not a mix."""
    from glassformer.train.sharded import load_sharded
    from glassformer.train.trainer import make_optimizer

    state, _ = read_train_state(step_dir)
    assert state["step"] == int(step_dir.name.split("-")[1])
    assert len(list((step_dir / "shards").iterdir())) == 2
    run = load_run_config(config)
    whole = build_model(run.model_config(vocab_size=_vocab(step_dir)))
    load_model_weights(whole, step_dir)
    from_shards = build_model(run.model_config(vocab_size=_vocab(step_dir)))
    optimizer = make_optimizer(from_shards, run.train)
    load_sharded(step_dir, from_shards, optimizer, state["optimizer"]["param_groups"])
    ours = from_shards.state_dict()
    for name, tensor in whole.state_dict().items():
        assert torch.equal(tensor, ours[name]), name


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc for worker pids")
def test_kill_during_sharded_saves_leaves_latest_whole(tmp_path, corpus):
    """An FSDP job saving at every step; one of its two workers is killed with SIGKILL at a
    random moment, 5 times (torchrun restarts the job each time). After each kill, `latest`
    names a step whose shards and gathered weights are whole and agree."""
    config = write_config(
        tmp_path, corpus, strategy="fsdp", max_steps=100_000, checkpoint_interval=1,
        keep_checkpoints=100_000, grad_accum_steps=1,
    )  # fmt: skip
    launcher = ["--nproc-per-node", "2", "--max-restarts", "20", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]  # fmt: skip
    command = torchrun_command(2, *train_args(config), launcher=launcher)
    log = open(tmp_path / "log.txt", "w")  # noqa: SIM115
    job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=run_env())
    rng = random.Random(3)
    latest = tmp_path / "run" / LATEST_FILE
    try:
        seen = ""
        for _kill in range(5):
            deadline = time.monotonic() + DEADLINE_S
            while time.monotonic() < deadline and job.poll() is None:
                now = latest.read_text().strip() if latest.exists() else ""
                if now and now != seen:  # the (restarted) job is saving again
                    break
                time.sleep(0.05)
            assert job.poll() is None, (tmp_path / "log.txt").read_text()[-3000:]
            time.sleep(rng.uniform(0.0, 0.3))
            # Between a restart's exits and spawns torchrun may have no workers for a moment:
            # wait for them rather than pick from an empty list.
            workers, wait_until = [], time.monotonic() + DEADLINE_S
            while not workers and time.monotonic() < wait_until and job.poll() is None:
                workers = [c for c in _children(job.pid) if Path(f"/proc/{c}").exists()]
                time.sleep(0 if workers else 0.05)
            assert workers, (tmp_path / "log.txt").read_text()[-3000:]
            os.kill(rng.choice(workers), signal.SIGKILL)
            seen = latest.read_text().strip()
            _sharded_step_is_whole(tmp_path / "run" / seen, config)
    finally:
        _kill_job(job)
        log.close()


# --- several nodes, and errors -----------------------------------------------------------------


def _two_nodes(config: Path, sets_per_node: list[list[str]], timeout: float = DEADLINE_S):
    """Two torchrun "nodes" on localhost (--nnodes 2, one process each, c10d rendezvous); the
    second runs the `glassformer` console script instead of -m glassformer."""
    port = free_port()
    script = Path(sys.executable).parent / "glassformer"
    jobs = []
    for node, sets in enumerate(sets_per_node):
        launcher = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "test"]  # fmt: skip
        if node == 1 and script.exists():
            command = [sys.executable, "-m", "torch.distributed.run", *launcher, str(script)]
            command += train_args(config, *sets)
        else:
            command = torchrun_command(1, *train_args(config, *sets), launcher=launcher)
        jobs.append(
            subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=run_env(),
                start_new_session=True,
            )
        )
    try:
        outputs = [finish(job, timeout) for job in jobs]
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    return [(job.returncode, out, err) for job, (out, err) in zip(jobs, outputs, strict=True)]


@pytest.mark.slow
def test_two_nodes_on_localhost_equal_one_process(tmp_path, corpus):
    config = write_config(tmp_path, corpus, strategy="ddp")
    reference = single_losses(config, out_dir=str(tmp_path / "single"), strategy="auto")
    results = _two_nodes(config, [[], []])
    for code, _out, err in results:
        assert code == 0, err[-3000:]
    assert_close(saved_losses(tmp_path / "run"), reference)


@pytest.mark.slow
def test_mismatched_configs_fail_at_start_naming_the_key(tmp_path, corpus):
    config = write_config(tmp_path, corpus, strategy="ddp")
    start = time.monotonic()
    results = _two_nodes(config, [[], ["train.learning_rate=0.01"]], timeout=120)
    assert time.monotonic() - start < 120
    errors = "".join(err for _code, _out, err in results)
    assert all(code != 0 for code, _out, _err in results)
    assert "rank 1 differs from rank 0 in train.learning_rate" in errors, errors[-3000:]
    assert not (tmp_path / "run" / LATEST_FILE).exists()  # nothing was trained


@pytest.mark.slow
def test_errors_name_the_rank(tmp_path, corpus):
    config = write_config(tmp_path, corpus, strategy="ddp", batch_size=3)
    result = torchrun(2, *train_args(config))
    assert result.returncode != 0
    assert "error on rank 1 of 2: train.batch_size=3 does not split over 2 processes" in (
        result.stderr
    ), result.stderr[-3000:]


# --- fine-tuning on DDP --------------------------------------------------------------------------


@pytest.mark.slow
def test_lora_finetune_on_two_ddp_processes_equals_one(tiny_llama, tiny_data, tmp_path):  # noqa: F811
    """Chat rows learn different numbers of tokens: the loss weighting is what keeps the two
    processes' gradient equal to one process's."""
    common = ["--model", str(tiny_llama), "--data", str(tiny_data), "--batch-size", "4",
              "--warmup", "1", "--lr", "1e-2", "--eval-interval", "100", "--method", "lora",
              "--lora-dropout", "0", "--steps", "3", "--no-progress", "--threads", "1"]  # fmt: skip
    single = subprocess.run(
        [sys.executable, "-m", "glassformer", "finetune", *common, "--out", str(tmp_path / "one")],
        capture_output=True, text=True, timeout=DEADLINE_S, env=run_env(),
    )  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    two = torchrun(2, "finetune", *common, "--out", str(tmp_path / "two"),
                   "--set", "train.strategy='ddp'")  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("done: 3 steps") == 1
    assert_close(saved_losses(tmp_path / "two"), saved_losses(tmp_path / "one"))


def test_inner_micro_steps_skip_the_all_reduce(monkeypatch):
    """A one-rank gloo group in this process: DDP's communication hook sees one all-reduce per
    optimizer step, on the last of its 3 micro-steps, not one per micro-step."""
    import datetime

    import torch.distributed as dist

    # Loopback only, as for the torchrun runs: left to itself gloo binds the address the host
    # name resolves to, and on a CI machine where that address is unusable it waited forever.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    # One rank needs no rendezvous: an in-memory store, so no TCP port can be taken or hang.
    dist.init_process_group(
        "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.manual_seed(0)
        from glassformer.config import ModelConfig

        model = build_model(ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2,
                                        max_seq_len=8))  # fmt: skip
        parallel = Parallel("ddp", Ranks(0, 1, 0), torch.device("cpu"))
        parallel.wrap(model, None)
        calls = []

        def counting_allreduce(state, bucket):
            calls.append(bucket.buffer().numel())
            return (
                dist.all_reduce(bucket.buffer(), async_op=True)
                .get_future()
                .then(lambda fut: fut.value()[0])
            )

        parallel._ddp.register_comm_hook(None, counting_allreduce)
        ids = torch.randint(0, 20, (2, 8))
        for micro in range(3):
            with parallel.gradient_sync(micro == 2):
                parallel.loss(input_ids=ids, targets=ids).loss.backward()
            assert len(calls) == (1 if micro == 2 else 0), (micro, calls)
        assert sum(calls) == sum(p.numel() for p in model.parameters())
    finally:
        # DDP's reducer holds the group: freed after destroy_process_group, the group's
        # destructor waited forever on its gloo threads (a CI run hung here), so it goes first.
        parallel = None
        gc.collect()
        dist.destroy_process_group()
