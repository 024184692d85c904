"""Training on several processes, with PyTorch's own distributed engine (seed 000 §2.1-2.3: the
loop that bends billions of numbers, on more than one device).

    torchrun --nproc-per-node 2 -m glassformer train --config C --set train.strategy=ddp

torchrun starts N copies of the trainer and gives each its RANK, LOCAL_RANK and WORLD_SIZE and a
place to meet. Nothing here re-implements the engine: torch.distributed moves the numbers (nccl
on CUDA, gloo on CPU), DistributedDataParallel or FSDP2's fully_shard averages the gradients,
torch.distributed.checkpoint writes and reshards the sharded checkpoints (train/sharded.py),
and torchrun's elastic agent restarts a job whose worker died. What this module adds is the
bookkeeping that makes N processes compute what one process computes:

- every rank builds the same global batch (a pure function of seed and step) and keeps its own
  rows, so N processes see exactly the batches of one with the same train.batch_size;
- each rank's loss is weighted by its share of the global batch's learned positions, so the
  averaged gradient is the gradient of the global mean even when rows learn different numbers
  of tokens (chat fine-tuning), and the loss that is logged is the global one on every rank;
- inner micro-steps of gradient accumulation skip the all-reduce;
- the ranks check at start-up that they run the same config, instead of hanging later;
- a rank that stops answering (train.rank_timeout_s) or dies is one error line naming it
  (RankFailure), not torch.distributed's traceback, and not a silent wait.

Strategies ([train] strategy): "single" (one process), "ddp" (every rank holds the whole model
and optimizer; gradients are all-reduced), "fsdp" (FSDP2: every block and the model are
fully_shard-ed, so each rank holds 1/N of the weights, gradients and AdamW moments, with a
mixed-precision policy from train.dtype), "auto" (single for one process, ddp under torchrun).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from glassformer.config import ConfigError
from glassformer.train.config import STRATEGIES, TrainConfig
from glassformer.train.run_dir import newest_checkpoint


@dataclass(frozen=True)
class Ranks:
    """Where this process sits: torchrun's RANK, WORLD_SIZE and LOCAL_RANK (0, 1, 0 alone)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Ranks:
        def number(name: str, default: int) -> int:
            text = os.environ.get(name, str(default))
            try:
                return int(text)
            except ValueError:
                raise ConfigError(
                    f"{name}={text!r} is not a number: launch with torchrun, which sets it"
                ) from None

        return cls(number("RANK", 0), number("WORLD_SIZE", 1), number("LOCAL_RANK", 0))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def __str__(self) -> str:
        return f"rank {self.rank} of {self.world_size}"


def quiet_unless_main() -> None:
    """Under torchrun, ranks other than 0 print nothing to stdout (one log, one progress bar);
    their errors still reach stderr, named by rank (cli/__init__.py)."""
    if not Ranks.from_env().is_main:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (for the life of the process)


def restart_count() -> int:
    """How many times torchrun's agent has restarted this job (--max-restarts): > 0 means an
    earlier attempt died, and the trainer resumes from its newest checkpoint."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def resolve_strategy(strategy: str, world_size: int) -> str:
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"train.strategy={strategy!r} is not known: pick one of {', '.join(STRATEGIES)}"
        )
    if strategy == "auto":
        return "single" if world_size == 1 else "ddp"
    if strategy == "single" and world_size > 1:
        raise ConfigError(
            f"train.strategy='single' under torchrun with {world_size} processes: every process"
            " would train alone; use train.strategy=ddp or fsdp (or auto)"
        )
    return strategy


class _LossForward(nn.Module):
    """DDP prepares its gradient all-reduce in forward(): make the model's loss its forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch: Tensor):
        return self.model.loss(**batch)


class RankFailure(ValueError):
    """Another rank stopped answering within train.rank_timeout_s, or died, while this one
    waited for it in a collective. A ValueError, so the CLI prints it as one line: the cause
    is in another process, and this one's traceback only shows where it waited."""


# What torch.distributed's errors (RuntimeError, DistBackendError, ...) say when a peer went
# silent ("Timed out waiting 5000ms for recv operation", nccl's "Watchdog caught collective
# operation timeout") or went away (gloo: "Connection reset by peer", "Connection closed by
# peer"; a write to a dead socket: "Broken pipe").
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_LOST = re.compile(r"connection closed by peer|connection reset|broken pipe", re.IGNORECASE)


class Parallel:
    """How training is spread over the ranks; with strategy "single", not at all (every method
    is then the plain single-process step). timeout_s: train.rank_timeout_s; out_dir: the
    run's folder, whose newest checkpoint a RankFailure names."""

    def __init__(
        self,
        strategy: str,
        ranks: Ranks,
        device: torch.device,
        timeout_s: float = TrainConfig.rank_timeout_s,
        out_dir: str | Path | None = None,
    ) -> None:
        self.strategy, self.ranks, self.device = strategy, ranks, device
        self.timeout_s = timeout_s
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.model: nn.Module | None = None
        self._ddp: nn.Module | None = None

    # --- start and stop ---

    @classmethod
    def start(
        cls,
        strategy: str,
        device: torch.device,
        timeout_s: float = TrainConfig.rank_timeout_s,
        out_dir: str | Path | None = None,
    ) -> Parallel:
        """Join torchrun's process group (nothing to join for one process). `device` is the
        resolved train.device; on CUDA each rank takes GPU LOCAL_RANK. Every collective waits
        at most timeout_s for the other ranks (gloo and nccl apply the group's timeout to each
        one), then fails, and peer_failures() turns that into a RankFailure."""
        ranks = Ranks.from_env()
        strategy = resolve_strategy(strategy, ranks.world_size)
        if strategy == "single":
            return cls(strategy, ranks, device, timeout_s, out_dir)
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(
                f"train.strategy={strategy!r} runs on CPUs (gloo) or CUDA GPUs (nccl), not on"
                f" {device.type}: use --device cpu or cuda"
            )
        if device.type == "cuda":
            device = torch.device("cuda", ranks.local_rank)
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            # torchrun's store, as init_process_group would open it, with the keys of each
            # restart in a namespace of their own: without it a restarted job's ranks can read
            # the addresses the killed attempt published, and fail to connect.
            store, rank, world_size = next(dist.rendezvous("env://"))
            store = dist.PrefixStore(f"glassformer/restart-{restart_count()}", store)
            dist.init_process_group(
                backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
        return cls(strategy, ranks, device, timeout_s, out_dir)

    def check_batch_size(self, batch_size: int) -> None:
        """Each rank takes batch_size / world_size rows of every global batch."""
        world = self.ranks.world_size
        if batch_size % world:
            raise ConfigError(
                f"train.batch_size={batch_size} does not split over {world} processes: make it"
                f" a multiple of {world} (each process takes batch_size / {world} rows)"
            )

    def close(self) -> None:
        if self.strategy != "single" and dist.is_initialized():
            dist.destroy_process_group()

    @contextlib.contextmanager
    def peer_failures(self) -> Iterator[None]:
        """Around anything that waits for the other ranks. DDP's and FSDP's gradient
        all-reduces run inside forward, backward() and the optimizer step, so the trainer wraps
        its steps in this; Parallel's own collectives wrap themselves. A collective that timed
        out, or whose peer closed the connection, becomes one RankFailure naming the rank and
        the checkpoint to resume from; any other error passes through untouched."""
        if self.strategy == "single":
            yield
            return
        try:
            yield
        except RuntimeError as err:  # DistBackendError and DistError are RuntimeErrors
            failure = self._rank_failure(str(err))
            if failure is None:
                raise
            raise failure from err

    def _rank_failure(self, message: str) -> RankFailure | None:
        """The RankFailure that torch.distributed's error `message` means; None when it is
        about something else."""
        if _LOST.search(message):
            return RankFailure(
                f"lost the connection to {self._peer(message)} (it stopped or was killed):"
                f" {_gist(message)}; {self._resume_hint()} (torchrun --max-restarts N restarts"
                " the job and resumes by itself)"
            )
        if _TIMED_OUT.search(message):
            return RankFailure(
                f"{self._peer(message)} did not answer within {self.timeout_s:g} s"
                " (train.rank_timeout_s): it hangs, was stopped, or its node is unreachable; "
                f"{self._resume_hint()}, or raise train.rank_timeout_s if that rank is only slow"
            )
        return None

    def _peer(self, message: str) -> str:
        """The rank this one waited for: the other one of two, the one other rank the message
        names (gloo's monitored_barrier does), else "another rank" (gloo's transport errors
        name only an address)."""
        world = self.ranks.world_size
        if world == 2:
            return str(Ranks(1 - self.ranks.rank, world))
        named = {int(r) for r in re.findall(r"\brank (\d+)", message, re.IGNORECASE)}
        named.discard(self.ranks.rank)
        if len(named) == 1 and named < set(range(world)):
            return str(Ranks(named.pop(), world))
        return "another rank"

    def _resume_hint(self) -> str:
        newest = newest_checkpoint(self.out_dir) if self.out_dir is not None else None
        rerun = "rerun the same torchrun command with --resume"
        if newest is None:
            return f"no checkpoint was saved yet: {rerun}, which starts over"
        return f"the newest checkpoint {newest} is intact: {rerun}"

    @property
    def is_main(self) -> bool:
        return self.ranks.is_main

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"

    def header(self) -> str | None:
        """The line that says a run is one job of N ranks: strategy, world size, backend and
        what tokens/s counts (None for one process)."""
        if self.strategy == "single":
            return None
        backend = dist.get_backend() if dist.is_initialized() else "none"
        return (
            f"parallel: {self.strategy} | world size {self.ranks.world_size} | backend {backend}"
            f" on {self.device.type} | tok/s below counts all {self.ranks.world_size} ranks"
        )

    @property
    def tokens_counted(self) -> str:
        """Said after a tokens/s: nothing for one process; under torchrun, that it counts all
        ranks (each rank counts every row of the global batch, its own and the others')."""
        return "" if self.strategy == "single" else f" (all {self.ranks.world_size} ranks)"

    # --- the model ---

    def wrap(self, model: nn.Module, half: torch.dtype | None) -> None:
        """DDP around the model's loss, or FSDP2: each transformer block is one fully_shard
        unit (its weights are gathered just before it runs and freed after), then the model
        itself, whose loss() becomes an FSDP forward. `half`: train.dtype's compute dtype,
        FSDP's parameter dtype for the gathers (gradients are reduced in fp32)."""
        self.model = model
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            with self.peer_failures():  # DDP broadcasts rank 0's weights to the others
                self._ddp = DistributedDataParallel(_LossForward(model), device_ids=ids)
        elif self.strategy == "fsdp":
            from torch.distributed.fsdp import (
                MixedPrecisionPolicy,
                fully_shard,
                register_fsdp_forward_method,
            )

            from glassformer.nn.block import Block

            if half == torch.float16:
                raise ConfigError(
                    "train.strategy='fsdp' with fp16 (a GPU without bf16) needs a sharded"
                    " gradient scaler: use train.dtype=fp32, or train.strategy=ddp"
                )
            policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
            for module in model.modules():
                if isinstance(module, Block):
                    fully_shard(module, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            register_fsdp_forward_method(model, "loss")

    def loss(self, **batch: Tensor):
        """The model's LossOutput for this rank's rows, through DDP's forward under DDP."""
        if self._ddp is not None:
            return self._ddp(**batch)
        return self.model.loss(**batch)

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Around forward and backward: enabled=False on the inner micro-steps of gradient
        accumulation, which then keep their gradients local (no all-reduce) until the last."""
        if enabled or self.strategy == "single":
            yield
        elif self._ddp is not None:
            with self._ddp.no_sync():
                yield
        else:
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)

    # --- the batch ---

    def shard(self, batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], float]:
        """This rank's rows of a global batch, and the weight of its loss: world_size times its
        share of the batch's learned positions (targets or labels not -100). Gradients are
        averaged over ranks, so the weighted losses average to the loss of the whole batch."""
        world = self.ranks.world_size
        if world == 1:
            return batch, 1.0
        rows = next(iter(batch.values())).shape[0]
        self.check_batch_size(rows)
        for name, tensor in batch.items():
            if tensor.shape[0] != rows:
                raise ValueError(f"batch[{name!r}] has {tensor.shape[0]} rows, not {rows}")
        per_rank = rows // world
        start = self.ranks.rank * per_rank
        part = {name: tensor[start : start + per_rank] for name, tensor in batch.items()}
        total = learned_positions(batch)
        weight = world * learned_positions(part) / total if total else 1.0
        return part, weight

    # --- collectives ---

    def global_mean(self, value: Tensor) -> float:
        """Sum over ranks / world_size of a scalar: with `shard`'s weights, the global loss."""
        if self.strategy == "single":
            return value.item()
        value = value.detach().to(self.device, torch.float64).reshape(1)
        with self.peer_failures():
            dist.all_reduce(value)
        return value.item() / self.ranks.world_size

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when it is True on any (all ranks take the same branch)."""
        if self.strategy == "single":
            return flag
        value = torch.tensor([int(flag)], device=self.device)
        with self.peer_failures():
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def barrier(self) -> None:
        if self.strategy != "single":
            with self.peer_failures():
                dist.barrier()

    def broadcast_text(self, text: str) -> str:
        """Rank 0's `text` on every rank."""
        if self.strategy == "single":
            return text
        return self._gather_texts(text)[0]

    def check_same_config(self, config_json: str) -> None:
        """Refuse to start when the ranks were given different configs (a --set on one node
        only, another file): named here, instead of a hang or a silent mix later."""
        if self.strategy == "single":
            return
        texts = self._gather_texts(config_json)
        digests = [hashlib.sha256(t.encode()).hexdigest() for t in texts]
        differ = [rank for rank, d in enumerate(digests) if d != digests[0]]
        if differ:
            ours, theirs = json.loads(texts[0]), json.loads(texts[differ[0]])
            keys = sorted(
                f"{section}.{key}"
                for section in set(ours) | set(theirs)
                for key in set(ours.get(section, {})) | set(theirs.get(section, {}))
                if ours.get(section, {}).get(key) != theirs.get(section, {}).get(key)
            )
            raise ConfigError(
                f"the processes were started with different configs: rank {differ[0]} differs"
                f" from rank 0 in {', '.join(keys) or 'its sections'}"
                f" (ranks that differ: {', '.join(map(str, differ))}); give every process the"
                " same --config and --set values"
            )

    def _gather_texts(self, text: str) -> list[str]:
        # Strings travel as uint8 tensors (no pickling, unlike all_gather_object).
        data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=self.device)
        size = torch.tensor([data.numel()], device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.ranks.world_size)]
        with self.peer_failures():
            dist.all_gather(sizes, size)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[: data.numel()] = data
        gathered = [torch.zeros_like(padded) for _ in sizes]
        with self.peer_failures():
            dist.all_gather(gathered, padded)
        return [
            bytes(g[: int(s.item())].tolist()).decode()
            for g, s in zip(gathered, sizes, strict=True)
        ]


def _gist(message: str) -> str:
    """The first sentence of a torch.distributed error, without gloo's source location: "Read
    error [127.0.0.1]:56458: Connection reset by peer"."""
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", message.strip().splitlines()[0])
    return first.split(". ")[0].rstrip(".")


def learned_positions(batch: dict[str, Tensor]) -> int:
    """How many predictions a batch's loss averages over: targets (or labels) that are not
    -100, or its rows when it has neither."""
    for name in ("targets", "labels"):
        if name in batch:
            return int((batch[name] != -100).sum())
    return next(iter(batch.values())).shape[0]
