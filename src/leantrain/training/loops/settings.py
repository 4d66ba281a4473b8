"""A loop config's component records and their flat keywords.

The settings of the run's components are records, each declared, documented and checked
in its component's module: ``CheckpointOptions`` (``checkpointing.py``), ``EvalOptions``
(``evaluator.py``), ``ParallelOptions`` (``parallel/strategy.py``). A config holds them
as ``cfg.checkpoints``, ``cfg.evaluation`` and ``cfg.parallel``. Every record setting is
also a keyword of the config by its flat spelling (``checkpoint_every=``, ``eval_every=``,
``sharding=``): the table ``FLAT`` is derived from the records' fields (a field's
``metadata["flat"]``, else its name), never declared a second time. The library reads
the records; ``cfg.checkpoint_every`` reads a setting back for the user.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

from ...errors import ConfigError
from ..parallel.strategy import ParallelOptions
from .checkpointing import CheckpointOptions
from .evaluator import EvalOptions

RECORDS = {"checkpoints": CheckpointOptions, "evaluation": EvalOptions, "parallel": ParallelOptions}
# Each record setting's flat spelling (a field's ``metadata["flat"]``, else its name) -> (record, field):
# derived from the records, never declared a second time. ``LOADER``: the spellings only loader loops take.
FLAT = {f.metadata.get("flat", f.name): (name, f.name) for name, kind in RECORDS.items() for f in dataclasses.fields(kind)}
LOADER = frozenset(f.metadata["flat"] for kind in RECORDS.values() for f in dataclasses.fields(kind)
                   if f.metadata.get("loader"))


def _same(a, b) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # values without a plain equality (lists of tensors): not the same object
        return False


def group(op: str, cfg, flat: dict) -> None:
    """Build the config's records (``RECORDS``): each from the record given (a user's, or
    the config's own handed back by ``dataclasses.replace``) updated by the settings given
    by their flat spellings (``flat``), checked by the record itself. A setting given both
    ways, with two values, is refused."""
    loader = hasattr(cfg, "epochs")
    for name, kind in RECORDS.items():
        record = getattr(cfg, name)
        if record is not None and not isinstance(record, kind):
            raise ConfigError(f"{op}: {name} must be a leantrain {kind.__name__}, got {type(record).__name__}")
        mine = {(spell, field_): flat[spell] for spell, (rec, field_) in FLAT.items() if rec == name and spell in flat}
        own = record is not None and not getattr(record, "_derived", False)  # the user's, not the config's
        if own:
            for (spell, field_), value in mine.items():
                if not _same(value, getattr(record, field_)):
                    raise ConfigError(f"{op}: {spell}={value!r:.60} and {name}.{field_}={getattr(record, field_)!r:.60}: "
                                      f"give it one way")
        values = {} if record is None else {f.name: getattr(record, f.name) for f in dataclasses.fields(kind)}
        values.update({field_: value for (_, field_), value in mine.items()})
        if not loader:
            for spell in LOADER:
                if FLAT[spell][0] == name and values.get(FLAT[spell][1]) is not None:
                    raise ConfigError(f"{op}: {name}.{FLAT[spell][1]} is for loader loops (LoaderTrainConfig)")
        try:
            built = kind(**values)
        except ConfigError as e:  # say it as the config's own check
            raise ConfigError(str(e).replace(f"{kind.OP}: ", f"{op}: ", 1)) from None
        object.__setattr__(built, "_derived", True)  # the config's own: a replace's copy of it brings no news
        object.__setattr__(cfg, name, built)


def flat_keywords(cls):
    """``cls(...)`` and ``dataclasses.replace`` also take every record setting by its flat
    spelling (``checkpoint_every=5``), and ``cfg.checkpoint_every`` reads it back: one
    table (``FLAT``) derived from the records. The library itself reads the records."""
    generated = cls.__init__
    names = [spell for spell in FLAT if spell not in LOADER or hasattr(cls, "accumulate_at")]

    @functools.wraps(generated)
    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "_flat", {k: kwargs.pop(k) for k in names if k in kwargs})
        generated(self, *args, **kwargs)

    sig = inspect.signature(generated)
    defaults = {f.metadata.get("flat", f.name): f.default for kind in RECORDS.values() for f in dataclasses.fields(kind)}
    extra = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=defaults[k]) for k in names]
    __init__.__signature__ = sig.replace(parameters=list(sig.parameters.values()) + extra)
    cls.__init__ = __init__

    def __getattr__(self, name: str):
        where = FLAT.get(name) if name in names else None
        record = None if where is None else self.__dict__.get(where[0])
        if record is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(record, where[1])

    cls.__getattr__ = __getattr__
    return cls


def settings_of(cfg):
    """``(name, value)`` of every setting of ``cfg``, a record's by their flat spellings."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in RECORDS:
            yield from ((g.metadata.get("flat", g.name), getattr(value, g.name)) for g in dataclasses.fields(value))
        else:
            yield f.name, value
