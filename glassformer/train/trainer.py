"""The training loop (seed 000 §2.1-2.2): tokenize, chunk, batch, predict every next token at
once (teacher forcing), step AdamW, evaluate, checkpoint atomically, resume exactly.

Exact resume: batches are a pure function of (seed, step), and a checkpoint holds the weights,
the optimizer moments and the RNG state, so a resumed run repeats an uninterrupted one.
Safety: one trainer per out_dir (a lock file), a run is never silently trained over, a config
that cannot fit in memory is refused before anything is allocated, and a loss that turns NaN
stops the run before the last good checkpoint is overwritten.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors
import torch

from glassformer.config import ConfigError
from glassformer.devices import autocast, grad_scaler, half_dtype, resolve_device
from glassformer.files import atomic_write_text, write_kind
from glassformer.interop.checkpoint import (
    CheckpointError,
    checkpoint_folders,
    load_model_weights,
    resolve_checkpoint,
    save_model_files,
)
from glassformer.models import build_model
from glassformer.nn.quant import parameter_count
from glassformer.tokenizers import load_tokenizer
from glassformer.train.checkpoint import (
    RUN_CONFIG_FILE,
    TRAIN_STATE_FILE,
    begin_step_dir,
    commit_step_dir,
    init_matching_weights,
    remove_leftovers,
    save_checkpoint,
    step_dir_name,
    write_step_files,
)
from glassformer.train.config import RunConfig, run_config_json
from glassformer.train.distributed import Parallel, restart_count
from glassformer.train.guards import ResumePoint, check_training_memory, config_changes
from glassformer.train.optim import learning_rate, make_optimizer
from glassformer.train.run_dir import (
    RunLock,
    check_run_folder,
    checkpoint_nbytes,
    newest_checkpoint,
    old_run_to_replace,
    remove_step_dirs,
    resume_point,
    save_failed,
    saved_run_config,
)
from glassformer.train.sharded import (
    full_weights,
    load_full_optimizer,
    load_sharded,
    local_part,
    save_sharded,
    sharded_step,
)
from glassformer.train.signals import StopRequests
from glassformer.train.steps import evaluate, progress_bar, to_device
from glassformer.train.task_table import make_task
from glassformer.train.train_state import (
    load_optimizer_state,
    optimizer_state_dict,
    optimizer_state_to_tensors,
    restore_rng_state,
    rng_state_tensors,
)


class DivergedError(ValueError):
    """The loss or the weights became NaN/inf; the message names the step and what to lower."""


@dataclass
class TrainResult:
    out_dir: Path
    steps: int
    train_losses: list[float] = field(default_factory=list)  # one per optimizer step
    val_loss: float | None = None
    baseline_name: str = "baseline"
    baseline_loss: float | None = None  # e.g. unigram entropy: what ignoring context scores
    tokens_per_s: float = 0.0  # under torchrun: all ranks together


# --- the loop -----------------------------------------------------------------------------------


class Trainer:
    """One training run in train.out_dir. It holds the run's lock from construction until fit()
    returns (or close()). resume=True continues from the newest intact checkpoint;
    overwrite=True starts over in a folder that holds a run, deleting the old step
    directories only once this run has saved its first checkpoint.

    Under torchrun every process builds its own Trainer: train.strategy says how they share
    the work (train/distributed.py); rank 0 alone holds the lock and writes the files, and a
    job restarted by torchrun's agent resumes from the newest checkpoint by itself."""

    def __init__(
        self, run: RunConfig, resume: bool = False, progress: bool = True, overwrite: bool = False
    ) -> None:
        if resume and overwrite:
            raise ConfigError(
                "pass --resume (continue the run in train.out_dir) or --overwrite (start it"
                " over), not both"
            )
        self.run = run
        self.cfg = run.train
        self.out_dir = Path(self.cfg.out_dir)
        self.parallel = Parallel.start(
            self.cfg.strategy,
            resolve_device(self.cfg.device),
            timeout_s=self.cfg.rank_timeout_s,
            out_dir=self.out_dir,
        )
        self.parallel.check_same_config(run_config_json(run))
        self.parallel.check_batch_size(self.cfg.batch_size)
        self.progress = progress and self.parallel.is_main
        if restart_count() > 0:  # torchrun's agent restarted the job after a worker died
            print(f"restart {restart_count()}: resuming from the newest checkpoint")
            resume, overwrite = True, False
        self._check_before_start()
        check_run_folder(self.out_dir, self._sources(), self.out_flag)
        self.lock = RunLock(self.out_dir, enabled=self.parallel.is_main)
        self.lock.acquire()
        try:
            if self.parallel.is_main:  # what killed saves left: temporary files and folders
                remove_leftovers(self.out_dir)
            self._prepare(resume, overwrite)
        except BaseException:
            self.lock.release()
            raise

    out_flag = "train.out_dir"  # how the run folder is named to the user, in errors
    holds = "model"  # what the run's step folders hold (glassformer.json of the run folder)

    def _sources(self) -> list[Path]:
        """What this run reads from, which its folder must not be, hold or sit inside."""
        sources = checkpoint_folders(self.cfg.init_from) if self.cfg.init_from else []
        corpus = Path(self.run.data.corpus)
        return [*sources, corpus] if corpus.exists() else sources

    def _check_before_start(self) -> None:
        # Refuse a bad or impossible [model] before touching the disk or reading the corpus. A
        # declared vocab_size is checked as written; the tokenizer's replaces it below.
        run = self.run
        declared = run.model_config(vocab_size=run.model.get("vocab_size", 1))
        check_training_memory(declared, self.cfg, activations=False)

    def _prepare(self, resume: bool, overwrite: bool) -> None:
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        torch.manual_seed(self.cfg.seed)
        self.old_run = old_run_to_replace(self.out_dir, resume, overwrite)
        start = self._resume_point() if resume else None
        self.device = self.parallel.device  # under torchrun on GPUs: cuda:LOCAL_RANK
        self.half = half_dtype(self.device, self.cfg.dtype)  # None: fp32
        self.scaler = grad_scaler(self.device, self.half)
        self._build(start)
        if start is not None and not sharded_step(start.step_dir):
            self._load_weights(start.step_dir)  # whole weights go in before any sharding
        self.parallel.wrap(self.model, self.half)  # DDP or FSDP; nothing for one process
        self.optimizer = make_optimizer(self.model, self.cfg)  # the parameters that train
        self.step = 0
        self.tokens_seen = 0  # since this process started (for tokens/s): all ranks' rows
        self.train_losses: list[float] = []
        if start is not None:
            self._restore(start)

    def _build(self, start: ResumePoint | None) -> None:
        """Set self.task, self.tokenizer, self.model_cfg and self.model (on self.device): a new
        model from [model], or train.init_from's weights; a resume loads its own below. The
        fine-tuning trainer (train/finetune.py) builds from a pretrained model instead."""
        run = self.run
        init_dir = resolve_checkpoint(self.cfg.init_from) if self.cfg.init_from else None
        # A run started from pretrained weights must read text with their tokenizer.
        tokenizer_dir = start.step_dir if start else init_dir
        self.task = make_task(run, load_tokenizer(tokenizer_dir) if tokenizer_dir else None)
        self.tokenizer = self.task.tokenizer
        self.model_cfg = self.task.model_config(run)
        check_training_memory(self.model_cfg, self.cfg, activations=True)
        self.model = build_model(self.model_cfg).to(self.device)
        if start is None and init_dir is not None:
            init_matching_weights(self.model, init_dir)

    def close(self) -> None:
        """Release the run's lock without training (fit() releases it when it returns)."""
        self.lock.release()

    # --- what is already in out_dir ---

    def _resume_point(self) -> ResumePoint | None:
        return resume_point(self.out_dir, self._check_resumable)

    def _check_resumable(self, step_dir: Path, state: dict[str, Any]) -> None:
        step = state["step"]
        if step > self.cfg.max_steps:
            raise ConfigError(
                f"train.max_steps={self.cfg.max_steps} is below step {step} of the checkpoint"
                f" {step_dir}: raise train.max_steps above {step} to train on, e.g. --set"
                f" train.max_steps={2 * step}"
            )
        saved = state.get("run_config")
        if not isinstance(saved, dict):
            saved = saved_run_config(self.out_dir)
        changes = config_changes(saved, self.run) if saved is not None else []
        if changes:
            raise ConfigError(
                f"--resume cannot change [data] or [model] of the run in {self.out_dir}:"
                f" {'; '.join(changes)}; resume with the run's own values (only [train] may"
                " change, e.g. max_steps), or start a new run with --overwrite or another"
                " train.out_dir"
            )

    def _restore(self, start: ResumePoint) -> None:
        """The optimizer state, RNG and step of `start` (whole weights are already in)."""
        tensors = start.tensors
        optim_tensors = {k: v for k, v in tensors.items() if k.startswith("optimizer.")}
        meta = start.state["optimizer"]
        try:
            if sharded_step(start.step_dir):  # weights and moments from every rank's shard
                load_sharded(start.step_dir, self.model, self.optimizer, meta["param_groups"])
            elif self.parallel.sharded:
                state_dict = optimizer_state_dict(self.optimizer, meta, optim_tensors)
                load_full_optimizer(self.model, self.optimizer, state_dict)
            else:
                load_optimizer_state(self.optimizer, meta, optim_tensors)
        except (KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(
                f"{start.step_dir / TRAIN_STATE_FILE} holds a malformed optimizer state"
                f" ({err!r}): resume from an earlier step or start over with --overwrite"
            ) from None
        restore_rng_state({k: v for k, v in tensors.items() if not k.startswith("optimizer.")})
        self.step = start.state["step"]
        self.train_losses = list(start.state["train_losses"])
        print(f"resumed from {start.step_dir} at step {self.step}")

    def _load_weights(self, step_dir: Path) -> None:
        """Put a step's trained weights into self.model (strict: every tensor must fit)."""
        load_model_weights(self.model, step_dir / "model.safetensors")

    # --- saving ---

    def _write_model_files(self, directory: Path) -> None:
        """The model's part of a step folder: weights, config.json and the tokenizer."""
        save_model_files(directory, self.model, self.model_cfg, self.tokenizer)

    def _write_run_config(self) -> None:
        """run_config.json and glassformer.json (the folder is a run) beside the step folders."""
        atomic_write_text(self.out_dir / RUN_CONFIG_FILE, run_config_json(self.run) + "\n")
        write_kind(self.out_dir, "run", holds=self.holds)

    def save(self) -> Path:
        """Write step-NNNNNN and point `latest` at it. Every rank calls it: with FSDP each
        writes its shard; otherwise rank 0 writes what every rank holds."""
        self._check_weights_finite()
        if self.parallel.sharded:
            step_dir = self._save_sharded()
        else:
            if self.parallel.is_main:
                self._save_whole()
            self.parallel.barrier()
            step_dir = self.out_dir / step_dir_name(self.step)
        if self.old_run and self.parallel.is_main:
            # --overwrite: this run has a checkpoint now, so the old one can go
            remove_step_dirs(self.out_dir, self.old_run, keep=step_dir.name)
            self._write_run_config()
        self.old_run = []
        return step_dir

    def _train_state(self, optimizer_meta: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": self.step,
            "train_losses": self.train_losses,
            "optimizer": optimizer_meta,
            "run_config": self.run.to_dict(),
        }

    def _save_whole(self) -> Path:
        optim_meta, optim_tensors = optimizer_state_to_tensors(self.optimizer)
        tensors = {**optim_tensors, **rng_state_tensors()}
        state = self._train_state(optim_meta)
        previous = newest_checkpoint(self.out_dir)
        try:
            step_dir = save_checkpoint(
                self.out_dir,
                self.step,
                self.model,
                self.model_cfg,
                model_files=self._write_model_files,
                train_state=state,
                train_tensors=tensors,
                keep_last=self.cfg.keep_checkpoints,
            )
        except (OSError, safetensors.SafetensorError) as err:
            needed = checkpoint_nbytes(self.model, tensors)
            raise save_failed(self.out_dir, self.step, err, previous, needed) from err
        return step_dir

    def _save_sharded(self) -> Path:
        """FSDP: rank 0 opens the step's temporary folder, every rank writes its shard of the
        weights and AdamW moments into it (torch.distributed.checkpoint), rank 0 adds the whole
        weights (model.safetensors, gathered: what generate reads), config, tokenizer and
        trainer state, and commits the folder only once all of it is there."""
        main = self.parallel.is_main
        tmp = Path(
            self.parallel.broadcast_text(
                str(begin_step_dir(self.out_dir, self.step)) if main else ""
            )
        )
        try:
            groups = save_sharded(tmp, self.model, self.optimizer)
            weights = full_weights(self.model)  # collective; rank 0 gets the tensors
            if main:
                whole = build_model(self.model_cfg)
                whole.load_state_dict(weights)
                write_step_files(
                    tmp,
                    self.step,
                    lambda d: save_model_files(d, whole, self.model_cfg, self.tokenizer),
                    self._train_state({"sharded": True, "param_groups": groups}),
                    rng_state_tensors(),
                )
                commit_step_dir(self.out_dir, self.step, tmp, self.cfg.keep_checkpoints)
        except BaseException:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.parallel.barrier()
        return self.out_dir / step_dir_name(self.step)

    # --- divergence ---

    def _diverged(self, what: str, step: int) -> DivergedError:
        last = newest_checkpoint(self.out_dir)
        kept = f"the last good checkpoint {last.name} is untouched" if last else "nothing was saved"
        return DivergedError(
            f"{what} at step {step}: training stopped and {kept}; lower train.learning_rate"
            f" (now {self.cfg.learning_rate:g}) or set train.grad_clip (now {self.cfg.grad_clip:g},"
            " e.g. 1.0), then continue with --resume or start over with --overwrite"
        )

    def _check_weights_finite(self) -> None:
        # A finite loss can still come with overflowing gradients: never save such weights.
        bad = [
            n for n, p in self.model.named_parameters() if not torch.isfinite(local_part(p)).all()
        ]
        if self.parallel.any_rank(bool(bad)):  # every rank stops, not only the one that saw it
            bad = bad or ["on another rank"]
            raise self._diverged(f"the weights became NaN/inf ({bad[0]}, ...)", self.step)

    # --- training ---

    def train_step(self) -> float:
        cfg = self.cfg
        lr = learning_rate(self.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum_steps):
            micro_step = self.step * cfg.grad_accum_steps + micro
            batch = self.task.train_batch(micro_step, cfg.batch_size, cfg.seed)  # all ranks'
            self.tokens_seen += self.task.tokens_in(batch)
            rows, weight = self.parallel.shard(batch)  # this rank's rows (all of them alone)
            last = micro == cfg.grad_accum_steps - 1
            with self.parallel.gradient_sync(last):  # inner micro-steps: no all-reduce
                with autocast(self.device, self.half):
                    out = self.parallel.loss(**to_device(rows, self.device))
                loss = out.loss * (weight / cfg.grad_accum_steps)
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += out.ce_loss.detach().float() * (weight / cfg.grad_accum_steps)
        total = self.parallel.global_mean(total)  # the whole batch's loss, the same on every rank
        if not math.isfinite(total):  # stop before the update spreads it into the weights
            raise self._diverged(f"the training loss became {total}", self.step + 1)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if self.scaler:
            self.scaler.step(self.optimizer)  # skips the step if fp16 gradients overflowed
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.train_losses.append(total)
        return total

    def fit(self, max_steps: int | None = None) -> TrainResult:
        """Train until max_steps (default: the config's), checkpointing along the way."""
        # The lock is taken again if an earlier fit() released it, and released on any exit; a
        # rank that dies or hangs in a step is one RankFailure line, not a traceback.
        with self.lock, self.parallel.peer_failures():
            return self._fit(max_steps)

    def _fit(self, max_steps: int | None) -> TrainResult:
        cfg = self.cfg
        stop = min(max_steps or cfg.max_steps, cfg.max_steps)
        if not self.old_run:  # with --overwrite it is written beside the first new checkpoint
            self._write_run_config()
        n_params = parameter_count(self.model)  # an int8 base's weights too
        n_trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        trained = "" if n_trained == n_params else f" ({n_trained:,} trained)"
        print(
            f"model: {n_params / 1e6:.2f}M parameters{trained} | vocab"
            f" {self.tokenizer.vocab_size} | task {self.task.name}: {self.task.n_train} training"
            " examples"
        )
        parallel = self.parallel.header()
        if parallel is not None:
            print(parallel)
        if self.step >= stop:
            print(f"nothing to train: the run is already at step {self.step} of {stop}")
        bar = progress_bar(self.step, stop, enabled=self.progress)
        self.model.train()
        val_loss = None
        t_start = time.perf_counter()
        tokens_per_s = 0.0
        with contextlib.closing(bar), StopRequests() as stop_requests:
            while self.step < stop:
                stop_requests.check()  # a Ctrl-C whose KeyboardInterrupt was swallowed
                loss = self.train_step()  # .item() inside waits for the device's work
                elapsed = time.perf_counter() - t_start
                tokens_per_s = self.tokens_seen / elapsed
                bar.update(1)
                counted = self.parallel.tokens_counted  # "" or " (all N ranks)"
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}{counted}")
                last = self.step == stop
                if self.step % cfg.eval_interval == 0 or last:
                    val_loss = evaluate(
                        self.model, self.task, cfg.batch_size, cfg.eval_batches, self.half
                    )
                    bar.write(
                        f"step {self.step}: train loss {loss:.4f} | val loss {val_loss:.4f} | "
                        f"{self.task.baseline_name} {self.task.baseline_loss:.4f} | "
                        f"{tokens_per_s:,.0f} tok/s{counted}"
                    )
                if self.step % cfg.checkpoint_interval == 0 or last:
                    with stop_requests.deferred():  # a Ctrl-C lets the checkpoint finish
                        self.save()
        if val_loss is None:  # a finished run resumed: report where it stands
            val_loss = evaluate(self.model, self.task, cfg.batch_size, cfg.eval_batches, self.half)
        return TrainResult(
            out_dir=self.out_dir,
            steps=self.step,
            train_losses=list(self.train_losses),
            val_loss=val_loss,
            baseline_name=self.task.baseline_name,
            baseline_loss=self.task.baseline_loss,
            tokens_per_s=tokens_per_s,
        )


def train(
    run: RunConfig, resume: bool = False, progress: bool = True, overwrite: bool = False
) -> TrainResult:
    """Train (or resume) the run described by `run` and return its losses."""
    trainer = Trainer(run, resume=resume, progress=progress, overwrite=overwrite)
    try:
        return trainer.fit()
    finally:
        trainer.close()
        trainer.parallel.close()
