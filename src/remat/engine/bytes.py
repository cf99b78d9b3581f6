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

A storage is identified by its key, the address of its C++ ``StorageImpl``
(the same for every Python object of one storage, and for every view): two
tensors share memory when one storage key of each is the same.

:func:`element_bytes` is a different quantity: the bytes of a tensor's own
elements (a view's, not its storage's), what a copy of it moves.
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


def leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The dense tensors whose storages hold ``t``'s memory (none for a meta tensor).

    Example:
        >>> import torch
        >>> s = torch.eye(3).to_sparse()
        >>> [tuple(p.shape) for p in leaves(s)]  # its indices and values
        [(2, 3), (3,)]
    """
    if t.layout is _STRIDED and type(t) in _PLAIN:
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
            out.append((st._cdata, st.nbytes(), leaf.device))
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
                seen[st._cdata] = st.nbytes()
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
        return t.numel() * t.element_size()
    return sum(getattr(t, p)().nbytes for p in parts)
