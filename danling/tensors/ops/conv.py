"""Convolutions and max pooling on a padded batch: one call for all elements, then a crop per element.

Both are exact against running the op on each element. A convolution's implicit padding is zeros
and a max pool's is ``-inf``; the padded batch is filled with the same value, so every output
position an element really has sees the same inputs as it would alone (transposed convolutions
too: inputs past an element's end are zeros and add nothing). Output sizes follow torch's formulas.
"""

from __future__ import annotations

from functools import partial
from math import floor
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import layout
from ..nested_tensor import NestedTensor
from .common import per_element, plain
from .registry import register


def _tuple(value: Any, n: int) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


def _conv_size(size: int, kernel: int, stride: int, padding: int, dilation: int, transposed: bool, extra: int) -> int:
    if transposed:
        return (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + extra + 1
    return floor((size + 2 * padding - dilation * (kernel - 1) - 1) / stride) + 1


def _padded(nt: NestedTensor, fill: float) -> Tensor:
    return layout.to_padded(nt._values, nt._shapes, nt._permutation, nt._ragged, fill, nt._rmask())


def _crop(out: Tensor, nt: NestedTensor, sizes: list[tuple[int, ...]]) -> NestedTensor:
    """Keep each element's ``(C, *size)`` corner of a batch-first padded result (one gather, no per-row copies)."""
    shapes = tuple(torch.Size((out.shape[1], *size)) for size in sizes)
    permutation, ragged = layout.canonical(shapes)
    rmask = layout.ragged_mask(shapes, permutation, ragged, out.device)
    return nt._derive(layout.from_padded(out, shapes, permutation, ragged, rmask), shapes)


def _edge_padded(nt: NestedTensor, spatial: int) -> Tensor:
    """The batch padded by repeating each element's last value along every spatial dim."""
    out = _padded(nt, 0)
    for d in range(spatial):
        size = out.shape[2 + d]
        last = torch.tensor([s[1 + d] - 1 for s in nt._shapes], device=out.device)
        index = torch.minimum(torch.arange(size, device=out.device).view(1, -1), last.view(-1, 1))
        view = [len(nt)] + [1] * (out.dim() - 1)
        view[2 + d] = size
        out = out.gather(2 + d, index.view(view).expand_as(out))
    return out


def interpolate(
    func: Any, input: Any, size: Any = None, scale_factor: Any = None, mode: str = "nearest", *args: Any, **kw: Any
) -> Any:
    """``F.interpolate`` by scale factor on an edge-padded batch (exact: samples past an element's end
    are clamped to its last value, as alone); by size, or with corner alignment / antialiasing, per element."""
    align = kw.get("align_corners", args[0] if args else None)
    exact = size is None and scale_factor is not None and not align and not kw.get("antialias", False) and not args
    exact = exact and mode in ("nearest", "linear", "bilinear", "trilinear") and not kw.get("recompute_scale_factor")
    if not isinstance(input, NestedTensor) or not exact:
        from .generic import batched

        return batched(func, input, size, scale_factor, mode, *args, **kw)
    spatial = input.ndim - 2
    scales = _tuple(scale_factor, spatial)
    out = func(_edge_padded(input, spatial), None, scale_factor, mode, **kw)
    sizes = [tuple(floor(s[1 + d] * scales[d]) for d in range(spatial)) for s in input._shapes]
    return _crop(out, input, sizes)


def conv(
    func: Any, spatial: int, transposed: bool, input: Any, weight: Tensor, bias: Any = None, *args: Any, **kw: Any
) -> Any:
    """``F.conv{1,2,3}d`` / ``F.conv_transpose{1,2,3}d`` with ``(C, *spatial_i)`` elements."""
    names = (
        ("stride", "padding", "output_padding", "groups", "dilation")
        if transposed
        else ("stride", "padding", "dilation", "groups")
    )
    options = {**dict(zip(names, args)), **kw}
    if not isinstance(input, NestedTensor) or isinstance(weight, NestedTensor) or input.ndim != spatial + 2:
        return per_element(func, (input, weight, bias, *args), kw, split_dense=False)
    padding = options.get("padding", 0)
    if isinstance(padding, str):
        if padding == "same":  # the output keeps each element's own size
            sizes = [tuple(s[1:]) for s in input._shapes]
            out = func(_padded(input, 0), plain(weight), bias, **options)
            return _crop(out, input, sizes)
        padding = 0
    kernel = weight.shape[2:]
    stride, pad = _tuple(options.get("stride", 1), spatial), _tuple(padding, spatial)
    dilation, extra = _tuple(options.get("dilation", 1), spatial), _tuple(options.get("output_padding", 0), spatial)
    sizes = [
        tuple(
            _conv_size(s[d + 1], kernel[d], stride[d], pad[d], dilation[d], transposed, extra[d])
            for d in range(spatial)
        )
        for s in input._shapes
    ]
    out = func(_padded(input, 0), plain(weight), None if bias is None else plain(bias), **options)
    return _crop(out, input, sizes)


def max_pool(func: Any, spatial: int, input: Any, kernel_size: Any, *args: Any, **kw: Any) -> Any:
    """``F.max_pool{1,2,3}d`` with ``(C, *spatial_i)`` elements (indices are per element, so they run per element)."""
    names = ("stride", "padding", "dilation", "ceil_mode", "return_indices")
    options = {**dict(zip(names, args)), **kw}
    if not isinstance(input, NestedTensor) or options.get("return_indices") or input.ndim != spatial + 2:
        return per_element(func, (input, kernel_size, *args), kw, split_dense=False)
    kernel = _tuple(kernel_size, spatial)
    stride = _tuple(options.get("stride") or kernel_size, spatial)
    pad, dilation = _tuple(options.get("padding", 0), spatial), _tuple(options.get("dilation", 1), spatial)
    ceil = bool(options.get("ceil_mode", False))
    sizes = []
    for s in input._shapes:
        size = []
        for d in range(spatial):
            span = s[d + 1] + 2 * pad[d] - dilation[d] * (kernel[d] - 1) - 1
            count = (-(-span // stride[d]) if ceil else span // stride[d]) + 1
            if ceil and (count - 1) * stride[d] >= s[d + 1] + pad[d]:
                count -= 1  # the last window must start inside the input or its left padding
            size.append(count)
        sizes.append(tuple(size))
    fill = float("-inf") if input.dtype.is_floating_point else torch.iinfo(input.dtype).min
    out = func(_padded(input, fill), kernel_size, **options)
    return _crop(out, input, sizes)


def _register() -> None:
    for n in (1, 2, 3):
        register(getattr(F, f"conv{n}d"), partial(conv, getattr(F, f"conv{n}d"), n, False))
        register(getattr(torch, f"conv{n}d"), partial(conv, getattr(torch, f"conv{n}d"), n, False))
        transposed = getattr(F, f"conv_transpose{n}d")
        register(transposed, partial(conv, transposed, n, True))
        register(getattr(F, f"max_pool{n}d"), partial(max_pool, getattr(F, f"max_pool{n}d"), n))
    register((F.interpolate,), partial(interpolate, F.interpolate))


_register()
