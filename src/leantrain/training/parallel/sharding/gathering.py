"""Parameter sharding (ZeRO stage 3): each rank holds its ranges of the parameters, and a
module's parameters are gathered into the user's own Parameter objects around its use.

Between uses a trained Parameter's memory is released: its storage is resized to nothing,
so the Parameter object, its shape, its ties and every tensor autograd saved from it stay
what they are, only without bytes. The *units* are the modules that hold trained
Parameters directly, except inside a block: a module whose own forward reads its submodules'
Parameters without calling them (``WHOLE_UNITS``: torch's attention and transformer
layers, whose forwards pass ``out_proj.weight``, ``linear1.weight``, ... to fused
functions) and the run's ``shard_units`` (by default every element of an ``nn.ModuleList``,
as a transformer's blocks): the outermost such module is one unit with every Parameter
beneath it, gathered for its whole forward (as FSDP2 gathers a wrapped block): fewer,
larger gathers. A unit's forward pre-hook resizes its storages and all-gathers the
owners' ranges into them (``fetch.py``); its forward hook releases them again (but the
forward's last unit's, whose backward comes next), and (when a gradient will be taken)
registers a hook on the unit's outputs that gathers them once more just before the
unit's backward runs. While a unit computes, the gather of the unit that followed it in
the previous forward (or backward) is started: a prefetch, learned, never across the end
of a forward; a unit of less than ``PREFETCH_BYTES`` (a layer norm, a position
embedding, whose compute hides nothing) is looked through: the units after it are started
too, up to the first larger one. During a backward a storage is released as soon as the
gradient of every occurrence the forward used has been handed over (the occurrences are
known from the units' forwards), and whatever is still held when an item's backward ends
is released then. A Parameter that several units use (a tied embedding and head) stays
gathered from its first use in a forward that takes a gradient until its gradient is
handed over, as the forward's last unit does (FSDP2 keeps its root's so): one gather
where it would take one per use (not in the run's first update, whose guard must see a
read of it outside its units' forwards); its gradient is summed once, per slot, as everywhere.
Frozen slots and buffers are not cut: every rank keeps them whole.

Every gather is a collective, so every rank runs the same forwards and backwards in the
same order (a rank without an item runs a stand-in, ``rounds.py``): the model's graph must
not depend on the values of an item. Writes into a gathered storage go through a tensor
of its own over the same memory, so no Parameter's version counter moves (autograd's
saved tensors stay valid).

The user's code between updates (callbacks) runs with every Parameter whole
(``whole``), forwards it runs included; when the loop ends, or fails, the module gets
its whole values back (``close``), so outside a loop the module is as it always is. Until
the run's first update is applied, every torch call is checked for a released Parameter
passed outside its module's forward (``guarded``): a ``ConfigError`` naming the slot
rather than a read of memory that is not there.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch

from ....errors import CollectiveError, ConfigError, LeantrainError
from ....params.meta import guard_released
from .guard import Guard
from .fetch import Fetch
from .plan import ShardPlan
from .state import working

CLOSE_CHUNK = 16 << 20  # bytes of storages gathered together when a run ends (a larger slot alone)
PREFETCH_BYTES = 1 << 20  # a unit holding less is prefetched together with the units after it


def _tensors(output) -> list:
    """The tensors of a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for x in output for t in _tensors(x)]
    if isinstance(output, dict):
        return [t for x in output.values() for t in _tensors(x)]
    return []


# Modules whose forward reads their submodules' Parameters without calling those
# submodules (F.multi_head_attention_forward takes out_proj.weight; the transformer layers'
# fast paths take every weight of the layer): gathered whole, as one unit.
WHOLE_UNITS = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)


def whole_units(root: torch.nn.Module, extra=None) -> dict:
    """``id(module) -> the unit that gathers its Parameters`` for every module inside an
    outermost ``WHOLE_UNITS`` module or block (the run's ``shard_units``: instances of
    ``extra``'s classes; ``None``: every element of an ``nn.ModuleList``, as a transformer's
    blocks), that module included; other modules are absent (each is its own unit)."""
    out: dict = {}
    kinds = WHOLE_UNITS + tuple(extra or ())
    blocks = set() if extra is not None else {id(m) for lst in root.modules() if isinstance(lst, torch.nn.ModuleList)
                                               for m in lst}

    def walk(module: torch.nn.Module, unit) -> None:
        if unit is None and (isinstance(module, kinds) or id(module) in blocks):
            unit = module
        if unit is not None:
            out.setdefault(id(module), unit)
        for child in module.children():
            walk(child, unit)

    walk(root, None)
    return out


def make_releasable(op: str, params, plan: ShardPlan) -> None:
    """Every trained representative's tensor must be its storage's only contents. Memory
    torch cannot resize (shared with NumPy, mapped from a file) is first copied into
    memory of the tensor's own (``t.data``: the same Parameter object, its ties kept)."""
    like = working(params)
    for c in sorted({r.slot for r in plan.ranges}):
        t = like[c]
        if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            raise ConfigError(f"{op}: sharding='parameters' releases slot {c} ({params[c].name})'s memory between "
                              f"uses, but that tensor is a view into a larger block of memory; give the module a "
                              f"parameter of its own (module.weight = nn.Parameter(module.weight.detach().clone())), "
                              f"or shard 'gradients'")
    for c in sorted({r.slot for r in plan.ranges}):
        t = like[c]
        if not t.untyped_storage().resizable():
            with torch.no_grad():
                t.data = t.detach().clone()


class ParameterShards:
    """This rank's ranges of the trained parameters, and the hooks that gather them."""

    def __init__(self, op: str, runner, plan: ShardPlan, rank: int, fill=None, unit_kinds=None) -> None:
        params = runner.params
        make_releasable(op, params, plan)
        self.plan, self.rank, self.names = plan, rank, [v.name for v in params]
        self.slots_map = plan.slots_map
        self.full = working(params)  # per slot: the tensor whose storage is released between uses
        self.sharded = sorted({r.slot for r in plan.ranges})
        # this rank's values: the ranges the optimizer updates, owned copies (where a model built on
        # meta or a resume's ranges give them, ``fill`` does: fill.py, resume.py)
        fresh = {c for c in self.sharded if id(params[c].storage.host) in runner.unfilled}  # given by ``fill``
        self.values = {r: torch.empty(r.size, dtype=self.full[r.slot].dtype, device=self.full[r.slot].device)
                       if r.slot in fresh else self.full[r.slot].view(-1)[r.start: r.stop].clone()
                       for r in plan.owned(rank)}
        self.nbytes = {c: self.full[c].numel() * self.full[c].element_size() for c in self.sharded}
        self.resident = {c: True for c in self.sharded}
        self.active = {c: 0 for c in self.sharded}  # forwards of units running that use the storage
        self.pending: dict = {c: set() for c in self.sharded}  # occurrences whose gradient is still to come
        self.tracking = False  # an item's backward follows its forward (its occurrences are counted)
        self.held = False  # every storage held whole for the user's code (``whole``)
        units: dict = {}
        unit_of = whole_units(runner.module, unit_kinds)
        for i, loc in enumerate(runner.locations):
            if loc.is_parameter and i < len(self.slots_map) and self.slots_map[i] is not None \
                    and self.slots_map[i] in self.resident:
                owner = unit_of.get(id(loc.owner), loc.owner)
                units.setdefault(id(owner), (owner, []))[1].append(i)
        self.world = plan.world
        self.unit_slots = [sorted({self.slots_map[i] for i in slots}) for _, slots in units.values()]
        self.unit_bytes = [sum(self.nbytes[c] for c in canon) for canon in self.unit_slots]
        uses = Counter(c for canon in self.unit_slots for c in canon)
        self.shared = {c for c, k in uses.items() if k > 1}  # used by several units (ties across modules)
        self.guarding = False  # the run's first update: a tie is released between its units (the guard sees reads)
        self.landing: dict = {}  # slot -> its Fetch in flight
        # which unit followed which, in the last forwards and backwards (what is prefetched)
        self.next_forward: dict = {}
        self.next_backward: dict = {}
        self.last_forward = self.last_backward = None
        self.handles = []
        for unit, (module, slots) in enumerate(units.values()):
            self.handles.append(module.register_forward_pre_hook(self._before(unit, slots)))
            self.handles.append(module.register_forward_hook(self._after(unit)))
        # a forward of the whole model starts and ends a succession: the last unit's
        # successor is never the next forward's first (its backward comes first)
        root = runner.module
        self.handles.append(root.register_forward_pre_hook(self._started, prepend=True))
        self.handles.append(root.register_forward_hook(self._ended))
        self.last_units: set = set()  # units that ended a forward: kept for the backward that follows
        self.release(self.sharded)
        if fill is not None:
            try:
                fill(self)  # every rank's ranges of a model built on meta, unit by unit
            except BaseException:
                self.close(failed=True)  # the hooks go, the memory comes back (this rank's values in place)
                raise

    # ------------------------------------------------------------ gather and release
    def _storage_view(self, c: int) -> torch.Tensor:
        """A flat tensor of its own over slot ``c``'s memory (no Parameter's version moves)."""
        t = self.full[c]
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (t.numel(),), (1,))

    def gather(self, slots) -> None:
        """Every range of the released storages among ``slots`` from its owner, into place
        (a collective: every rank asks for the same storages in the same order); a fetch
        of them already in flight (a prefetch) lands. A failed gather (a peer lost) is a
        ``CollectiveError``, never taken for the model's own error: it runs inside the
        model's forward (a unit's hook) or backward."""
        try:
            self.fetch(slots)
            for item in {id(self.landing[c]): self.landing[c] for c in slots if c in self.landing}.values():
                item.land()
                for c in item.slots:
                    self.landing.pop(c, None)
        except LeantrainError:
            raise
        except Exception as e:  # with peers, a failed collective: one died, stopped or timed out
            if self.world == 1:
                raise  # one process gathers nothing from anyone: not a collective's failure
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CollectiveError(f"the all-gather of parameters {sorted(slots)} failed ({first})") from e

    def fetch(self, slots) -> None:
        """Start gathering the released storages among ``slots`` (not waited for)."""
        missing = [c for c in slots if not self.resident[c] and c not in self.landing]
        if not missing:
            return
        for c in missing:
            self.full[c].untyped_storage().resize_(self.nbytes[c])
            self.resident[c] = True
        item = Fetch(self.plan, self.rank, missing, self.full, self.values,
                     {c: self._storage_view(c) for c in missing})
        for c in missing:
            self.landing[c] = item

    def release(self, slots) -> None:
        if self.held:
            return  # the user's code holds every parameter whole (``whole``), its forwards too
        for c in slots:
            if self.resident[c] and c not in self.landing:  # a prefetch in flight stays until used
                self.full[c].untyped_storage().resize_(0)
                self.resident[c] = False

    def _prefetch(self, unit: int, order: dict) -> None:
        """Start gathering the unit that followed ``unit`` last time (``order``: the
        forwards' or the backwards' succession), while ``unit`` computes."""
        if self.world > 1:
            seen, following = {unit}, order.get(unit)
            while following is not None and following not in seen:
                seen.add(following)
                self.fetch(self.unit_slots[following])
                if self.unit_bytes[following] >= PREFETCH_BYTES:
                    break
                following = order.get(following)  # a small unit hides nothing: the next one too

    def _started(self, *args) -> None:
        self.last_forward = None

    def _ended(self, *args) -> None:
        if self.last_forward is not None:
            self.last_units.add(self.last_forward)
        self.last_forward = None

    def _followed(self, unit: int, backward: bool) -> None:
        """Learn the succession of units (the same on every rank: the same graph)."""
        last, order = (self.last_backward, self.next_backward) if backward else (self.last_forward, self.next_forward)
        if last is not None:
            order[last] = unit
        if backward:
            self.last_backward = unit
        else:
            self.last_forward = unit

    def _before(self, unit: int, slots: list):
        canon = self.unit_slots[unit]

        def before_forward(module, args):
            for c in canon:
                self.active[c] += 1
            self.gather(canon)
            self._followed(unit, backward=False)
            self._prefetch(unit, self.next_forward)
            if self.tracking and torch.is_grad_enabled():
                for i in slots:
                    self.pending[self.slots_map[i]].add(i)
        return before_forward

    def _before_backward(self, unit: int) -> None:
        self.gather(self.unit_slots[unit])
        self._followed(unit, backward=True)
        self._prefetch(unit, self.next_backward)

    def _after(self, unit: int):
        canon = self.unit_slots[unit]

        def after_forward(module, args, output):
            for c in canon:
                self.active[c] -= 1
            taking = self.tracking and torch.is_grad_enabled()
            if taking:
                outs = [t for t in _tensors(output) if t.requires_grad]
                if outs:  # gathered again just before the unit's backward
                    torch.autograd.graph.register_multi_grad_hook(outs, lambda grads: self._before_backward(unit),
                                                                  mode="any")
                if unit in self.last_units:
                    return  # the forward's last unit: its backward comes next, it stays (released once handed over)
            # the backward gathers its own; a tie other units use stays until its gradient is handed
            # over, but under the first update's guard, which must see a read of it between its units
            keep = self.shared if taking and not self.guarding else ()
            self.release([c for c in canon if not self.active[c] and c not in keep])
        return after_forward

    def handed_over(self, i: int) -> None:
        """Slot ``i``'s gradient left the backward: its storage goes once no other
        occurrence's gradient is due and no forward uses it."""
        c = self.slots_map[i]
        if c is None or c not in self.pending:
            return
        self.pending[c].discard(i)
        if not self.pending[c] and not self.active[c]:
            self.release([c])

    def settle(self) -> None:
        """An item's backward ended: nothing is due any more; every storage released
        (a prefetch nobody used lands first)."""
        for c in self.sharded:
            self.pending[c].clear()
        self.gather(list(self.landing))
        self.release(self.sharded)
        self.last_forward = self.last_backward = None

    # ------------------------------------------------------------ the user's code and the end
    @contextlib.contextmanager
    def whole(self):
        """The block with every trained Parameter whole (released again afterwards)."""
        self.gather(self.sharded)
        self.held = True
        try:
            yield
        finally:
            self.held = False
            self.release(self.sharded)

    def close(self, failed: bool = False) -> None:
        """The module gets its whole values back and the hooks go. After a failure a
        collective may be impossible: each storage then gets its memory back with this
        rank's ranges in place and NaN elsewhere, never memory a read would fault on."""
        for h in self.handles:
            h.remove()
        self.handles = []
        self.tracking = False
        if not failed:
            # A chunk of slots at a time, this rank's own ranges of each let go once it is
            # whole: the peak is the whole module plus one chunk, not plus this rank's ranges.
            for chunk in self._chunks():
                self.gather(chunk)
                wanted = set(chunk)
                for r in [r for r in self.values if r.slot in wanted]:
                    del self.values[r]
            return
        with torch.no_grad():
            for c in self.sharded:  # a fetch in flight is not waited for (its peers may be gone)
                if not self.resident[c] or c in self.landing:
                    self.full[c].untyped_storage().resize_(self.nbytes[c])
                    self.resident[c] = True
                    self._storage_view(c).fill_(float("nan"))
            self.landing.clear()
            for r, v in self.values.items():
                self._storage_view(r.slot)[r.start: r.stop].copy_(v)

    def end_released(self, runner) -> None:
        """The run ends without gathering (``gather_at_end=False``): the hooks go, the
        memory stays released and this rank's ranges are dropped; the module's trained
        Parameters are unfilled again (a use is refused by name), the run's result is its
        sharded checkpoint."""
        for h in self.handles:
            h.remove()
        self.handles = []
        self.tracking = False
        self.gather(list(self.landing))  # a prefetch in flight lands (a collective) before the memory goes
        self.held = False
        self.release(self.sharded)
        self.values.clear()
        runner.unfilled = {id(self.full[c]): self.names[c] for c in self.sharded}
        guard_released(runner.module, runner.unfilled)  # the module's own forward refuses by name too

    def _chunks(self) -> list[list[int]]:
        """The sharded slots in order, in runs of at most ``CLOSE_CHUNK`` bytes (a larger
        slot alone): the same on every rank, as the gathers are collectives."""
        chunks: list[list[int]] = []
        size = 0
        for c in self.sharded:
            if not chunks or size + self.nbytes[c] > CLOSE_CHUNK:
                chunks.append([])
                size = 0
            chunks[-1].append(c)
            size += self.nbytes[c]
        return chunks

    @contextlib.contextmanager
    def guarded(self, op: str):
        """The block refused, with the slot named, where the model passes a released
        Parameter to a torch function outside its module's forward (a read that would
        otherwise touch memory that is not there). The loops guard a run's first update."""
        self.guarding = True
        try:
            with Guard(self, op):
                yield
        finally:
            self.guarding = False
