import chanfig
import pytest
from torch import nn

from danling.optim import build_optimizer, build_param_groups


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.encoder = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)


def names_of(model, group):
    lookup = {id(param): name for name, param in model.named_parameters()}
    return sorted(lookup[id(param)] for param in group["params"])


def test_groups_from_chanfig_config():
    model = Net()
    config = chanfig.Config()
    config.optim.type = "adamw"
    config.optim.lr = 1e-3
    config.optim.weight_decay = 0.1
    config.optim.betas = [0.9, 0.999]
    config.optim.param_groups = [
        {"pattern": r"(bias|norm\.weight)$", "weight_decay_multiplier": 0.0},
        {"pattern": r"^head\.weight$", "lr_multiplier": 10.0, "beta2": 0.95},
        {"pattern": r"^embed\.", "lr": 5e-4, "eps": 1e-6},
    ]
    optimizer = build_optimizer(model, config.optim)
    groups = optimizer.param_groups
    assert [names_of(model, group) for group in groups] == [
        ["encoder.weight"],
        ["encoder.bias", "head.bias", "norm.bias", "norm.weight"],
        ["head.weight"],
        ["embed.weight"],
    ]
    defaults = groups[0]
    assert (defaults["lr"], defaults["weight_decay"], defaults["betas"]) == (1e-3, 0.1, (0.9, 0.999))
    assert groups[1]["weight_decay"] == 0.0 and groups[1]["lr"] == 1e-3
    assert groups[2]["lr"] == pytest.approx(1e-2) and groups[2]["betas"] == (0.9, 0.95)
    assert groups[2]["weight_decay"] == 0.1
    assert (groups[3]["lr"], groups[3]["eps"]) == (5e-4, 1e-6)
    assert sum(len(group["params"]) for group in groups) == 7  # frozen parameters are left out


def test_two_patterns_error_names_both():
    model = Net()
    specs = [{"pattern": r"bias$", "weight_decay": 0.0}, {"pattern": r"^head\.", "lr": 0.1}]
    with pytest.raises(ValueError, match="'head.bias' matches more than one") as error:
        build_param_groups(model.named_parameters(), specs)
    assert repr(r"bias$") in str(error.value) and repr(r"^head\.") in str(error.value)


def test_multipliers_use_optimizer_defaults():
    model = nn.Linear(2, 2)
    optimizer = build_optimizer(
        model, {"type": "adam", "param_groups": [{"pattern": "bias", "lr_multiplier": 0.5, "beta1": 0.8}]}
    )
    assert optimizer.param_groups[1]["lr"] == pytest.approx(0.0005)  # Adam's default lr is 1e-3
    assert optimizer.param_groups[1]["betas"] == (0.8, 0.999)


def test_unmatched_pattern_warns_and_is_dropped():
    model = nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="'\\^decoder' matched no parameter"):
        groups = build_param_groups(model.named_parameters(), [{"pattern": "^decoder", "lr": 1.0}])
    assert len(groups) == 1 and "lr" not in groups[0]


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        ({"lr": 0.1}, {}, r"param_groups\[0\] needs a string 'pattern', got None"),
        ({"pattern": "("}, {}, "invalid pattern '\\('"),
        ({"pattern": "bias", "lr": 0.1, "lr_multiplier": 2}, {"lr": 1.0}, "sets both lr and lr_multiplier"),
        ({"pattern": "bias", "lr_multiplier": 2}, {}, "no top-level lr is known"),
        ({"pattern": "bias", "beta1": 0.5}, {}, "optimizer has no betas"),
        ({"pattern": "bias", "lr": -1.0}, {}, "negative learning rate: -1.0"),
        ("bias", {}, "must be a mapping"),
    ],
)
def test_bad_specs(spec, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_param_groups(nn.Linear(2, 2).named_parameters(), [spec], **kwargs)


def test_sgd_has_no_betas():
    with pytest.raises(ValueError, match="optimizer has no betas"):
        build_optimizer(
            nn.Linear(2, 2), {"type": "sgd", "lr": 0.1, "param_groups": [{"pattern": "bias", "beta2": 0.9}]}
        )


def test_param_groups_need_names():
    with pytest.raises(ValueError, match="needs named parameters"):
        build_optimizer(list(nn.Linear(2, 2).parameters()), {"type": "sgd", "param_groups": [{"pattern": "bias"}]})
