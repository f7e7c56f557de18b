"""Sequence layers and losses: recurrent nets, multi-head attention, batch norm, bags and extra losses.

- RNNs (``nn.LSTM``/``nn.GRU``/``nn.RNN`` reach ``torch.lstm``/``gru``/``rnn_*``) pack the elements
  once as a ``PackedSequence`` and run a single call; every element is its own sequence. The
  module's ``batch_first`` must match the NestedTensor's (it decides the hidden state's batch size).
- ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``) runs per element.
- ``F.batch_norm`` normalises each channel (element dim 0) over every real position of the batch.
- ``F.embedding_bag`` treats every element as one bag.
- Losses run on the packed values: with ``reduction="mean"`` the mean is over all real
  positions of the batch (a token-level mean), ``"sum"`` sums them, ``"none"`` returns a
  NestedTensor. ``F.ctc_loss`` pads once and takes the lengths from the elements.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_sequence, pad_packed_sequence

from .. import layout
from ..nested_tensor import NestedTensor
from .common import first_nested, nest_results, nested_arg, plain
from .registry import register

LOSS_OPERANDS = {
    "cross_entropy": ("input", "target"),
    "nll_loss": ("input", "target"),
    "mse_loss": ("input", "target"),
    "l1_loss": ("input", "target"),
    "smooth_l1_loss": ("input", "target"),
    "huber_loss": ("input", "target"),
    "binary_cross_entropy": ("input", "target"),
    "binary_cross_entropy_with_logits": ("input", "target"),
    "kl_div": ("input", "target"),
    "soft_margin_loss": ("input", "target"),
    "poisson_nll_loss": ("input", "target"),
    "gaussian_nll_loss": ("input", "target", "var"),
    "hinge_embedding_loss": ("input", "target"),
    "margin_ranking_loss": ("input1", "input2", "target"),
    "cosine_embedding_loss": ("input1", "input2", "target"),
    "multilabel_margin_loss": ("input", "target"),
    "multilabel_soft_margin_loss": ("input", "target"),
    "multi_margin_loss": ("input", "target"),
    "triplet_margin_loss": ("anchor", "positive", "negative"),
    "triplet_margin_with_distance_loss": ("anchor", "positive", "negative"),
}


def _packed(arg: Any, ref: NestedTensor) -> tuple[Tensor, NestedTensor | None]:
    """Packed values of a loss operand; a dense operand with the batch dim is cut along ``ref``'s elements."""
    if isinstance(arg, NestedTensor):
        return arg._values, arg
    if isinstance(arg, Tensor) and arg.dim() > 0:
        nested = ref.nested_like(plain(arg), strict=False)
        return nested._values, nested
    return arg, None


def loss(func: Any, names: tuple[str, ...], *args: Any, **kwargs: Any) -> Any:
    """A loss over real positions only: its operands are packed, padding never reaches ``func``."""
    count = len(names)
    operands = list(args[:count]) + [kwargs.pop(n) for n in names[len(args[:count]) :] if n in kwargs]
    if len(operands) != count:
        raise TypeError(f"{func.__name__} needs the operands {names}")
    ref = first_nested(operands)
    packed = [_packed(o, ref) for o in operands]
    # A NestedTensor among the other arguments (a per-position `weight`) is packed as well: left
    # nested, it would reach `func` beside the packed operands. Dense ones (class weights) stay.
    rest = [arg._values if isinstance(arg, NestedTensor) else arg for arg in args[count:]]
    kwargs = {key: arg._values if isinstance(arg, NestedTensor) else arg for key, arg in kwargs.items()}
    out = func(*[p[0] for p in packed], *rest, **kwargs)
    rows = packed[-1][0].shape[0] if isinstance(packed[-1][0], Tensor) and packed[-1][0].dim() else None
    shaped = next((n for _, n in reversed(packed) if n is not None), ref)
    if isinstance(out, Tensor) and out.dim() > 0 and out.shape[0] == rows:
        return shaped._derive(out, tuple(torch.Size((*s[:1], *out.shape[1:])) for s in shaped._shapes))
    return out


def linear_cross_entropy(input: Any, linear_weight: Tensor, target: Any, **kwargs: Any) -> Any:
    """``F.linear_cross_entropy`` over real positions: ``linear_weight`` is a layer, not an operand."""
    return loss(
        lambda i, t, **kw: F.linear_cross_entropy(i, plain(linear_weight), t, **kw),
        ("input", "target"),
        input,
        target,
        **kwargs,
    )


def ctc_loss(
    log_probs: NestedTensor,
    targets: Any,
    input_lengths: Any = None,
    target_lengths: Any = None,
    *args: Any,
    **kwargs: Any,
) -> Tensor:
    """CTC with ``(T_i, C)`` log-probability elements and ``(S_i,)`` target elements: lengths come from them."""
    if not isinstance(log_probs, NestedTensor):
        return F.ctc_loss(
            log_probs, targets._values, input_lengths, target_lengths or targets._offsets.diff(), *args, **kwargs
        )
    padded = layout.to_padded(
        log_probs._values, log_probs._shapes, log_probs._permutation, log_probs._ragged, 0, log_probs._rmask()
    )
    if input_lengths is None:
        input_lengths = torch.tensor([s[0] for s in log_probs._shapes], dtype=torch.long)
    if isinstance(targets, NestedTensor):
        if target_lengths is None:
            target_lengths = torch.tensor([s[0] for s in targets._shapes], dtype=torch.long)
        targets = targets._values
    return F.ctc_loss(padded.transpose(0, 1), targets, input_lengths, target_lengths, *args, **kwargs)


def batch_norm(input: NestedTensor, *args: Any, **kwargs: Any) -> NestedTensor:
    """Normalise each channel (element dim 0) over all real positions of the batch."""
    channels = {s[0] for s in input._shapes} if input.ndim > 1 else set()
    if len(channels) != 1:
        raise ValueError(
            f"F.batch_norm needs every element to have the same channel count (dim 0), got {sorted(channels)}"
        )
    (count,) = channels
    elements = [e.movedim(0, -1) for e in input._elements()]
    rows = torch.cat([e.reshape(-1, count) for e in elements])
    out = F.batch_norm(rows, *[plain(a) if isinstance(a, Tensor) else a for a in args], **kwargs)
    parts = out.split([e.numel() // count for e in elements])
    return input._from_elements([p.reshape(e.shape).movedim(-1, 0) for p, e in zip(parts, elements)])


def embedding_bag(input: NestedTensor, weight: Tensor, offsets: Any = None, *args: Any, **kwargs: Any) -> Tensor:
    """One bag per element of 1-D indices: a dense ``(B, D)`` result."""
    if offsets is not None or input.ndim != 2:
        raise ValueError("F.embedding_bag with a NestedTensor takes one bag per 1-D element and no offsets")
    weights = kwargs.get("per_sample_weights")
    if isinstance(weights, NestedTensor):
        kwargs["per_sample_weights"] = weights._values
    starts = input._offsets[:-1].to(input._values.device)
    return F.embedding_bag(input._values, plain(weight), starts, *args, **kwargs)


def rnn(func: Any, input: NestedTensor, hx: Any, params: Any, *args: Any) -> tuple:
    """``torch.lstm``/``gru``/``rnn_tanh``/``rnn_relu`` on a NestedTensor: one packed call for all elements."""
    if not isinstance(input, NestedTensor) or input.ndim != 3:
        raise TypeError(f"{func.__name__} needs a NestedTensor of (L_i, features) elements as input")
    args = args[:-1]  # batch_first: elements are sequences either way
    states = list(hx) if isinstance(hx, (list, tuple)) else [hx]
    if states[0].shape[1] != len(input):
        raise ValueError(
            f"the hidden state holds {states[0].shape[1]} sequences but the NestedTensor {len(input)}: "
            "set the RNN module's batch_first to the NestedTensor's batch_first"
        )
    packed = pack_sequence(list(input._elements()), enforce_sorted=False)
    states = [s.index_select(1, packed.sorted_indices) for s in states]
    out = func(packed.data, packed.batch_sizes, states if isinstance(hx, (list, tuple)) else states[0], params, *args)
    result = PackedSequence(out[0], packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
    padded, lengths = pad_packed_sequence(result, batch_first=True)
    outputs = input._from_elements([row[:n] for row, n in zip(padded, lengths.tolist())])
    return (outputs, *[s.index_select(1, packed.unsorted_indices) for s in out[1:]])


def multi_head_attention(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    """``F.multi_head_attention_forward`` per element (each element is an unbatched ``(L_i, E)`` sequence)."""
    ref = first_nested((query, key, value))
    padding = kwargs.pop("key_padding_mask", None)
    results = []
    for i in range(len(ref)):
        options = dict(kwargs)
        if padding is not None:
            options["key_padding_mask"] = (
                nested_arg(padding, i, ref) if isinstance(padding, NestedTensor) else padding[i]
            )
        q, k, v = (nested_arg(x, i, ref) for x in (query, key, value))
        results.append(F.multi_head_attention_forward(q, k, v, *args, **options))
    return nest_results(results, ref)


def _register() -> None:
    for name, names in LOSS_OPERANDS.items():
        register(getattr(F, name), partial(loss, getattr(F, name), names))
    register((F.ctc_loss,), ctc_loss)
    if hasattr(F, "linear_cross_entropy"):
        register((F.linear_cross_entropy,), linear_cross_entropy)
    register((F.batch_norm,), batch_norm)
    register((F.embedding_bag,), embedding_bag)
    for name in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
        register(getattr(torch, name), partial(rnn, getattr(torch, name)))
    register((F.multi_head_attention_forward,), multi_head_attention)


_register()
