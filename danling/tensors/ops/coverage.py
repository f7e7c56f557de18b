"""Registration tables: which torch / ``torch.nn.functional`` ops use which generic handler.

Semantics are always those of applying the op to each element and nesting the results (see
`danling.tensors.ops.generic`). Ops that cannot be given that meaning are listed in `UNDEFINED`
with the reason their error message gives.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from . import generic
from .registry import UNDEFINED, register

# name: (position of dim, default dim). The dim is a NestedTensor dim.
DIM_OPS: dict[str, tuple[int, object]] = {
    "sort": (1, -1),
    "argsort": (1, -1),
    "topk": (2, -1),
    "cumsum": (1, None),
    "cumprod": (1, None),
    "cummax": (1, None),
    "cummin": (1, None),
    "logcumsumexp": (1, None),
    "diff": (2, -1),
    "split": (2, 0),
    "chunk": (2, 0),
    "tensor_split": (2, 0),
    "split_with_sizes": (2, 0),
    "unsafe_split": (2, 0),
    "unsafe_chunk": (2, 0),
    "unsafe_split_with_sizes": (2, 0),
    "trapz": (2, -1),
    "gather": (1, None),
    "scatter": (1, None),
    "scatter_add": (1, None),
    "scatter_reduce": (1, None),
    "index_select": (1, None),
    "index_add": (1, None),
    "index_copy": (1, None),
    "index_fill": (1, None),
    "index_reduce": (1, None),
    "take_along_dim": (2, None),
    "narrow": (1, None),
    "select": (1, None),
    "repeat_interleave": (2, None),
    "cross": (2, None),
    "cumulative_trapezoid": (2, -1),
    "trapezoid": (2, -1),
    "renorm": (2, None),
    "glu": (1, -1),
}
REDUCING_DIM_OPS = {"kthvalue": (2, -1), "mode": (1, -1), "nanmedian": (1, None)}
STACKS = {"vstack": 0, "row_stack": 0, "hstack": 1, "dstack": 2}  # cat along this NestedTensor dim
SPLITS = {"vsplit": 0, "hsplit": 1, "dsplit": 2}  # tensor_split along this NestedTensor dim
INPLACE_DIM_OPS = ["cumsum", "cumprod", "index_add", "index_copy", "index_fill", "scatter", "scatter_add"]
INPLACE_DIM_OPS += ["scatter_reduce", "index_reduce", "renorm"]
INPLACE_TRAILING = {"tril_": "tril", "triu_": "triu"}
F_DIM_OPS = {"glu": (1, -1), "cosine_similarity": (2, 1), "gumbel_softmax": (4, -1)}

# linear algebra on the last k dims: name -> (k, reduces the k dims away)
LINALG = {
    "det": (2, True),
    "slogdet": (2, True),
    "logdet": (2, True),
    "inv": (2, False),
    "pinv": (2, False),
    "matrix_exp": (2, False),
    "matrix_power": (2, False),
    "cholesky": (2, False),
    "qr": (2, False),
    "svd": (2, False),
    "svdvals": (2, False),
    "eigh": (2, False),
    "eigvalsh": (2, False),
    "eig": (2, False),
    "eigvals": (2, False),
    "matrix_rank": (2, True),
    "cond": (2, True),
    "solve": (2, False),
    "cross": (1, False),
    "vecdot": (1, True),
    "diagonal": (2, False),
    "cholesky_ex": (2, False),
    "inv_ex": (2, False),
    "lu": (2, False),
    "lu_factor": (2, False),
    "lu_factor_ex": (2, False),
    "solve_ex": (2, False),
    "solve_triangular": (2, False),
    "ldl_factor": (2, False),
    "householder_product": (2, False),
}
TORCH_LINALG = {"det": "det", "slogdet": "slogdet", "logdet": "logdet", "inverse": "inv", "pinverse": "pinv"}
TORCH_LINALG.update({"matrix_exp": "matrix_exp", "matrix_power": "matrix_power", "cholesky": "cholesky"})
TORCH_LINALG.update({"qr": "qr", "svd": "svd", "trace": "trace", "diag_embed": "diag_embed"})
TORCH_TRAILING = {"trace": (2, True), "diag_embed": (1, False), "tril": (2, False), "triu": (2, False)}
TORCH_TRAILING.update({"pairwise_distance": (1, True), "view_as_real": (0, False), "view_as_complex": (1, False)})

# conv*, conv_transpose* and max_pool* run on a padded batch: see danling.tensors.ops.conv
F_EACH = ["avg_pool1d", "avg_pool2d", "avg_pool3d"]
F_EACH += ["max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices"]
F_EACH += ["adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d"]
F_EACH += ["adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d"]
F_EACH += ["adaptive_max_pool1d_with_indices", "adaptive_max_pool2d_with_indices", "adaptive_max_pool3d_with_indices"]
F_EACH += ["lp_pool1d", "lp_pool2d", "lp_pool3d", "max_unpool1d", "max_unpool2d", "max_unpool3d"]
F_EACH += ["fractional_max_pool2d", "fractional_max_pool3d", "pad", "pixel_shuffle", "pixel_unshuffle"]
F_EACH += ["fractional_max_pool2d_with_indices", "fractional_max_pool3d_with_indices"]
F_EACH += ["channel_shuffle", "native_channel_shuffle", "unfold", "fold", "pdist"]
F_BATCHED = ["upsample", "upsample_nearest", "upsample_bilinear", "grid_sample", "group_norm"]
F_BATCHED += ["prelu", "instance_norm", "local_response_norm", "dropout1d", "dropout2d", "dropout3d"]
TORCH_EACH = ["conv_transpose1d", "conv_transpose2d", "conv_transpose3d"]
TORCH_EACH += ["avg_pool1d", "max_pool1d", "max_pool2d", "max_pool3d", "adaptive_avg_pool1d", "adaptive_max_pool1d"]
TORCH_EACH += ["pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "constant_pad_nd", "pdist"]
TORCH_EACH += ["kron", "inner", "outer", "ger", "dot", "vdot", "mv", "mm", "bmm", "tensordot"]
TORCH_EACH += ["diag", "diagflat", "histogram", "corrcoef", "cov", "atleast_1d", "atleast_2d"]
TORCH_EACH += ["addmm", "addmv", "addr", "baddbmm", "addbmm", "cdist", "cholesky_solve", "cholesky_inverse"]
TORCH_EACH += ["triangular_solve", "lu_solve", "lu_unpack", "unique_consecutive", "gradient", "stft", "istft"]
TORCH_EACH += ["multinomial", "nuclear_norm", "chain_matmul"]
TORCH_EACH += ["atleast_3d", "fliplr", "flipud", "t", "adjoint", "vander", "cartesian_prod", "combinations"]

FLAT_INDICES = "flat indices address the padded batch, not the packed values; index elements instead"
SOURCE_ORDER = "the source is consumed across elements in padded order; use masked assignment"
NO_STRIDES = "strides of the padded batch do not exist: the storage is packed"
BATCH_SORT = "msort sorts along the batch dim, across elements of different sizes"
UNDEFINED.update(
    {
        torch.Tensor.numpy: "elements differ in shape and a NumPy array is rectangular; use .tensor or .tolist()",
        torch.Tensor.storage: "the packed storage is internal; .concat is the packed values",
        torch.msort: BATCH_SORT,
        torch.Tensor.msort: BATCH_SORT,
        torch.Tensor.resize_: "element sizes are fixed by the data; build a new NestedTensor",
        torch.Tensor.set_: "the packed storage is internal; build a new NestedTensor",
        torch.Tensor.as_strided: NO_STRIDES,
        torch.as_strided: NO_STRIDES,
        torch.Tensor.stride: NO_STRIDES,
        F.affine_grid: "it builds sampling grids from affine matrices and takes no ragged data",
        F.conv_tbc: "it takes one dense (time, batch, channel) tensor; use F.conv1d on (C, L_i) elements",
        torch.block_diag: "elements are not matrices of one batch; use torch.block_diag(*nt.unbind())",
        torch.Tensor.unfold: "windows over the padded batch would include padding; use F.unfold on each element",
        torch.Tensor.sum_to_size: "target sizes would be padded sizes, which elements do not have",
        torch.take: FLAT_INDICES,
        torch.Tensor.take: FLAT_INDICES,
        torch.Tensor.put_: FLAT_INDICES,
        torch.Tensor.put: FLAT_INDICES,
        torch.Tensor.masked_scatter: SOURCE_ORDER,
        torch.Tensor.masked_scatter_: SOURCE_ORDER,
        torch.masked_scatter: SOURCE_ORDER,
    }
)


def _register() -> None:
    for name, (position, default) in DIM_OPS.items():
        for func in (getattr(torch, name, None), getattr(torch.Tensor, name, None)):
            if func is not None:
                register(func, partial(generic.dim_op, func, position, default))
    for name in INPLACE_DIM_OPS:
        func = getattr(torch.Tensor, name + "_", None)
        if func is not None:
            out_of_place = getattr(torch.Tensor, name)
            register(func, partial(generic.in_place, partial(generic.dim_op, out_of_place, *DIM_OPS[name])))
    for name, (position, default) in REDUCING_DIM_OPS.items():
        for func in (getattr(torch, name, None), getattr(torch.Tensor, name, None)):
            register(func, partial(generic.reducing_dim_op, func, position, default))
    for name, (position, default) in F_DIM_OPS.items():
        register(getattr(F, name), partial(generic.dim_op, getattr(F, name), position, default))
    for name, (k, reduces) in LINALG.items():
        func = getattr(torch.linalg, name, None)
        if func is not None:
            register(func, partial(generic.trailing_op, func, k, reduces))
    for name, linalg_name in TORCH_LINALG.items():
        k, reduces = LINALG.get(linalg_name, TORCH_TRAILING.get(name, (2, False)))
        for func in (getattr(torch, name, None), getattr(torch.Tensor, name, None)):
            if func is not None:
                register(func, partial(generic.trailing_op, func, k, reduces))
    for name, (k, reduces) in TORCH_TRAILING.items():
        for func in (getattr(torch, name, None), getattr(torch.Tensor, name, None), getattr(F, name, None)):
            if func is not None:
                register(func, partial(generic.trailing_op, func, k, reduces))
    for name, base in INPLACE_TRAILING.items():
        out_of_place = partial(generic.trailing_op, getattr(torch.Tensor, base), 2, False)
        register(getattr(torch.Tensor, name), partial(generic.in_place, out_of_place))
    for name in F_EACH:
        register(getattr(F, name, None), partial(generic.each, getattr(F, name, None)))
    for name in TORCH_EACH:
        for func in (getattr(torch, name, None), getattr(torch.Tensor, name, None)):
            if func is not None:
                register(func, partial(generic.each, func))
    for name in F_BATCHED:
        register(getattr(F, name, None), partial(generic.batched, getattr(F, name, None)))
    _register_aliases()
    for name in ("grouped_mm", "scaled_mm", "scaled_grouped_mm"):
        if hasattr(F, name):
            UNDEFINED[getattr(F, name)] = "a low-level kernel for dense layouts; use matmul, which runs per element"


def _register_aliases() -> None:
    from . import functional
    from .extra import aminmax, dist, masked_select, quantile, reshape_as, std_var_mean, unbind

    for name, dim in STACKS.items():
        register(getattr(torch, name), partial(_stacked, dim))
    for name, dim in SPLITS.items():
        for func in (getattr(torch, name), getattr(torch.Tensor, name)):
            register(func, partial(_split, dim))
    register((torch.linalg.matmul,), functional.matmul)
    register((torch.linalg.multi_dot,), partial(generic.each, torch.linalg.multi_dot))
    register((torch.embedding,), lambda weight, input, *args: functional.embedding(input, weight, *args))
    register((torch.unbind, torch.Tensor.unbind), unbind)
    register((torch.masked_select, torch.Tensor.masked_select), masked_select)
    register((torch.aminmax, torch.Tensor.aminmax), aminmax)
    register((torch.std_mean,), partial(std_var_mean, "std"))
    register((torch.var_mean,), partial(std_var_mean, "var"))
    for func in (torch.quantile, torch.Tensor.quantile, torch.nanquantile, torch.Tensor.nanquantile):
        register(func, partial(quantile, func))
    register((torch.dist, torch.Tensor.dist), dist)
    register((torch.Tensor.reshape_as,), partial(reshape_as, "reshape"))
    register((torch.Tensor.view_as,), partial(reshape_as, "view"))


def _stacked(dim: int, tensors: list) -> object:
    from .functional import cat

    return cat(tensors, dim)


def _split(dim: int, input: object, sections: object) -> object:
    return generic.dim_op(torch.tensor_split, 2, None, input, sections, dim)


_register()
