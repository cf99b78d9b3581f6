"""Which storages hold a tensor's memory, and how many bytes that is.

The one place that knows where a tensor's bytes are; the memory tracker, the
planner and offload read them from here.

* A dense tensor (a view too) is held by its untyped storage: several views
  of one storage count it once, whole, whatever part of it each one sees.
* A sparse tensor is held by its parts: COO by its indices and values, CSR and
  BSR by crow indices, col indices and values, CSC and BSC by ccol indices,
  row indices and values.
* A traceable wrapper subclass (``DTensor``, a jagged ``NestedTensor``, any
  tensor with ``__tensor_flatten__``) is held by its inner tensors, found
  again by these rules (a ``DTensor`` by its local shard, not its global size).
* A wrapper subclass made by ``_make_wrapper_subclass`` without
  ``__tensor_flatten__`` hides its inner tensors (the memory tracker does not
  see the operators its ``__torch_dispatch__`` runs): it is counted by its
  placeholder storage, the bytes of its own shape and dtype.
* An opaque layout (MKL-DNN's), a tensor with no storage (functorch's batched
  tensors inside ``vmap``) and a meta or fake tensor (its storage is on
  ``meta``) hold no bytes.

A storage is identified by its key (:func:`storage_key`), the address of its C++
``StorageImpl`` (the same for every Python object of one storage, and for every view):
two tensors share memory when one storage key of each is the same. This module is the
only reader of that address; :func:`data_address` is where a storage's data are.

Two other quantities: :func:`element_bytes`, the bytes of a tensor's own elements (a
view's, not its storage's), what a copy of it moves; :func:`dense_bytes`, its elements
times their size (a sparse tensor at its dense size), what counted operators read.

Each kind of tensor as read here: what holds it (:func:`leaves`), the key of its own
storage (:func:`key_of`) and its element bytes (``tests/engine/test_bytes.py`` checks each):

=================  ======================  ===================  ===================
tensor             held by                 own key              element bytes
=================  ======================  ===================  ===================
plain, Parameter   itself                  its storage's        its elements'
view               itself (storage whole)  its base's           the view's own
sparse             its parts               none                 its parts'
traceable wrapper  its inner tensors       its placeholder's    its elements'
meta, fake         nothing (inside         its storage's,       its elements'
                   meta_holds_bytes:       on meta
                   itself)
=================  ======================  ===================  ===================
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


_META_HOLDS = contextvars.ContextVar("remat_meta_holds_bytes", default=False)


@contextlib.contextmanager
def meta_holds_bytes() -> Iterator[None]:
    """Inside, a meta tensor holds the bytes of its storage, as it would on a real device:
    how a model built on the meta device is measured from its shapes alone (the planner's
    shapes-only profile). Outside (the default) a meta tensor holds none.

    Example:
        >>> import torch
        >>> x = torch.empty(4, 4, device="meta")
        >>> with meta_holds_bytes():
        ...     inside = storage_bytes([x])
        >>> inside, storage_bytes([x])
        (64, 0)
    """
    token = _META_HOLDS.set(True)
    try:
        yield
    finally:
        _META_HOLDS.reset(token)


def meta_counts() -> bool:
    """Whether meta tensors hold bytes here (inside :func:`meta_holds_bytes`)."""
    return _META_HOLDS.get()


def is_plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is a dense tensor of torch's own class (a ``Parameter`` too): held by its
    own storage, the common case read first (no subclass, no sparse parts).

    Example:
        >>> import torch
        >>> is_plain(torch.zeros(2)), is_plain(torch.nn.Parameter(torch.zeros(2)))
        (True, True)
        >>> is_plain(torch.eye(2).to_sparse())
        False
    """
    return type(t) in _PLAIN and t.layout is _STRIDED


def storage_key(st: torch.UntypedStorage) -> int:
    """The identity of a storage: the address of its C++ ``StorageImpl``, the same for every
    Python object of it and every view onto it (a meta storage's too, whose data are at 0).

    Example:
        >>> import torch
        >>> x = torch.zeros(4)
        >>> storage_key(x.untyped_storage()) == storage_key(x[1:].untyped_storage())
        True
    """
    return int(st._cdata)


def key_of(t: torch.Tensor) -> int | None:
    """The key of ``t``'s own storage (a wrapper subclass's placeholder, a meta tensor's on
    meta), or ``None`` for a tensor with none (sparse, functorch's batched tensors)."""
    st = _storage(t)
    return None if st is None else storage_key(st)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one storage object, their own, empty and meta ones
    included (:func:`shares_storage` reads the storages holding bytes instead).

    Example:
        >>> import torch
        >>> x = torch.empty(4, device="meta")
        >>> same_storage(x, x[1:]), same_storage(x, torch.empty(4, device="meta"))
        (True, False)
    """
    key = key_of(a)
    return key is not None and key == key_of(b)


def data_address(t: torch.Tensor) -> int:
    """Where ``t``'s storage is: its data's address, or for a meta or fake tensor (whose data
    are all at 0) and an empty storage its key.

    Example:
        >>> import torch
        >>> x = torch.zeros(4)
        >>> data_address(x[2:]) == data_address(x) == x.data_ptr()
        True
    """
    st = t.untyped_storage()
    if st.device.type == "meta":  # a meta or fake tensor: its data are nowhere
        return storage_key(st)
    return st.data_ptr() or storage_key(st)


def leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The dense tensors whose storages hold ``t``'s memory (none for a meta tensor).

    Example:
        >>> import torch
        >>> s = torch.eye(3).to_sparse()
        >>> [tuple(p.shape) for p in leaves(s)]  # its indices and values
        [(2, 3), (3,)]
    """
    if is_plain(t):
        return [] if t.is_meta and not _META_HOLDS.get() else [t]
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, n) for n in names]  # some subclasses list a DeviceMesh too
        return [x for i in inner if isinstance(i, torch.Tensor) for x in leaves(i)]
    parts = _SPARSE_PARTS.get(t.layout)
    if parts is not None:
        # Outside dispatch: a mode that counts operators (the memory tracker) must not
        # see these reads.
        with torch._C._DisableTorchDispatch():
            got = [getattr(t, p)() for p in parts]
        return [x for p in got for x in leaves(p)]
    meta = _META_HOLDS.get()
    if t.layout is not _STRIDED or (t.is_meta and not meta):  # an opaque layout: no storage
        return []
    st = _storage(t)
    if st is None or (st.device.type == "meta" and not meta):  # a fake tensor's: on meta
        return []
    return [t]


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """``t``'s untyped storage, or ``None`` for a tensor that has none (functorch's batched
    tensors inside ``vmap``)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def held_storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages that hold ``t``'s memory: those of its :func:`leaves`."""
    return [st for leaf in leaves(t) if (st := _storage(leaf)) is not None]


def storages(t: torch.Tensor) -> list[tuple[int, int, torch.device]]:
    """``(key, nbytes, device)`` of each storage that holds ``t``'s memory.

    Example:
        >>> import torch
        >>> x = torch.zeros(4, 4)
        >>> [(n, str(d)) for _, n, d in storages(x[1:])]  # a view: its whole storage
        [(64, 'cpu')]
    """
    out = []
    for leaf in leaves(t):
        st = _storage(leaf)
        if st is not None:
            out.append((storage_key(st), st.nbytes(), leaf.device))
    return out


def storage_bytes(tensors: Iterable[object], device: torch.device | None = None) -> int:
    """Bytes of the distinct storages of ``tensors``, each once (on ``device`` when given).

    Entries that are not tensors (``None``) are skipped.

    Example:
        >>> import torch
        >>> x = torch.zeros(4, 4)
        >>> storage_bytes([x, x[0], x.t()])  # three views of one 64-byte storage
        64
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        for leaf in leaves(t):
            if device is not None and leaf.device != device:
                continue
            st = _storage(leaf)
            if st is not None:
                seen[storage_key(st)] = st.nbytes()
    return sum(seen.values())


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share a storage that holds bytes (empty ones share none).

    Example:
        >>> import torch
        >>> x = torch.zeros(4)
        >>> shares_storage(x, x[1:]), shares_storage(x, x.clone())
        (True, False)
    """
    mine = {key for key, nbytes, _ in storages(a) if nbytes}
    return bool(mine) and any(key in mine for key, nbytes, _ in storages(b) if nbytes)


def element_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s own elements, what a copy of it moves: a view's, not its storage's;
    a sparse tensor's parts'; an opaque layout's (MKL-DNN) elements at their size.

    Example:
        >>> import torch
        >>> element_bytes(torch.zeros(4, 4)[0]), element_bytes(torch.eye(3).to_sparse())
        (16, 60)
    """
    if t.layout is _STRIDED:
        return t.nbytes
    parts = _SPARSE_PARTS.get(t.layout)
    if parts is None:
        return dense_bytes(t)
    return sum(getattr(t, p)().nbytes for p in parts)


def dense_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements at their size, as if dense (a sparse tensor at its dense
    size): what the cost model counts an operator reading ``t`` to move.

    Example:
        >>> import torch
        >>> dense_bytes(torch.zeros(4, 4)[0]), dense_bytes(torch.eye(3).to_sparse())
        (16, 36)
    """
    return t.numel() * t.element_size()


def fmt_bytes(n: float) -> str:
    """Bytes with a binary prefix, two decimals: the units of every figure remat prints
    (plans, explanations, verification).

    Example:
        >>> fmt_bytes(512), fmt_bytes(3 * 2**20), fmt_bytes(-2048)
        ('512 B', '3.00 MiB', '-2.00 KiB')
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
