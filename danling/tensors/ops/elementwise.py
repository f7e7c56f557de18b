"""Element-wise math, comparisons, conversions and attribute pass-through.

Element-wise ops never look at padding: they run once on the packed values. Operands are
lined up with `danling.tensors.ops.common.align`; when that is impossible (for example
two NestedTensors with different ragged sizes that only broadcast per element) the op runs
element by element instead.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..nested_tensor import NestedTensor
from .common import Misaligned, align, first_nested, per_element, plain, rebuild
from .registry import GETTERS, HANDLERS, register, torch_variants

UNARY = [
    "abs",
    "absolute",
    "acos",
    "arccos",
    "acosh",
    "arccosh",
    "asin",
    "arcsin",
    "asinh",
    "arcsinh",
    "atan",
    "arctan",
    "atanh",
    "arctanh",
    "ceil",
    "floor",
    "round",
    "trunc",
    "fix",
    "frac",
    "cos",
    "cosh",
    "sin",
    "sinh",
    "tan",
    "tanh",
    "exp",
    "exp2",
    "expm1",
    "log",
    "log10",
    "log1p",
    "log2",
    "neg",
    "negative",
    "reciprocal",
    "rsqrt",
    "sqrt",
    "square",
    "sign",
    "sgn",
    "signbit",
    "sigmoid",
    "logit",
    "erf",
    "erfc",
    "erfinv",
    "lgamma",
    "digamma",
    "i0",
    "sinc",
    "deg2rad",
    "rad2deg",
    "angle",
    "bitwise_not",
    "logical_not",
    "isnan",
    "isinf",
    "isfinite",
    "isposinf",
    "isneginf",
    "isreal",
    "nan_to_num",
    "clamp",
    "clip",
    "clamp_min",
    "clamp_max",
    "positive",
    "conj",
    "relu",
    "conj_physical",
    "resolve_conj",
    "resolve_neg",
    "mvlgamma",
    "poisson",
    "frexp",
    "real",
    "imag",
]
BINARY = [
    "add",
    "sub",
    "subtract",
    "mul",
    "multiply",
    "div",
    "divide",
    "true_divide",
    "floor_divide",
    "remainder",
    "fmod",
    "pow",
    "float_power",
    "atan2",
    "arctan2",
    "maximum",
    "minimum",
    "fmax",
    "fmin",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "greater",
    "greater_equal",
    "less",
    "less_equal",
    "not_equal",
    "logical_and",
    "logical_or",
    "logical_xor",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "bitwise_left_shift",
    "bitwise_right_shift",
    "hypot",
    "copysign",
    "heaviside",
    "xlogy",
    "lerp",
    "addcmul",
    "addcdiv",
    "masked_fill",
    "isclose",
    "logaddexp",
    "logaddexp2",
    "gcd",
    "lcm",
    "ldexp",
    "nextafter",
    "igamma",
    "igammac",
    "rsub",
    "polygamma",
    "binomial",
    "complex",
    "polar",
]
DUNDERS = [
    "add",
    "radd",
    "iadd",
    "sub",
    "rsub",
    "isub",
    "mul",
    "rmul",
    "imul",
    "truediv",
    "rtruediv",
    "itruediv",
    "div",
    "rdiv",
    "idiv",
    "floordiv",
    "rfloordiv",
    "ifloordiv",
    "mod",
    "rmod",
    "imod",
    "pow",
    "rpow",
    "ipow",
    "and",
    "rand",
    "iand",
    "or",
    "ror",
    "ior",
    "xor",
    "rxor",
    "ixor",
    "lshift",
    "rlshift",
    "ilshift",
    "rshift",
    "rrshift",
    "irshift",
    "lt",
    "le",
    "gt",
    "ge",
    "neg",
    "pos",
    "abs",
    "invert",
]
CONVERSIONS = [
    "clone",
    "detach",
    "detach_",
    "contiguous",
    "float",
    "double",
    "half",
    "bfloat16",
    "int",
    "long",
    "short",
    "bool",
    "byte",
    "char",
    "cfloat",
    "cdouble",
    "cpu",
    "cuda",
    "type_as",
    "zero_",
    "fill_",
    "normal_",
    "uniform_",
    "bernoulli_",
    "bernoulli",
    "random_",
    "exponential_",
    "retain_grad",
    "share_memory_",
    "record_stream",
    "copy_",
    "chalf",
]
LIKE = ["zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like", "randint_like"]
ACTIVATIONS = [
    "relu",
    "relu6",
    "elu",
    "selu",
    "celu",
    "leaky_relu",
    "gelu",
    "silu",
    "mish",
    "softplus",
    "softsign",
    "tanhshrink",
    "hardtanh",
    "hardsigmoid",
    "hardswish",
    "logsigmoid",
    "sigmoid",
    "tanh",
    "threshold",
    "hardshrink",
    "softshrink",
    "rrelu",
    "dropout",
    "alpha_dropout",
    "feature_alpha_dropout",
]
PASSTHROUGH = [
    "is_floating_point",
    "is_complex",
    "is_signed",
    "element_size",
    "get_device",
    "is_contiguous",
    "is_pinned",
    "is_shared",
    "data_ptr",
    "new_zeros",
    "new_ones",
    "new_full",
    "new_empty",
    "new_tensor",
    "untyped_storage",
    "storage_offset",
]
GETTER_NAMES = [
    "is_cuda",
    "is_cpu",
    "is_meta",
    "is_mps",
    "is_xpu",
    "is_sparse",
    "is_quantized",
    "is_mkldnn",
    "layout",
    "is_leaf",
    "grad_fn",
    "itemsize",
    "_version",
    "output_nr",
    "retains_grad",
    "nbytes",
]


def elementwise(func: Any, *args: Any, **kwargs: Any) -> Any:
    """Apply ``func`` to the packed values of the NestedTensor operands."""
    ref = first_nested(args, kwargs)
    name = getattr(func, "__name__", "")
    inplace = (name.endswith("_") and not name.endswith("__")) or (name.startswith("__i") and name != "__invert__")
    if inplace and not isinstance(args[0], NestedTensor):
        raise TypeError(f"in-place {func.__name__} on a dense tensor with a NestedTensor operand is not supported")
    try:
        new_args = [align(a, ref) for a in args]
        new_kwargs = {k: align(v, ref) for k, v in kwargs.items()}
    except Misaligned:
        out = per_element(func, args, kwargs, ref)
        return args[0] if inplace else out
    out = func(*new_args, **new_kwargs)
    if inplace:
        return args[0]
    if out is None:  # e.g. retain_grad
        return None
    if isinstance(out, tuple):  # several element-wise results (frexp)
        return rebuild(out, [ref._derive(plain(o)) for o in out])
    if isinstance(out, Tensor) and out.dim() == ref._values.dim() > 0 and out.shape[0] == ref._values.shape[0]:
        return ref._derive(plain(out))
    if out is NotImplemented:
        return out
    raise TypeError(
        f"{func.__name__} produced a result of shape {tuple(getattr(out, 'shape', ()))} that does not fit the "
        "packed NestedTensor layout"
    )


def _values_call(func: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``func`` on the packed values and return its raw result (metadata queries, ``new_*``)."""
    return func(self._values, *args, **kwargs)


def _allclose(func: Any, input: Any, other: Any, *args: Any, **kwargs: Any) -> bool:
    ref = first_nested((input, other))
    try:
        a, b = align(input, ref), align(other, ref)
    except (Misaligned, ValueError):  # different batch sizes or shapes are simply not close
        return False
    if isinstance(input, NestedTensor) and isinstance(other, NestedTensor) and input._shapes != other._shapes:
        return False
    return func(a, b, *args, **kwargs)


def _equal(input: Any, other: Any) -> bool:
    if not (isinstance(input, NestedTensor) and isinstance(other, NestedTensor)):
        return False
    return input._shapes == other._shapes and torch.equal(input._values, other._values)


def _where(condition: Any, input: Any = None, other: Any = None) -> Any:
    if input is None and other is None:
        raise TypeError("NestedTensor does not support torch.where(condition) without values; use .nonzero on .tensor")
    return elementwise(torch.where, condition, input, other)


def _tensor_where(self: Any, condition: Any, y: Any) -> Any:
    return elementwise(torch.where, condition, self, y)


def _backward(self: NestedTensor, gradient: Any = None, *args: Any, **kwargs: Any) -> None:
    grad = None if gradient is None else align(gradient, self)
    self._values.backward(grad, *args, **kwargs)


def _register() -> None:
    for name in UNARY + BINARY:
        for func in torch_variants(name, inplace=True):
            if func is not None:
                register(func, partial(elementwise, func))
    for name in DUNDERS:
        func = getattr(torch.Tensor, f"__{name}__", None)
        if func is not None:
            register(func, partial(elementwise, func))
    for name in CONVERSIONS:
        func = getattr(torch.Tensor, name, None)
        if func is not None:
            register(func, partial(elementwise, func))
    for func in (torch.clone, torch.detach, torch.detach_, torch.bernoulli):
        register(func, partial(elementwise, func))
    for name in LIKE:
        register(getattr(torch, name), partial(elementwise, getattr(torch, name)))
    for name in ACTIVATIONS:
        for func in (getattr(F, name, None), getattr(F, name + "_", None), getattr(torch, name, None)):
            if func is not None:
                register(func, partial(elementwise, func))
        register(getattr(torch.Tensor, name, None), partial(elementwise, getattr(torch.Tensor, name, None)))
    for name in PASSTHROUGH:
        func = getattr(torch.Tensor, name, None)
        if func is not None:
            register(func, partial(_values_call, func))
    for name in GETTER_NAMES:
        GETTERS[name] = partial(lambda attr, nt: getattr(nt._values, attr), name)
    GETTERS["is_nested"] = lambda nt: False
    GETTERS["names"] = lambda nt: (None,) * nt.ndim
    GETTERS["data"] = lambda nt: nt._derive(nt._values.data, nt._shapes)
    GETTERS["real"] = lambda nt: nt._derive(nt._values.real, nt._shapes)
    GETTERS["imag"] = lambda nt: nt._derive(nt._values.imag, nt._shapes)
    GETTERS["mH"] = lambda nt: nt.mT.conj()
    GETTERS["H"] = lambda nt: nt.T.conj()
    for name in ("is_floating_point", "is_complex", "is_signed", "is_nonzero", "numel", "get_device", "is_conj"):
        for func in (getattr(torch, name, None), getattr(torch.Tensor, name, None)):
            if func is not None and func not in HANDLERS:
                register(func, partial(_values_call, func))
    register((torch.allclose, torch.Tensor.allclose), partial(_allclose, torch.allclose))
    register((torch.equal, torch.Tensor.equal), _equal)
    register(torch.where, _where)
    register(torch.Tensor.where, _tensor_where)
    register(torch.Tensor.backward, _backward)


_register()
