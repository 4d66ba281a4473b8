"""The optimizer shell: validates, walks the slots, owns the per-slot state list (spec §3, §5).

``state = opt.init(params)`` then ``state = opt.step(state, params, grads)``.
Representatives own state; an alias's entry is its representative's record;
frozen slots hold ``None`` and never change. Everything is validated before the
first write.

Two update paths, fixed when the state is made:

* **generic** (host): mirrors are synced to the host first, the host tensors are
  updated, and the mirrors dropped (a host write).
* **native** (device, for SGD, Adam and AdamW): the state lives beside the
  mirrors, only mirrors are written (the host becomes stale) and nothing is read
  back to the host. Aliases hold no record; a re-tie that would merge two
  separate histories is rejected.

A step consumes its input state: the records' buffers are updated in place, as
with ``torch.optim``. Pass back the state a step returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import weakref
from typing import Callable, Optional, Sequence

import torch

from ..errors import ConfigError, OptimizerStateError
from ..params.packs import canonical_gradients
from ..params.paramlist import ParamList
from .hyper import Hyper
from .opt_state import MOMENTUM_FIELD, OptState
from .per_slot import Settings, plain, resolve
from ..params.dense import same_layout, to_layout
from .layout import MEMO, Remembered, layout_key, GENERIC, NATIVE, Layout, build_layout, check_sparse, no_mirror
from .rules import rule_for
from .torch_style import as_param_list, group_function, group_rates


@dataclass(frozen=True)
class Optimizer:
    """An optimizer kind with its hyperparameters; stateless itself."""

    hyper: Hyper
    slot_fn: Optional[Callable] = field(default=None, compare=False, repr=False)
    _resolved: dict = field(default_factory=dict, compare=False, repr=False)
    # torch-style param groups: each group's own rate (empty: one group), each slot's group
    group_lrs: tuple = ()
    group_of: Optional[Callable] = field(default=None, compare=False, repr=False)
    group_options: tuple = field(default=(), compare=False, repr=False)  # each group's overrides

    def __post_init__(self) -> None:
        if self.hyper.numerics == "torchlean" and rule_for(self.hyper).reference is None:
            raise ConfigError(f"optim.{self.kind}: numerics='torchlean' replays upstream's formulas, and upstream "
                              f"has no {self.kind}; use numerics='fast'")

    def per_slot(self, fn: Callable) -> "Optimizer":
        """This optimizer with per-slot hyperparameters: ``fn(param)`` returns overrides
        for each trainable slot (see ``per_slot.py``), e.g. no weight decay on vectors:
        ``optim.adamw(1e-3, 0.1).per_slot(lambda p: {"weight_decay": 0.0} if len(p.shape) < 2 else {})``."""
        if not callable(fn):
            raise ConfigError(f"{self.kind}.per_slot: expected a function of a slot, got {type(fn).__name__}")
        return Optimizer(self.hyper, fn)

    def settings(self, op: str, params: ParamList) -> tuple[Optional[Settings], tuple]:
        """Per slot its ``SlotSetting`` (hyperparameters, ``lr_scale``, param group), and
        the overrides record; ``(None, ())`` without ``per_slot`` or groups (every slot on
        the base record)."""
        if self.slot_fn is None:
            return None, ()  # every slot on the base record
        key = (id(params), tuple(params.canonical_slot_indices()), tuple(id(v.storage) for v in params))
        hit = self._resolved.get(key)
        if hit is None:
            hit = resolve(op, self.hyper, self.slot_fn, params, self.group_of)
            self._resolved.clear()  # one layout at a time
            self._resolved[key] = hit
        return hit

    @property
    def kind(self) -> str:
        """The rule's name, a key of ``optim.OPTIMIZERS`` (``sgd``, ``adamw``, ``muon``...)."""
        return self.hyper.kind

    @property
    def lr(self) -> float:
        """The base learning rate (a schedule overrides it per update or epoch)."""
        return self.hyper.lr

    @property
    def native(self) -> bool:
        """Whether this kind has the device-resident path (SGD without momentum, Adam, AdamW)."""
        return self.hyper.numerics == "fast" and rule_for(self.hyper).native(self.hyper)

    def __repr__(self) -> str:
        return self.hyper.describe()

    def with_param_groups(self, groups) -> "Optimizer":
        """This optimizer with torch-style param groups' hyperparameters as per-slot settings
        (``[{"params": [...], "weight_decay": 0.0}, ...]``, torch's option names, flags
        too), each group with its own rate (its ``lr``, else this optimizer's), for a loop
        over the module holding them."""
        return self._with(f"{self.kind}.with_param_groups", groups)[0]

    def groups_rates(self) -> tuple[float, ...]:
        """Each param group's rate, in order (one group: this optimizer's rate)."""
        return self.group_lrs or (self.hyper.lr,)

    def groups_momenta(self) -> Optional[tuple[float, ...]]:
        """Each param group's momentum (SGD, RMSprop, Muon) or first beta (Adam's family),
        what torch's momentum-cycling schedules set; ``None``: the kind has neither."""
        name = MOMENTUM_FIELD.get(self.kind)
        if name is None:
            return None
        options = self.group_options or ({},)
        return tuple(float(o.get(name, getattr(self.hyper, name))) for o in options)

    def _with(self, op: str, target) -> tuple["Optimizer", ParamList]:
        """The optimizer and parameter list for what a user passed (``torch_style.py``)."""
        params, options = as_param_list(op, target)
        if options is None:
            return self, params
        if self.slot_fn is not None:
            raise ConfigError(f"{op}: param groups and per_slot both set per-slot hyperparameters; use one")
        fn, group_of, each = group_function(op, self.kind, params, options)
        return Optimizer(self.hyper, fn, group_lrs=group_rates(op, self.hyper.lr, options), group_of=group_of,
                         group_options=each), params

    # --------------------------------------------------------------------- init
    def init(self, params, *, native: bool = False) -> OptState:
        """Fresh state for ``params``: zeros beside the tensors the chosen path updates.
        ``params``: a ``ParamList`` (or a Runner), a module, an iterable of Parameters, or
        torch-style param groups (their options become per-slot settings; pass the same
        groups to ``step``)."""
        op = f"{self.kind}.init"
        if not isinstance(params, ParamList):
            opt, params = self._with(op, params)
            if opt is not self:
                return opt.init(params, native=native)
        if native and not self.native:
            raise OptimizerStateError(
                f"{op}: {self.kind} has no native path (only sgd without momentum, adam and "
                f"adamw, with numerics='fast'); use the generic path"
            )
        rule = rule_for(self.hyper)
        slots_map = params.canonical_slot_indices()
        for i, c in enumerate(slots_map):
            if c is not None:
                self.hyper.check_dtype(params[i].dtype)
                if native and params[i].storage.mirror is None:
                    raise no_mirror(op, params, i)
        settings, asked = self.settings(op, params)
        settings = settings if settings is not None else plain(self.hyper, params)
        if native and not all(rule.native(st[0]) for st in settings if st is not None):
            raise OptimizerStateError(f"{op}: a per-slot setting has no native path (SGD momentum); use the generic path")
        records: list = [None] * len(params)
        for i, c in enumerate(slots_map):
            if c == i:
                s = params[i].storage
                records[i] = rule.init(settings[i][0], s.mirror if native else s.host)
            elif c is not None and not native:
                records[i] = records[c]
        bases = self.group_lrs
        return OptState(self.hyper, self.hyper.lr, NATIVE if native else GENERIC, tuple(records), 0, asked,
                        lrs=bases, bases=bases)  # each group at its own rate, exactly

    # --------------------------------------------------------------------- step
    def step(self, state: OptState, params, gradients: Sequence) -> OptState:
        """One generic (host) update: sync mirrors, update host tensors, drop mirrors.
        ``params`` as for ``init``; ``gradients`` one per slot (``[p.grad for p in params]``)."""
        if not isinstance(params, ParamList):
            opt, params = self._with(f"{self.kind}.step", params)
            if opt is not self:
                return opt.step(state, params, gradients)
        self.check(f"{self.kind}.step", state, params, GENERIC)
        params.check_pack(f"{self.kind}.step", gradients, gradients=True)
        return self.apply(state, params, gradients, GENERIC)

    def step_native(self, state: OptState, params, gradients: Sequence) -> OptState:
        """One native update: write only the mirrors, keep state beside them, no host read."""
        if not isinstance(params, ParamList):
            opt, params = self._with(f"{self.kind}.step_native", params)
            if opt is not self:
                return opt.step_native(state, params, gradients)
        self.check(f"{self.kind}.step_native", state, params, NATIVE)
        params.check_pack(f"{self.kind}.step_native", gradients, gradients=True)
        return self.apply(state, params, gradients, NATIVE)

    def check(self, op: str, state: OptState, params: ParamList, path: str) -> None:
        """Raise unless ``state`` is this optimizer's history on ``path`` for ``params``."""
        if not isinstance(state, OptState):
            raise OptimizerStateError(f"{op}: expected an OptState, got {type(state).__name__}")
        if state.hyper is not self.hyper and state.hyper.without_lr() != self.hyper.without_lr():
            raise OptimizerStateError(
                f"{op}: state belongs to a different optimizer configuration: state has "
                f"{state.hyper.describe()}, optimizer is {self.hyper.describe()}; call init"
            )
        if state.path != path:
            raise OptimizerStateError(
                f"{op}: cannot mix generic and native optimizer updates: this history is "
                f"{state.path}, the call is {path}; call init to start a fresh optimizer history"
            )
        if path == NATIVE and not self.native:
            raise OptimizerStateError(f"{op}: {self.kind} has no native path")
        if len(state.slots) != len(params):
            raise OptimizerStateError(
                f"{op}: state has {len(state.slots)} slots, parameter list has {len(params)}"
            )
        asked = self.settings(op, params)[1] if self.slot_fn is not None or state.overrides else ()
        if state.overrides != asked:
            raise OptimizerStateError(
                f"{op}: the state was made with per-slot hyperparameters {_show(state.overrides)}, this "
                f"optimizer asks for {_show(asked)}; call init"
            )

    def check_sparse(self, op: str, params: ParamList, gradients: Sequence) -> None:
        """Raise (naming the slot) if some gradient is sparse and its rule does not take
        sparse gradients: a loop asks before anything of the step is kept."""
        rule = per_slot = None
        for i, g in enumerate(gradients):
            if g is not None and g.layout != torch.strided:
                if rule is None:
                    rule, per_slot = rule_for(self.hyper), self.settings(op, params)[0]
                check_sparse(op, self.hyper if per_slot is None else per_slot[i][0], rule, params, i)

    def apply(
        self, state: OptState, params: ParamList, gradients: Sequence, path: str,
        found_inf: Optional[torch.Tensor] = None, presummed: bool = False,
        cache=None, slots_map: Optional[list] = None,
    ) -> OptState:
        """The update, for a state and gradients the caller has checked (``check``, and a
        pack with the slots' shapes and dtypes, as the runner's own gradients are).

        With ``found_inf`` (a one-element device flag, as ``torch.optim``'s fused kernels
        take it) every tensor the update writes is put back where the flag is set, on the
        device, with no host read: one copy of the updated tensors per step. Host-side
        counters (Adam's ``t``) still advance on a skipped step. ``presummed``: the pack
        already holds the canonical gradients (``canonical_gradients``' result: sums at
        representatives, ``None`` elsewhere), as clipping leaves it. ``cache``: a record
        with a ``layout`` field (a loop's ``Steady``, see ``Runner.steady``): the update's
        layout is built at the first step and kept there while the loop is steady;
        ``slots_map``: the canonical map, if known.
        """
        op = f"{self.kind}.{'step_native' if path == NATIVE else 'step'}"
        records = list(state.slots)
        lay = None if cache is None else cache.layout
        key = memo = None
        if lay is None and cache is None and self.slot_fn is None and not presummed and found_inf is None:
            key = layout_key(params, gradients, path)  # a public call: the last step's layout, if it still fits
            memo = None if key is None else MEMO.get(params)
            if memo is not None and memo.fits(self.hyper, state, path, key):
                lay = memo.layout
        if lay is None:  # everything validated here, nothing written yet
            if slots_map is None:
                slots_map = params.canonical_slot_indices()
            sums = gradients if presummed else canonical_gradients(slots_map, gradients, names=params,
                                                                   allow_missing=True)
            lay = build_layout(op, self.hyper, records, params, slots_map, sums, path, self.settings(op, params)[0])
            if cache is not None and lay.reusable:
                cache.layout = lay
            memo = Remembered(self.hyper, path, key, lay) if key is not None and lay.reusable else None
            if memo is not None:
                MEMO[params] = memo
        else:  # a loop's (or the last call's) layout: the same slots, gradients that fit them
            sums = (canonical_gradients(lay.slots_map, gradients, names=params, allow_missing=True)
                    if lay.tied and not presummed else gradients)
        if found_inf is None:
            new = self._run(state, records, lay, sums, path)
            if memo is not None:
                memo.state = weakref.ref(new)  # the state whose records this layout's next use takes
            return new
        targets = [t for group in lay.groups for t in group.targets]
        targets += [t for rec in state.records().values() for t in rec.tensors().values()]
        saved = [t.detach().clone() for t in targets]
        new = self._run(state, records, lay, sums, path)
        keep = found_inf[0] == 0
        with torch.no_grad():
            for t, old in zip(targets, saved):
                torch.where(keep, t, old, out=t)
            known = {id(t) for t in targets}
            for rec in new.records().values():  # a history this very step created
                for t in rec.tensors().values():
                    if id(t) not in known:
                        torch.where(keep, t, torch.zeros_like(t), out=t)
        return new

    def _run(self, state: OptState, records: list, lay: Layout, sums: Sequence, path: str) -> OptState:
        """Write: one multi-tensor call per group of the layout, then the alias records."""
        native = path == NATIVE
        rule = lay.rule
        for storage in lay.host_syncs:
            storage.begin_host_update()  # sync a newer mirror, then drop it
        with torch.no_grad():
            for group in lay.groups:
                idx, ps, hyper = group.slots, group.targets, group.hyper
                recs = [records[i] for i in idx]
                if lay.fresh:
                    recs = [rule.init(hyper, p) if r is None else r for r, p in zip(recs, ps)]
                lr = group_rate(state, group)  # the group's rate (a per_slot lr_scale multiplied in)
                if state.momenta:
                    hyper = state.cycled(hyper, group.group)  # a schedule cycles momentum or beta1 (torch's)
                for k, r in zip(*_update_group(rule, hyper, lr, group, recs, [sums[i] for i in idx])):
                    records[idx[k]] = r
        if native:
            for group in lay.groups:
                for storage in group.storages:
                    storage.host_current = False  # the mirror is newer now
        if lay.n_reps != len(lay.slots_map):
            for i, c in enumerate(lay.slots_map):
                if c is None:
                    if native:
                        records[i] = None  # a slot that left the trainable set releases its history
                elif c != i:
                    records[i] = None if native else records[c]
        return advanced(state, records)


# What every update asks of the state, beside the update itself (not OptState's methods: an
# update then crosses one file fewer, ``benchmarks/update_trace.py``).
def group_rate(state: OptState, setting) -> float:
    """The rate of a param group (or a slot's setting) at the next step: its group's rate,
    a ``per_slot`` ``lr_scale`` multiplied in."""
    lr = state.lrs[setting.group] if state.lrs else state.lr
    return lr if setting.scale == 1.0 else lr * setting.scale


def advanced(state: OptState, records) -> OptState:
    """The state after one update: its new records, one more step (the constructor itself:
    ``dataclasses.replace`` walks the fields, about 7 us a step)."""
    return OptState(state.hyper, state.lr, state.path, tuple(records), state.steps + 1, state.overrides, state.lrs,
                    state.momenta, state.bases)


def _update_group(rule, hyper, lr: float, group, recs: list, gs: list) -> tuple[list, list]:
    """Run one group's update; returns the positions updated and their new records.

    The layout rule (``params/dense.py``) holds for every tensor a kernel gets: a
    gradient not in its target's kernel layout (or on another device) is copied into
    it; a target that is not dense is updated through a dense copy, written back
    through its view. A slot without a gradient is left out, value and state (torch's
    rule), except with ``numerics='torchlean'``, whose gradient is then zero (upstream).
    Sparse gradients take the rule's own per-tensor form (SGD, Adagrad)."""
    ps = group.targets
    if not (group.staged or group.move) and hyper.numerics == "fast" and _ready(gs, group.strides):
        # the usual step: every gradient present, dense, in its target's layout
        if group.kernel is not None:  # the rule's kernel for these targets, chosen with the layout
            return range(len(gs)), group.kernel(hyper, lr, recs, ps, gs)
        return range(len(gs)), rule.update_many(hyper, lr, recs, ps, gs, uniform=True)
    keep = range(len(gs))
    if hyper.numerics == "torchlean":
        gs = [torch.zeros_like(p) if g is None else g for g, p in zip(gs, ps)]
    elif any(g is None for g in gs):  # some slot unused by every item of this update
        keep = [k for k, g in enumerate(gs) if g is not None]
    sparse, dense = [], []
    for k in keep:
        g = gs[k]
        if g.layout != torch.strided:
            sparse.append(k)
        else:
            if g.device != ps[k].device or not same_layout(g, group.strides[k]):
                gs[k] = to_layout(g, ps[k])
            dense.append(k)
    work = {k: ps[k] for k in dense}
    if group.staged:
        work = {k: p if same_layout(p, group.strides[k]) else to_layout(p, p) for k, p in work.items()}
    news = list(recs)
    if dense:
        ws, rs, gd = [work[k] for k in dense], [recs[k] for k in dense], [gs[k] for k in dense]
        if hyper.numerics == "torchlean":  # upstream's order, tensor by tensor
            out = [rule.reference(hyper, lr, r, w, g) for r, w, g in zip(rs, ws, gd)]
        else:
            out = rule.update_many(hyper, lr, rs, ws, gd, uniform=True)  # one device, one dtype
        for k, r in zip(dense, out):
            news[k] = r
            if work[k] is not ps[k]:
                ps[k].copy_(work[k])  # back through the view: only the parameter's own elements
    for k in sparse:
        news[k] = rule.update_sparse(hyper, lr, recs[k], ps[k], gs[k])
    done = sorted(dense + sparse)
    return done, [news[k] for k in done]


def _ready(gs: list, strides: list) -> bool:
    for g, st in zip(gs, strides):  # a plain loop over tensor attributes: this runs every step
        if g is None or g.layout != torch.strided or g.stride() != st:
            return False
    return True


def _show(overrides: tuple) -> str:
    return "{" + ", ".join(f"slot {i}: {dict(kv)}" for i, kv in overrides) + "}" if overrides else "none"
