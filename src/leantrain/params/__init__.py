"""Parameters (seed 1, "Trainer Parameters"): storages, views, lists, packs, schema."""

from .packs import add_gradient_packs, canonical_gradient, canonical_gradients, scale_gradient_pack
from .param import Param
from .paramlist import ParamList, params_of
from .schema import ParameterSchema
from .storage import Storage

__all__ = [
    "Storage", "Param", "ParamList", "ParameterSchema", "params_of",
    "canonical_gradients", "canonical_gradient", "add_gradient_packs", "scale_gradient_pack",
]
