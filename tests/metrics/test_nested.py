"""NestedTensor inputs count only their valid elements: the result equals that of `.concat`."""

import pytest
import torch

from danling.metrics import MetricMeter, multiclass_metrics, regression_metrics
from danling.metrics import functional as F
from danling.tensors import NestedTensor


def ragged(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 2, 7]
    logits = NestedTensor([torch.randn(n, 3, generator=g) for n in lengths])
    labels = NestedTensor([torch.randint(0, 3, (n,), generator=g) for n in lengths])
    values = NestedTensor([torch.randn(n, generator=g) for n in lengths])
    targets = NestedTensor([torch.randn(n, generator=g) for n in lengths])
    return logits, labels, values, targets


def test_functional_metrics_use_the_valid_elements():
    logits, labels, values, targets = ragged()
    assert F.multiclass_f1_score(logits, labels) == F.multiclass_f1_score(logits.concat, labels.concat)
    assert F.multiclass_auroc(logits, labels) == F.multiclass_auroc(logits.concat, labels.concat)
    assert F.pearson(values, targets) == F.pearson(values.concat, targets.concat)
    assert F.spearman(values, targets) == F.spearman(values.concat, targets.concat)


@pytest.mark.parametrize("mode", ["global", "stream"])
def test_containers_match_concatenated_inputs(mode):
    nested, flat = multiclass_metrics(3, mode=mode), multiclass_metrics(3, mode=mode)
    nested_reg, flat_reg = regression_metrics(mode=mode), regression_metrics(mode=mode)
    for seed in range(3):
        logits, labels, values, targets = ragged(seed)
        nested.update(logits, labels)
        flat.update(logits.concat, labels.concat)
        nested_reg.update(values, targets)
        flat_reg.update(values.concat, targets.concat)
    assert nested.avg.dict() == flat.avg.dict()
    assert nested_reg.avg.dict() == flat_reg.avg.dict()
    if mode == "stream":  # weighted by the number of valid tokens, not by the padded size
        assert nested.count["acc"] == sum(len(ragged(seed)[1].concat) for seed in range(3))


def test_metric_meter_with_nested_tensors():
    logits, labels, _, _ = ragged()
    meter = MetricMeter(F.multiclass_accuracy)
    meter.update(logits, labels)
    assert meter.val == F.multiclass_accuracy(logits.concat, labels.concat).item()
    assert meter.count == len(labels.concat)
