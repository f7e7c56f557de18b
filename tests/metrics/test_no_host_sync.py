"""Updates must never read tensor values on the host (that would stall an accelerator)."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from danling.metrics import (
    AverageMeters,
    binary_metrics,
    multiclass_metrics,
    multilabel_metrics,
    regression_metrics,
    sides,
)
from danling.metrics import functional as F
from danling.metrics.functional import _common

SYNCING = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"}
SYNCING |= {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}


class ForbidHostSync(TorchFunctionMode):
    """Fail on any torch call whose result depends on tensor values being copied to the host."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in SYNCING:
            raise AssertionError(f"host synchronisation through {name}")
        if name == "where" and len(args) + len(kwargs) == 1:
            raise AssertionError("host synchronisation through torch.where(condition)")
        if name in ("__getitem__", "__setitem__"):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                raise AssertionError("host synchronisation through boolean-mask indexing")
        return func(*args, **kwargs)


def test_guard_catches_syncs():
    x = torch.rand(4)
    for call in (lambda: x.sum().item(), lambda: bool(x.sum() > 0), lambda: x[x > 0.5], lambda: torch.where(x > 0)):
        with pytest.raises(AssertionError, match="host synchronisation"), ForbidHostSync():
            call()


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 5, (64,), generator=g)
    target[:4] = -100
    labels = torch.randint(0, 2, (64, 3), generator=g)
    labels[0, 0] = -100
    return {
        "binary": (torch.randn(64, generator=g), (target % 2).masked_fill(target == -100, -100)),
        "multiclass": (torch.randn(64, 5, generator=g), target),
        "multilabel": (torch.randn(64, 3, generator=g), labels),
        "regression": (torch.randn(64, 2, generator=g), torch.randn(64, 2, generator=g)),
    }


def containers():
    for mode in ("global", "stream"):
        yield (
            "binary",
            binary_metrics(["acc", "balanced_acc", "precision", "recall", "f1", "mcc", "auroc", "auprc"], mode=mode),
        )
        yield "multiclass", multiclass_metrics(5, ["acc", "balanced_acc", "f1", "mcc", "auroc", "auprc"], mode=mode)
        yield "multilabel", multilabel_metrics(3, ["acc", "balanced_acc", "f1", "mcc", "auroc", "auprc"], mode=mode)
        names = ["pearson", "r2", "mse", "rmse", "mae"] + (["spearman"] if mode == "global" else [])
        yield "regression", regression_metrics(2, names, mode=mode)
        yield "multiclass", multiclass_metrics(5, ["acc", "auroc", "auprc"], mode=mode, bins=32)
        yield "multilabel", multilabel_metrics(3, ["auroc", "auprc"], mode=mode, bins=32)
        yield "binary", binary_metrics(["auroc", "auprc"], mode=mode, bins=32)


@pytest.fixture(autouse=True)
def _accelerator_bincount(monkeypatch):
    # torch.bincount syncs on CUDA; take the scatter path that accelerators use, on CPU tensors.
    monkeypatch.setattr(_common, "HOST_BINCOUNT_DEVICES", ())
    # Likewise the device-side target check of micro accuracy rather than its CPU host read.
    monkeypatch.setattr(_common, "HOST_READ_DEVICES", ())
    # And binary scores kept in order, as on an accelerator, not split by label on the host.
    monkeypatch.setattr(sides, "HOST_DEVICES", ())


def test_container_updates_do_not_synchronise():
    batches = data()
    for task, metrics in containers():
        with ForbidHostSync():
            metrics.update(*batches[task])
            metrics.update(*batches[task])
        assert len(metrics.avg) > 0  # reading afterwards is allowed
    meters = AverageMeters()
    with ForbidHostSync():
        meters.update(loss=torch.tensor(0.3), acc=torch.tensor([0.1, 0.2]))


def test_functional_metrics_do_not_synchronise():
    batches = data()
    x, y = batches["binary"]
    mx, my = batches["multiclass"]
    lx, ly = batches["multilabel"]
    rx, ry = batches["regression"]
    with ForbidHostSync():
        for fn in (F.binary_accuracy, F.binary_f1_score, F.binary_mcc, F.binary_auroc, F.binary_auprc):
            fn(x, y, ignore_index=-100)
        for fn in (F.multiclass_accuracy, F.multiclass_f1_score, F.multiclass_auroc, F.multiclass_auprc):
            fn(mx, my, ignore_index=-100)
        F.accuracy(mx, my.clamp(min=0))  # the per-batch call without options
        F.multiclass_accuracy(mx, my)
        for fn in (F.multilabel_accuracy, F.multilabel_precision, F.multilabel_auroc, F.multilabel_auprc):
            fn(lx, ly, ignore_index=-100)
        for fn in (F.pearson, F.r2_score, F.mse, F.rmse, F.mae, F.spearman):
            fn(rx, ry)


def test_scatter_bincount_matches_bincount(monkeypatch):
    index = torch.randint(0, 7, (100,))
    scattered = _common.bincount(index, 9)
    monkeypatch.setattr(_common, "HOST_BINCOUNT_DEVICES", ("cpu",))
    assert torch.equal(scattered, _common.bincount(index, 9))
    assert torch.equal(scattered, torch.bincount(index, minlength=9))
