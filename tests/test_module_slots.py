"""ParamList.from_module and the checkpoint parameter schema (spec §1, §9.1)."""

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain import ParameterSchema, ParamList


class TiedLM(nn.Module):
    """Embedding tied to the output projection, with a BatchNorm in between."""

    def __init__(self, vocab=11, dim=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.head = nn.Linear(dim, vocab)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.norm(self.embed(x)))


def test_tied_embedding_and_batchnorm_slot_table():
    params = ParamList.from_module(TiedLM())
    assert params.names == [
        "embed.weight", "norm.weight", "norm.bias", "head.weight", "head.bias",
        "norm.running_mean", "norm.running_var", "norm.num_batches_tracked",
    ]
    assert params.shapes == [(11, 4), (4,), (4,), (11, 4), (11,), (4,), (4,), ()]
    assert params.canonical_slot_indices() == [0, 1, 2, 0, 4, None, None, None]
    assert params[0].storage is params[3].storage
    assert params.dtypes[-1] == torch.int64
    schema = params.schema()
    assert schema.representatives == (0, 1, 2, 0, 4, None, None, None)
    assert schema.is_well_formed() and schema.has_aliases()
    assert schema.optimizer_state_count() == 4 and schema.trainable_count() == 5


def test_module_tensors_are_the_host_tensors():
    m = nn.Linear(2, 1)
    params = ParamList.from_module(m)
    params.set_values([torch.ones(1, 2), torch.zeros(1)])
    assert torch.equal(m.weight.detach(), torch.ones(1, 2))


def test_same_memory_same_view_is_one_storage():
    m = nn.Module()
    m.a = nn.Parameter(torch.zeros(3))
    m.b = nn.Parameter(m.a.data)  # a different Parameter object over the same memory
    params = ParamList.from_module(m)
    assert params.canonical_slot_indices() == [0, 0]


def test_partial_overlap_is_an_error_naming_both_slots():
    m = nn.Module()
    base = torch.zeros(6)
    m.a = nn.Parameter(base[:4])
    m.b = nn.Parameter(base[2:])
    with pytest.raises(lt.AliasError, match=r"slot 0 \('a'\) and slot 1 \('b'\) overlap"):
        ParamList.from_module(m)


def test_frozen_parameter_is_a_frozen_slot():
    m = nn.Linear(2, 2)
    m.bias.requires_grad_(False)
    assert ParamList.from_module(m).canonical_slot_indices() == [0, None]


def test_independent_layout_keeps_the_plain_schema():
    schema = ParamList.of_pack_with_requires_grad(
        [torch.zeros(2), torch.zeros(()), torch.zeros(1)], [True, False, True]
    ).schema()
    assert schema.representatives is None and schema.is_well_formed()
    assert schema.representative(1) is None and schema.representative(2) == 2
    assert not schema.has_aliases() and schema.optimizer_state_count() == 2


def test_tied_schema_equals_the_optimizer_slots():
    p, q = lt.Param(torch.zeros(2)), lt.Param(torch.zeros(3))
    params = ParamList([p.view(requires_grad=False), p, q, p])
    schema = params.schema()
    assert schema.representatives == (None, 1, 2, 1) and schema.is_well_formed()


@pytest.mark.parametrize(
    "schema, problem",
    [
        (ParameterSchema(((2,), (2,)), (True, True), (0, 1)), None),
        (ParameterSchema(((2,), (3,)), (True, True), (0, 0)), "differs from representative"),
        (ParameterSchema(((2,), (2,)), (True, False), (0, 0)), "links a frozen slot"),
        (ParameterSchema(((2,), (2,)), (True, True), (1, 1)), "not an earlier slot"),
        (ParameterSchema(((2,),), (True,), (None,)), "trainable but has no representative"),
        (ParameterSchema(((2,), (2,)), (True,), None), "requires_grad has 1 entries"),
        (ParameterSchema(((2,), (2,), (2,)), (True, True, True), (0, 0, 1)), "does not map to itself"),
    ],
)
def test_schema_well_formedness(schema, problem):
    problems = schema.problems()
    if problem is None:
        assert problems == [] and schema.is_well_formed()
    else:
        assert any(problem in p for p in problems), problems
        assert not schema.is_well_formed()
