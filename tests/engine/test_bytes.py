"""remat.engine.bytes: the storages that hold each kind of tensor, against bytes computed by hand;
the planner's static bytes, the tracker and offload count sparse tensors by their parts."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

import remat
from remat.engine.bytes import (
    data_address,
    dense_bytes,
    element_bytes,
    held_storages,
    is_plain,
    key_of,
    leaves,
    same_storage,
    shares_storage,
    storage_bytes,
    storage_key,
    storages,
)

# torch warns once per process that CSR is in beta; pytest turns warnings into errors
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
]


def csr(values: torch.Tensor | None = None) -> torch.Tensor:
    """An 8x8 CSR matrix of 10 entries, built from parts that each own their storage."""
    crow = torch.tensor([0, 2, 3, 5, 6, 8, 8, 9, 10])  # 9 int64
    col = torch.tensor([0, 3, 1, 2, 7, 4, 5, 6, 7, 0])  # 10 int64
    values = torch.arange(10.0) if values is None else values  # 10 float32
    return torch.sparse_csr_tensor(crow, col, values, (8, 8), check_invariants=True)


CSR_BYTES = 9 * 8 + 10 * 8 + 10 * 4


class Pair(torch.Tensor):
    """A traceable wrapper subclass of two inner tensors (like torch's ``TwoTensor``)."""

    @staticmethod
    def __new__(cls, a: torch.Tensor, b: torch.Tensor) -> Pair:
        return torch.Tensor._make_wrapper_subclass(cls, a.shape, dtype=a.dtype, device=a.device)

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b

    def __tensor_flatten__(self):
        return ["a", "b"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Pair(inner["a"], inner["b"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        a = func(
            *tree_map_only(Pair, lambda p: p.a, args), **tree_map_only(Pair, lambda p: p.a, kwargs)
        )
        b = func(
            *tree_map_only(Pair, lambda p: p.b, args), **tree_map_only(Pair, lambda p: p.b, kwargs)
        )
        return Pair(a, b) if isinstance(a, torch.Tensor) else a


class Opaque(torch.Tensor):
    """A wrapper subclass with no ``__tensor_flatten__``: its storage is a placeholder."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Opaque:
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, dtype=inner.dtype, device=inner.device
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_a_dense_tensor_is_its_storage():
    x = torch.zeros(3, 5)
    assert storages(x) == [(storage_key(x.untyped_storage()), 60, torch.device("cpu"))]
    assert storage_bytes([x]) == 60 and element_bytes(x) == 60


def test_a_view_counts_its_whole_storage_but_copies_only_its_elements():
    x = torch.zeros(4, 4)
    v = x[1:3, ::2]  # 4 of the 16 elements
    assert storage_bytes([v]) == 64
    assert element_bytes(v) == 16
    assert shares_storage(x, v) and shares_storage(v, x)


def test_two_views_of_one_storage_count_it_once():
    x = torch.zeros(10)
    a, b = x[:5], x[5:]
    assert storage_bytes([a, b]) == 40
    assert storage_bytes([a, b, x, torch.zeros(2)]) == 40 + 8
    assert shares_storage(a, b)  # disjoint elements, one storage


def test_a_sparse_coo_tensor_is_its_indices_and_values():
    i = torch.tensor([[0, 1, 2], [2, 0, 1]])  # 6 int64
    v = torch.tensor([1.0, 2.0, 3.0])  # 3 float32
    # the checks opted into for the whole construction: torch 2.11 warns "Sparse invariant
    # checks are implicitly disabled" for a COO tensor even with check_invariants=True
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        s = torch.sparse_coo_tensor(i, v, (3, 3))
    assert storage_bytes([s]) == 6 * 8 + 3 * 4
    assert element_bytes(s) == 6 * 8 + 3 * 4
    assert [p.layout for p in leaves(s)] == [torch.strided] * 2
    assert shares_storage(s, s._values()) and not shares_storage(s, torch.zeros(3))


@pytest.mark.parametrize(
    "layout, block",
    [
        (torch.sparse_csr, ()),  # crow indices, col indices, values
        (torch.sparse_csc, ()),  # ccol indices, row indices, values
        (torch.sparse_bsr, (2, 2)),  # as CSR, each value a 2x2 block
        (torch.sparse_bsc, (2, 2)),  # as CSC, each value a 2x2 block
    ],
    ids=["csr", "csc", "bsr", "bsc"],
)
def test_a_compressed_sparse_tensor_is_its_two_indices_and_values(layout, block):
    compressed = torch.tensor([0, 2, 3, 5, 6, 8, 8, 9, 10])  # 9 int64
    plain = torch.tensor([0, 3, 1, 2, 7, 4, 5, 6, 7, 0])  # 10 int64
    values = torch.zeros(10, *block)  # 10 float32 scalars or 2x2 blocks
    size = (8 * (block[0] if block else 1),) * 2
    s = torch.sparse_compressed_tensor(
        compressed, plain, values, size, layout=layout, check_invariants=True
    )
    expected = 9 * 8 + 10 * 8 + values.numel() * 4
    assert storage_bytes([s]) == expected
    assert element_bytes(s) == expected
    assert shares_storage(s, plain) and shares_storage(s, values)


def test_a_sparse_csr_tensor_and_its_values_count_the_values_once():
    vals = torch.arange(10.0)
    s = csr(vals)
    assert storage_bytes([s, vals, vals[2:]]) == CSR_BYTES
    assert shares_storage(s, vals)


def test_a_wrapper_subclass_is_its_inner_tensors():
    a, b = torch.zeros(4), torch.zeros(4, dtype=torch.float64)
    p = Pair(a, b)
    assert storage_bytes([p]) == 16 + 32
    assert {key for key, _, _ in storages(p)} == {
        storage_key(a.untyped_storage()),
        storage_key(b.untyped_storage()),
    }
    assert storage_bytes([Pair(a, a[1:])]) == 16  # two views of one storage: once
    assert shares_storage(p, b) and not shares_storage(p, torch.zeros(4))


def test_a_wrapper_subclass_without_flatten_is_counted_at_its_own_size():
    # its inner tensors are hidden: it is counted by its placeholder storage, the bytes of
    # its shape and dtype (what the tracker and the planner counted before this module)
    o = Opaque(torch.zeros(4, dtype=torch.float64))
    assert storage_bytes([o]) == 32
    assert not shares_storage(o, o.inner) and shares_storage(o, o)


def test_an_empty_tensor_holds_no_bytes_and_shares_none():
    e = torch.empty(0)
    assert storage_bytes([e]) == 0 and element_bytes(e) == 0
    assert not shares_storage(e, e[:])


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(4, 4, device="meta"),  # a meta tensor
        lambda: torch.zeros(4, 4, device="meta")[1:],  # a view of one
    ],
    ids=["meta", "meta-view"],
)
def test_a_meta_tensor_holds_no_bytes(make):
    t = make()
    assert storages(t) == [] and storage_bytes([t]) == 0


def test_a_fake_tensor_holds_no_bytes():
    with FakeTensorMode():
        f = torch.zeros(4, 4)
    assert f.device.type == "cpu"  # it says cpu; its storage is on meta
    assert storage_bytes([f]) == 0


class Sub(torch.Tensor):
    """A plain subclass: its own storage, like a torch.Tensor."""


def test_a_plain_subclass_is_its_storage():
    x = torch.zeros(6)
    assert storage_bytes([x.as_subclass(Sub)]) == 24 and shares_storage(x.as_subclass(Sub), x)


@pytest.mark.parametrize("wrap", [lambda x: x, lambda x: x.as_subclass(Sub)], ids=["plain", "sub"])
def test_a_batched_tensor_inside_vmap_holds_no_bytes_of_its_own(wrap):
    # functorch's batched tensors have no storage to read
    seen = []

    def f(x):
        x = wrap(x)
        seen.append((storages(x), storage_bytes([x]), shares_storage(x, x)))
        return x.sin()

    torch.func.vmap(f)(torch.zeros(2, 3))
    assert seen == [([], 0, False)]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs MKL-DNN")
def test_an_opaque_mkldnn_tensor_has_no_storage_but_copies_its_elements():
    t = torch.zeros(3, 3).to_mkldnn()
    assert storage_bytes([t]) == 0 and storages(t) == []
    assert element_bytes(t) == 9 * 4


def test_a_meta_subclass_holds_no_bytes():
    assert storage_bytes([torch.zeros(4, device="meta").as_subclass(Sub)]) == 0


def test_storage_bytes_counts_only_the_device_asked_for_and_skips_non_tensors():
    x = torch.zeros(8)
    assert storage_bytes([x, None, 3], torch.device("cpu")) == 32
    assert storage_bytes([x], torch.device("meta")) == 0


def test_the_tracker_counts_a_sparse_csr_tensor_made_inside_by_its_parts():
    with remat.memory.track() as t:
        s = csr()
    assert t.current_bytes == storage_bytes([s]) == CSR_BYTES
    del s
    assert t.current_bytes == 0


class SparseMixModel(nn.Module):
    """Three MLP blocks after a fixed sparse CSR mixing matrix kept as a buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("mix", csr(torch.randn(10)))
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8)) for _ in range(3)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks((self.mix @ x.t()).t())


def test_profile_static_bytes_count_a_sparse_csr_buffer_by_its_parts():
    # before: the planner counted a CSR buffer as 0 bytes (only COO had parts)
    model = SparseMixModel()
    x = torch.randn(4, 8, requires_grad=True)
    prof = remat.profile(model, x, timer="flops")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert prof.static_bytes == params + 4 * 8 * 4 + CSR_BYTES


def _fake() -> torch.Tensor:
    with FakeTensorMode():
        return torch.zeros(4, 4)


def _nested() -> torch.Tensor:
    return torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(4, 3)], layout=torch.jagged)


#: Each kind of tensor, as every function of the module reads it: (make, plain, has a key of
#: its own storage, storages holding it, storage bytes, element bytes, dense bytes).
KINDS = {
    # torch's own dense class: its storage, read first
    "plain": (lambda: torch.zeros(4, 4), True, True, 1, 64, 64, 64),
    "parameter": (lambda: nn.Parameter(torch.zeros(4)), True, True, 1, 16, 16, 16),
    # a view: its whole storage held, its own elements copied
    "view": (lambda: torch.zeros(4, 4)[1:], True, True, 1, 64, 48, 48),
    # a plain subclass: its own storage, like a tensor, but not read first
    "subclass": (lambda: torch.zeros(4, 4).as_subclass(Sub), False, True, 1, 64, 64, 64),
    # sparse: its parts (indices 2x3 int64, values 3 float32); no storage of its own
    "sparse": (lambda: torch.eye(3).to_sparse(), False, False, 2, 60, 60, 36),
    # a traceable wrapper: its inner tensors; its own storage is a placeholder
    "wrapper": (lambda: Pair(torch.zeros(4), torch.zeros(4)), False, True, 2, 32, 16, 16),
    # a wrapper without __tensor_flatten__: its placeholder, at its shape's bytes
    "opaque": (lambda: Opaque(torch.zeros(4)), False, True, 1, 16, 16, 16),
    # meta and fake: storages on meta hold no bytes (outside meta_holds_bytes)
    "meta": (lambda: torch.zeros(4, 4, device="meta"), True, True, 0, 0, 64, 64),
    "fake": (_fake, False, True, 0, 0, 64, 64),
    # a jagged nested tensor: a traceable wrapper (values 6x3 float32, offsets 3 int64, and
    # two empty sequence-length tensors)
    "nested": (_nested, False, True, 4, 96, 72, 72),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_of_tensor_is_read_alike_by_every_function(kind):
    make, plain, own, held, stored, elements, dense = KINDS[kind]
    t = make()
    assert is_plain(t) is plain
    assert (key_of(t) is not None) is own
    assert len(held_storages(t)) == held
    assert [storage_key(st) for st in held_storages(t)] == [k for k, _, _ in storages(t)]
    assert storage_bytes([t]) == stored and storage_bytes([t, t]) == stored
    assert element_bytes(t) == elements and dense_bytes(t) == dense
    assert same_storage(t, t) is own


def test_views_share_one_key_and_a_clone_has_its_own():
    x = torch.zeros(4, 4)
    assert key_of(x) == key_of(x[1:]) == key_of(x.t()) == storage_key(x.untyped_storage())
    assert key_of(x.clone()) != key_of(x)
    assert same_storage(x, x[2:]) and not same_storage(x, x.clone())


def test_meta_tensors_are_told_apart_by_their_storages_not_their_data():
    # every meta tensor's data is at 0: the key (the storage itself) still tells them apart,
    # which is what a profile from shapes needs (spans, the selective cache)
    a, b = torch.empty(4, device="meta"), torch.empty(4, device="meta")
    assert same_storage(a, a[1:]) and not same_storage(a, b)
    assert data_address(a) == key_of(a) != data_address(b)
    assert not shares_storage(a, a)  # no bytes held: shares none


def test_a_tensor_with_no_storage_of_its_own_shares_none_by_identity():
    s = torch.eye(3).to_sparse()
    assert key_of(s) is None and not same_storage(s, s)
    assert shares_storage(s, s)  # its parts hold bytes


def test_data_address_is_the_data_of_a_dense_storage_and_the_key_of_an_empty_one():
    x = torch.zeros(4)
    assert data_address(x[2:]) == data_address(x) == x.data_ptr()
    e = torch.empty(0)
    assert data_address(e) == key_of(e)
