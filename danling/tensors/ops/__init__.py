"""Op families of NestedTensor, each registering its handlers in `.registry`.

- `.elementwise`: math, comparisons, conversions, activations, attribute pass-through;
- `.reduction`: sum / mean / max / min / prod / all / any and friends;
- `.shape`: permute, transpose, reshape, view, flatten, squeeze, flip, roll, rot90...;
- `.functional`: linear, embedding, softmax, layer_norm, losses, attention, matmul, cat.

The families import `danling.tensors.NestedTensor`, so `danling.tensors` loads
them after the class is defined; this package itself only exposes the registry.
"""

from .registry import GETTERS, HANDLERS, dispatch, implements, register, unsupported

__all__ = ["GETTERS", "HANDLERS", "dispatch", "implements", "register", "unsupported"]
