"""The gradients of one scalar loss with respect to a step's leaves.

``torch.autograd.grad(loss, leaves, allow_unused=True)`` is what this computes. For a
plain scalar loss and plain leaves (``torch.Tensor`` / ``nn.Parameter``, no
``__torch_function__`` subclass) it calls autograd's engine directly with the unit
seed ``grad`` would make (``ones_like(loss)``): the same C++ call, the same graph
walk and the same bits, without ``grad``'s Python argument handling and its logging
wrapper (about 30 to 45 us of a 450 us step of a small model on one CPU thread,
``benchmarks/step_overhead.py``). Only on the CPU: there backward runs on the calling
thread; on a GPU it runs on autograd's device threads, to which ``grad``'s wrapper hands
the caller's context (torch.compile's settings), so that path is kept whole. Anything
else (a CUDA loss, a tensor subclass, a torch without the engine handle, or
``force_public``) goes through ``torch.autograd.grad``. A graph with a reentrant
activation checkpoint, which ``grad`` cannot run, goes through ``loss.backward()``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...errors import ConfigError
from ...params.dense import kernel_strides, same_layout, to_layout

_PLAIN = (torch.Tensor, torch.nn.Parameter)
# The handle ``torch.autograd.grad`` ends in (``Variable._execution_engine.run_backward``,
# its signature unchanged across the torch versions we support); None: use ``grad``.
_ENGINE = getattr(getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None), "run_backward", None)


def all_plain(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor is a plain tensor or Parameter (no subclass dispatch)."""
    return all(type(t) in _PLAIN for t in tensors)


def gradients(loss: torch.Tensor, wrt: tuple, plain: bool, force_public: bool = False) -> tuple:
    """``torch.autograd.grad(loss, wrt, allow_unused=True)``; ``plain``: ``all_plain(wrt)``."""
    if _ENGINE is not None and plain and not force_public and type(loss) is torch.Tensor and loss.is_cpu:
        seed = torch.ones_like(loss, memory_format=torch.preserve_format)
        # (outputs, seeds, keep_graph, create_graph, inputs, allow_unused, accumulate_grad)
        return _ENGINE((loss,), (seed,), False, False, wrt, True, False)
    return torch.autograd.grad(loss, wrt, allow_unused=True)


def reentrant_checkpoint(loss: torch.Tensor) -> bool:
    """Whether ``loss``'s graph holds a reentrant activation checkpoint
    (``torch.utils.checkpoint(use_reentrant=True)``, transformers' option): its backward
    runs a backward of its own, which ``autograd.grad`` cannot host. One walk of the graph."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        stack.extend(n for n, _ in node.next_functions)
    return False


def backward_into(loss: torch.Tensor, wrt: tuple) -> tuple:
    """The gradients ``loss.backward()`` accumulates into the leaves ``wrt`` (the route a
    reentrant checkpoint needs: no ``inputs``, no ``grad``), each leaf's own ``.grad`` put
    back as it was afterwards: the bits of the user's plain ``loss.backward()``."""
    saved = [t.grad for t in wrt]
    try:
        for t in wrt:
            t.grad = None
        loss.backward()
        return tuple(t.grad for t in wrt)
    finally:
        for t, g in zip(wrt, saved):
            t.grad = g


def differentiate(loss: torch.Tensor, leaves: Sequence, loss_scale=None, bound=None, force_public: bool = False,
                  reentrant: bool = False) -> tuple:
    """(the detached loss, per-slot gradients: ``None`` at frozen slots and where the
    forward did not use a leaf, as ``.grad`` stays ``None`` in torch). ``loss_scale``: a
    float16 run's scale tensor, the loss is multiplied by its one element first;
    ``bound``: the ``Binding`` whose leaves these are (its cached leaf tuple and layouts
    are then used); ``force_public``: through ``torch.autograd.grad`` (a compiled step's
    backward takes the documented route); ``reentrant``: the graph holds a reentrant
    checkpoint, so the gradients come from ``loss.backward()`` (``backward_into``).

    Every gradient comes back dense in its leaf's kernel layout and in memory of its
    own (see ``own_gradients``), so the in-place work that follows (``1/n``, unscaling,
    clipping) and the fused kernels pair and touch only the right elements."""
    if not loss.is_floating_point():
        raise ConfigError(f"Runner.loss: the loss must be a floating-point tensor, got dtype {loss.dtype}")
    if bound is not None:
        wrt, plain, strides = bound.wrt, bound.plain, bound.strides
    else:
        wrt = tuple(t for t in leaves if t is not None)
        plain, strides = all_plain(wrt), None
    if not wrt:
        # Every slot frozen: nothing to differentiate (upstream: frozen slots have none).
        return loss.detach(), [None for _ in leaves]
    if not loss.requires_grad:
        raise ConfigError(
            "Runner.loss: the loss carries no gradient although the model has trainable "
            "parameters (was it detached, converted with .item(), or computed under "
            "torch.no_grad()?); return the loss tensor autograd built"
        )
    scaled = loss if loss_scale is None else loss * loss_scale[0]
    if reentrant:
        raw = backward_into(scaled, wrt)
    else:
        try:
            raw = gradients(scaled, wrt, plain, force_public)
        except RuntimeError as e:
            if "use_reentrant=True" not in str(e):
                raise
            raise ConfigError("Runner.loss: the model started using reentrant activation checkpointing "
                              "(use_reentrant=True) after this runner's first step, whose graph had none; "
                              "build a new Runner (or set use_reentrant=False)") from e
    grads = own_gradients(raw, wrt, strides)
    if len(wrt) == len(leaves):
        return loss.detach(), grads
    it = iter(grads)
    return loss.detach(), [None if t is None else next(it) for t in leaves]


_TAKEN: dict = {}  # (device, dtype) -> the one zero element every stand-in expands


def taken(g: torch.Tensor) -> torch.Tensor:
    """What a gradient hook returns for a gradient it has consumed (a reducer that copied
    or summed it into its own buffers): a stand-in of ``g``'s shape, dtype and device
    over one shared element, so autograd's result does not keep the gradient alive until
    the backward ends (one gradient-sized tensor per trained slot). The step's result
    then holds ``None`` at that slot (``own_gradients``): the hook's owner has it. A
    gradient of one element is its own stand-in (its strides say nothing)."""
    if g.numel() <= 1:
        return g
    key = (g.device, g.dtype)
    zero = _TAKEN.get(key)
    if zero is None:
        zero = _TAKEN[key] = torch.zeros((), dtype=g.dtype, device=g.device)
    return zero.expand(g.shape)


def was_taken(g: torch.Tensor) -> bool:
    """Whether ``g`` is a ``taken`` stand-in (by its memory: the shared element's)."""
    zero = _TAKEN.get((g.device, g.dtype))
    return zero is not None and g.layout is torch.strided and g.data_ptr() == zero.data_ptr() and g.numel() > 1 \
        and not any(g.stride())


def own_gradients(grads: Sequence, wrt: Sequence[torch.Tensor], strides=None) -> list:
    """``grads`` (one per tensor of ``wrt``, ``None`` where unused) with every dense
    gradient in its tensor's kernel layout (``strides``: ``kernel_strides`` of each,
    computed when not given) and no tensor given to two slots.

    autograd hands both inputs of ``a + b`` the same gradient tensor, and an expand's
    gradient is a stride-0 view: such a gradient is copied, once, so writing one slot's
    gradient in place never changes another's. The check is an identity and a stride
    comparison per gradient: no copy in the usual case. A ``taken`` stand-in becomes
    ``None`` (its hook's owner holds the gradient)."""
    out, seen = list(grads), set()
    for k, g in enumerate(out):
        if g is None:
            continue
        shared = id(g) in seen
        seen.add(id(g))
        if g.layout is not torch.strided:  # sparse: its own kind of memory
            if shared:
                out[k] = g.clone()
            continue
        want = kernel_strides(wrt[k]) if strides is None else strides[k]
        if shared or g.stride() != want:  # off the usual path
            if was_taken(g):  # a stand-in (stride 0): its hook's owner holds the gradient
                out[k] = None
            elif shared or not same_layout(g, want):
                out[k] = to_layout(g, wrt[k])  # fresh memory: nothing else points at it
    return out
