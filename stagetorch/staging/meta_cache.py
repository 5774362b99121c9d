"""Output metadata by input metadata: the cache in front of FakeTensorMode.

FakeTensorMode spends most of a trace hashing arguments for its own cache and rebuilding outputs; a
transformer repeats the same few calls layer after layer. For ops that make fresh outputs or one view of
their first argument, the outputs' metadata is a function of the op, the inputs' metadata and the other
arguments: the first call runs the fake kernel and every later one builds its outputs from the cached
metadata (:func:`meta_key`, :func:`remember`, :func:`from_entry`). Shared by every trace (static shapes only).

What it must not know: the recorder, the errors, or the op registry's rules (the recorder applies them
before it remembers a call).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ..utils import caches
from ..utils.tree import flat_call, flatten

__all__ = ["META_CACHE", "meta_key", "remember", "from_entry"]


META_CACHE: dict[tuple, tuple] = {}
_MAX_META_CACHE = 1 << 16
_CACHE_KIND: dict[Any, str | None] = {}  # op -> "fresh", "view" or None (never cached)
caches.on_clear(META_CACHE.clear)
caches.on_clear(_CACHE_KIND.clear)


def _cache_kind(func: Any) -> str | None:
    kind = _CACHE_KIND.get(func, "?")
    if kind != "?":
        return kind
    kind = None
    schema = getattr(func, "_schema", None)
    if (
        schema is not None
        and func.namespace == "aten"
        and schema.returns
        and all(isinstance(r.type, torch.TensorType) for r in schema.returns)
        and not {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output, torch.Tag.inplace_view} & set(func.tags)
    ):
        writes = [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments]
        aliased = [r.alias_info is not None for r in schema.returns]
        if not any(writes):
            if not any(aliased):
                kind = "fresh"  # or, as _unsafe_view, a view its schema does not declare: told apart per call
            elif func.is_view and aliased == [True]:
                kind = "view"
        elif writes[0] and not any(writes[1:]) and len(aliased) == 1 and schema.returns[0].alias_info.is_write:
            kind = "inplace"  # returns its first argument, whose metadata does not change
    _CACHE_KIND[func] = kind
    return kind


def meta_key(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """The op, each fake input's metadata, and every other argument with its type (1 and 1.0 apart); None
    when the call cannot be cached (a real tensor, a fake with a constant, complex or not strided)."""
    if _cache_kind(func) is None:
        return None
    key: list[Any] = [func]
    for x in flat_call(args, kwargs):
        kind = type(x)
        if kind is FakeTensor:
            if x.constant is not None or x.dtype.is_complex or x.layout != torch.strided:
                return None
            key.append((x.shape, x.stride(), x.storage_offset(), x.dtype, x.fake_device))
        elif isinstance(x, torch.Tensor):
            return None
        else:
            key.append(kind)
            key.append(x)
    key = tuple(key)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def remember(key: tuple, func: Any, args: tuple, out: Any) -> None:
    """Cache ``out``'s metadata when the outputs are one of three things: the first argument itself (in
    place), one view of the first argument, or fresh dense storages exactly as large as their shapes need."""
    kind = _cache_kind(func)
    base = args[0] if args and type(args[0]) is FakeTensor else None
    if kind == "inplace":
        if out is base:
            _store(key, ("inplace", True, None, ()))
        return
    single = type(out) is FakeTensor
    outs = [out] if single else out
    if not isinstance(outs, (tuple, list)) or not outs or any(type(t) is not FakeTensor for t in outs):
        return
    if any(t.constant is not None or t.layout != torch.strided or t.dtype.is_complex for t in outs):
        return
    metas = tuple((t.shape, t.stride(), t.storage_offset(), t.dtype, t.fake_device) for t in outs)
    storages = [t.untyped_storage()._cdata for t in outs]
    if single and base is not None and storages[0] == base.untyped_storage()._cdata:
        _store(key, ("view", True, None, metas))
        return
    if kind == "view":
        return
    inputs = {t.untyped_storage()._cdata for t in flatten(args) if type(t) is FakeTensor}
    if len(set(storages)) != len(storages) or inputs & set(storages):
        return
    for t, (shape, stride, offset, dtype, _) in zip(outs, metas):
        with torch._C._DisableTorchDispatch():
            fresh = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        if offset != 0 or fresh.untyped_storage().nbytes() != t.untyped_storage().nbytes():
            return
    _store(key, ("fresh", single, type(out), metas))


def _store(key: tuple, entry: tuple) -> None:
    if len(META_CACHE) >= _MAX_META_CACHE:
        META_CACHE.clear()
    META_CACHE[key] = entry


def from_entry(entry: tuple, args: tuple, mode: FakeTensorMode) -> Any:
    kind, single, container, metas = entry
    if kind == "inplace":
        return args[0]
    outs = []
    for shape, stride, offset, dtype, device in metas:
        with torch._C._DisableTorchDispatch():
            if kind == "view":
                empty = torch.empty(0, dtype=dtype, device="meta")
                empty.set_(args[0].untyped_storage(), offset, shape, stride)
            else:
                empty = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        outs.append(FakeTensor(mode, empty, device))
    return outs[0] if single else container(outs)
