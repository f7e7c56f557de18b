"""A runner whose `trap` module turns non-finite when a marked sample passes, for the replay tests.

The mark is data (a sample whose first feature is `MARK`), so a replay of the same micro-batches on
one process hits it again; the runner class is importable, so `danling replay` can rebuild it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from danling.runners.update.spikes import LossSpike
from tests.runners._torch_toy import TinyRunner, make_data

MARK = 777.0


class _NaNGradient(torch.autograd.Function):
    """The identity forward; a NaN gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class Trap(nn.Module):
    """Identity, except while `armed`: NaN output (`where="forward"`), NaN input gradient (`"backward"`)
    or a finite output 1000 times too large (`"spike"`: a loss spike)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where, self.armed = where, False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return h
        if self.where == "spike":
            return h * 1000.0
        return h * float("nan") if self.where == "forward" else _NaNGradient.apply(h)


class Probe(nn.Module):
    """encoder -> trap -> head; the trap arms itself when the batch holds a marked sample."""

    def __init__(self, where: str, dropout: float) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 8)
        self.trap = Trap(where)
        self.head = nn.Sequential(nn.ReLU(), nn.Dropout(dropout), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.trap.armed = bool((x[:, 0] == MARK).any())
        return self.head(self.trap(self.encoder(x)))


class Marked(Dataset):
    """`make_data(n)`, with the samples in `indices` marked when `marked`; with `after`, only the sample
    fetched after `after` others is marked instead (a known step: batch `after // batch size + 1`)."""

    def __init__(self, n: int, indices: tuple[int, ...], marked: bool, after: int | None = None) -> None:
        self.data, self.indices, self.marked, self.after, self.fetched = make_data(n), indices, marked, after, 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        x, y = self.data[i]
        fetched, self.fetched = self.fetched, self.fetched + 1
        hit = i in self.indices if self.after is None else fetched == self.after
        if self.marked and hit:
            x = x.clone()
            x[0] = MARK
        return x, y


class TrapRunner(TinyRunner):
    """TinyRunner on `Probe`, its trap going off in the forward pass; the samples `poison` are marked on
    rank `poison_rank`. `armed_at` is the global step of the update the trap first fired in (the run's own
    account, to compare with the bundle's); `spiked_loss` the loss of a spike that asked for a rollback."""

    n_train = 32
    where = "forward"
    poison: tuple[int, ...] = (13,)
    poison_rank = 0
    poison_after: int | None = None

    def __init__(self, config) -> None:
        super().__init__(config)
        self.model = Probe(self.where, self.dropout)
        marked = self.rank == self.poison_rank
        self.datasets.train = Marked(self.n_train, self.poison, marked, self.poison_after)
        self.armed_at: int | None = None
        self.spiked_loss: float | None = None

    def train_step(self, data):
        step = self.train_state.global_step + 1
        try:
            return super().train_step(data)
        except LossSpike as spike:
            self.spiked_loss = spike.loss
            raise
        finally:
            if self.armed_at is None and self.unwrap(self.model).trap.armed:
                self.armed_at = step


class BackwardTrapRunner(TrapRunner):
    """The trap's gradient goes NaN instead (its forward stays finite)."""

    where = "backward"


class SpikeTrapRunner(TrapRunner):
    """The trap scales its output up: the loss spikes, finite."""

    where = "spike"


class RankOneTrapRunner(TrapRunner):
    """The 13th sample rank 1 loads is marked: the first of its fourth batch, so global step 4 fails."""

    poison_after = 12
    poison_rank = 1
