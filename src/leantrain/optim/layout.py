"""An update's layout: what ``Optimizer.apply`` decides about the slots before it writes.

Which slots are representatives, which tensor each one updates, how they group into
one multi-tensor call per (device, dtype, hyperparameters), whether any gradient has to
be summed over a tie or moved to its target's device. Every update builds one from the
slots, the state and the gradients, validating all of it before the first write.
Within a training loop nothing of this can change between two steps unless the user's
code runs (see ``Runner.steady``), so a loop keeps the layout of its first step and
reuses it: the per-step work is then gathering the gradients and records by index and
the kernel calls. The update itself is the same function of the same groups in the
same order either way, so a reused layout gives the same bits as a fresh one.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from ..errors import OptimizerStateError, PackError, slot_label
from ..params.dense import is_dense, kernel_strides, same_layout, to_layout
from ..params.paramlist import ParamList
from .per_slot import Settings
from .records import parameter_shaped, state_shape
from .rules import SGDState, clone_record, rule_for

GENERIC, NATIVE = "generic", "native"


@dataclass
class Group:
    """One multi-tensor call: its hyperparameters, learning-rate scale, the slots it
    updates (representatives, in slot order), their target tensors and each target's
    kernel layout (``params/dense.py``)."""

    hyper: object
    scale: float
    group: int  # the param group whose rate (and cycled momentum) it takes
    slots: list
    targets: list
    storages: list
    move: bool  # some gradient lives on another device than its target (generic path)
    strides: list  # per target: the strides its gradient and state must have
    staged: bool  # some target is not dense: it is updated through a dense copy
    kernel: object = None  # the rule's ``steady_kernel`` for these targets, if it has one


@dataclass
class Layout:
    slots_map: list  # the canonical map the layout was built for
    tied: bool  # some slot aliases another: its gradient is summed into the representative's
    groups: list  # Group, in order of first slot
    n_reps: int
    reusable: bool  # nothing of it depends on this step alone (no split history, no host sync)
    fresh: bool  # some representative has no record yet (made at the update)
    host_syncs: list  # storages whose newer mirror is synced to the host and dropped first
    rule: object = None  # the hyperparameters' rule (``rules.rule_for``), looked up once


def target(storage, path: str) -> torch.Tensor:
    """The tensor an update on ``path`` writes: the mirror (native) or the host."""
    return storage.mirror if path == NATIVE else storage.host


def no_mirror(op: str, params: ParamList, i: int) -> OptimizerStateError:
    return OptimizerStateError(
        f"{op}: {params.label(i)} has no device mirror; the native path updates mirrors "
        f"only: call params.to_device(device) first"
    )


def build_layout(op: str, hyper, records: list, params: ParamList, slots_map: list, sums: list, path: str,
                 settings: Optional[Settings]) -> Layout:
    """The layout of one update, validated: raises before anything is written. ``sums``:
    the canonical gradients (``canonical_gradients``' result, which validated the pack).
    May replace entries of ``records`` (the caller's copy): a history split by an un-tie."""
    native = path == NATIVE
    rule = rule_for(hyper)
    groups: dict[tuple, Group] = {}
    owned: set[int] = set()  # ids of records some representative updates this step
    tied, fresh, n_reps, syncs, split = False, False, 0, [], False
    for i, c in enumerate(slots_map):
        rec = records[i]
        if c != i:
            if c is not None:
                tied = True
                if native and rec is not None and rec is not records[c]:
                    raise OptimizerStateError(
                        f"{op}: {params.label(i)} now aliases {params.label(c)}, but both "
                        f"have separate optimizer histories; re-tying would merge them. "
                        f"Call init to start a fresh history"
                    )
            continue
        n_reps += 1
        storage, g = params[i].storage, sums[i]
        p = target(storage, path)
        if p is None:
            raise no_mirror(op, params, i)
        dense, strides = is_dense(p), kernel_strides(p)
        if g is not None and g.layout != torch.strided:
            check_sparse(op, hyper, rule, params, i)
        move = g is not None and g.get_device() != p.get_device()
        if move and native:
            raise PackError(
                f"{op}: {params.label(i)}: gradient is on {g.device}, expected "
                f"{p.device} (the native path updates the mirror there)"
            )
        if not native and not (storage.host_current and storage.mirror is None):
            syncs.append(storage)  # the generic path writes the host: sync it, drop the mirror
        if rec is None:
            fresh = True
        elif type(rec) is not SGDState:
            fits = check_record(op, params, i, rec, p, strides)
            if id(rec) in owned:  # un-tied since the last step: split the history
                records[i] = clone_record(rec)
                split = True
                fits = all(same_layout(t, strides) for k, t in records[i].tensors().items()
                           if parameter_shaped(type(records[i]), k))
            if not fits:
                records[i] = in_layout(records[i], p)  # e.g. state made elsewhere, contiguous
                split = True
            owned.add(id(records[i]))
        h, scale, pg = (hyper, 1.0, 0) if settings is None else settings[i]
        key = (p.get_device(), p.dtype, id(h), scale, pg)  # id: no dataclass hash per slot
        group = groups.get(key)
        if group is None:
            group = groups[key] = Group(h, scale, pg, [], [], [], False, [], False)
        group.slots.append(i), group.targets.append(p), group.storages.append(storage)
        group.strides.append(strides)
        group.move |= move
        group.staged |= not dense
    reusable = not (syncs or split or fresh)
    steady_kernel = getattr(rule, "steady_kernel", None)
    if steady_kernel is not None:
        for group in groups.values():  # decided once per layout, not per update
            group.kernel = steady_kernel(group.hyper, group.targets)
    return Layout(list(slots_map), tied, list(groups.values()), n_reps, reusable, fresh, syncs, rule)


class Remembered:
    """The last reusable layout a public ``step``/``step_native`` built for a parameter
    list, with the state that step returned: the next call with that state (or its
    ``with_lr`` copy), this optimizer's hyperparameters, the same slots and targets and
    gradients on the same devices reuses it, as a loop reuses its ``Steady.layout``
    (the records were checked when that state was made, and are its own). Held by the
    parameter list weakly (``MEMO``): it never keeps a list's tensors alive."""

    __slots__ = ("hyper", "path", "key", "layout", "state")

    def __init__(self, hyper, path: str, key: tuple, layout: Layout) -> None:
        self.hyper, self.path, self.key, self.layout, self.state = hyper, path, key, layout, None

    def fits(self, hyper, state, path: str, key: tuple) -> bool:
        made = None if self.state is None else self.state()
        return (hyper is self.hyper and path == self.path and made is not None
                and (state is made or state.slots is made.slots) and key == self.key)


MEMO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # ParamList -> Remembered


def layout_key(params: ParamList, gradients: Sequence, path: str) -> Optional[tuple]:
    """What a layout depends on besides the records, per slot: the slot's storage and
    ``requires_grad``, its target tensor (object, memory, shape, strides), the mirror's
    state, the gradient's device. ``None`` (nothing to remember) for a sparse gradient
    or a missing mirror. A few attribute reads per slot, against a layout's checks."""
    native, key = path == NATIVE, []
    for v, g in zip(params.views, gradients):
        s = v.storage
        t = s.mirror if native else s.host
        if t is None or (g is not None and g.layout != torch.strided):
            return None
        key.append((v.requires_grad, id(s), id(t), t.data_ptr(), t.shape, t.stride(), s.host_current,
                    s.mirror is None, None if g is None else g.get_device()))
    return tuple(key)


def in_layout(rec, p: torch.Tensor):
    """``rec`` with every state tensor copied into ``p``'s kernel layout."""
    return replace(rec, **{k: to_layout(t, p) for k, t in rec.tensors().items() if parameter_shaped(type(rec), k)})


def check_sparse(op: str, hyper, rule, params: ParamList, i: int) -> None:
    """Raise unless slot ``i``'s rule takes a sparse gradient (SGD and Adagrad do, as in
    torch.optim; upstream's formulas, ``numerics='torchlean'``, are dense only)."""
    if not rule.sparse or hyper.numerics == "torchlean":
        what = f"{hyper.kind} with numerics='torchlean'" if rule.sparse else hyper.kind
        raise PackError(
            f"{op}: {params.label(i)}: got a sparse gradient, which {what} does not take "
            f"(sgd and adagrad do, as torch.optim); use a dense gradient (e.g. "
            f"nn.Embedding(sparse=False)) or one of those optimizers"
        )
    refusal = getattr(rule, "sparse_refusal", None)
    why = refusal(hyper) if refusal is not None else None
    if why:
        raise PackError(f"{op}: {params.label(i)}: got a sparse gradient, which {hyper.kind} does not take with "
                        f"{why}; use a dense gradient (e.g. nn.Embedding(sparse=False)) or no weight decay on "
                        f"this slot (per_slot)")


def check_record(op: str, params: ParamList, i: int, rec, p: torch.Tensor, strides: tuple) -> bool:
    """Raise unless every tensor of ``rec`` fits slot ``i``'s target ``p`` (shape, device,
    dtype); returns whether those of the parameter's shape are in its kernel layout
    (``strides``). One pass over the record: this runs per slot of every built layout."""
    shapes = getattr(type(rec), "SHAPES", None)
    shape, device, dtype, fits = p.shape, p.device, p.dtype, True
    for field, t in rec.tensors().items():
        pick = None if shapes is None else shapes.get(field)
        if pick is None:
            ok = t.shape == shape
            if ok and fits and t.stride() != strides:
                fits = same_layout(t, strides)
        else:
            ok = tuple(t.shape) == pick(tuple(shape))
        if not ok or t.device != device or t.dtype != dtype:
            want = state_shape(type(rec), field, tuple(shape))
            raise OptimizerStateError(
                f"{op}: {slot_label(i, params[i].name)}: optimizer state '{field}' does not "
                f"fit the parameter: expected {want} {dtype} on "
                f"{device}, got {tuple(t.shape)} {t.dtype} on {t.device}"
            )
    return fits
