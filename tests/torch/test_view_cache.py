"""``ViewCache``: the backend's cached NumPy views of tensors it sees again and again are
the tensor's memory, are dropped the moment the tensor changes or dies, and never keep
a tensor alive."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from netdist.torch.array_views import ViewCache, as_array


def _cached(cache: ViewCache, tensor: torch.Tensor) -> np.ndarray:
    view = cache.lookup(tensor)
    if view is None:
        cache.store(tensor, as_array(tensor, "test"))
        view = cache.lookup(tensor)
    assert view is not None
    return view


def _backend_view(cache: ViewCache, tensor: torch.Tensor) -> np.ndarray:
    """What the backend does: the cached view, else a fresh one that is then stored."""
    view = cache.lookup(tensor)
    if view is None:
        view = as_array(tensor, "test")
        cache.store(tensor, view)
    return view


def test_a_hit_is_the_tensors_memory() -> None:
    cache = ViewCache()
    t = torch.arange(6, dtype=torch.float32)
    view = _cached(cache, t)
    assert cache.lookup(t) is view and len(cache) == 1
    view += 1                      # writes land in the tensor ...
    assert t.tolist() == [1, 2, 3, 4, 5, 6]
    t.mul_(2)                      # ... and the tensor's writes show in the view
    np.testing.assert_array_equal(view, [2, 4, 6, 8, 10, 12])


@pytest.mark.parametrize("change", ["resize", "set", "as_strided", "data"])
def test_a_changed_tensor_misses(change: str) -> None:
    cache = ViewCache()
    t = torch.zeros(8)
    _cached(cache, t)
    if change == "resize":
        t.resize_(4)
    elif change == "set":
        t.set_(torch.ones(8).untyped_storage())
    elif change == "as_strided":
        t.as_strided_((4,), (2,))
    else:
        t.data = torch.ones(8)
    assert cache.lookup(t) is None and len(cache) == 0
    if t.is_contiguous():
        np.testing.assert_array_equal(_cached(cache, t), t.numpy())


def test_the_cache_never_keeps_a_tensor_alive() -> None:
    cache = ViewCache()
    t = torch.ones(1 << 16)
    _cached(cache, t)
    alive = weakref.ref(t)
    del t
    gc.collect()
    assert alive() is None and len(cache) == 0


def test_a_reused_id_is_not_mistaken_for_the_old_tensor() -> None:
    cache = ViewCache()
    a = torch.ones(4)
    _cached(cache, a)
    key = id(a)
    del a
    gc.collect()
    others = [torch.full((4,), 7.0) for _ in range(64)]  # likely to reuse the id
    for b in others:
        view = cache.lookup(b)
        assert view is None or id(b) != key
    assert all(_cached(cache, b)[0] == 7.0 for b in others[:3])


def test_capacity_evicts_least_recently_used() -> None:
    cache = ViewCache(capacity=2)
    a, b, c = torch.ones(2), torch.ones(3), torch.ones(4)
    _cached(cache, a)
    _cached(cache, b)
    assert cache.lookup(a) is not None     # a is now the most recent
    _cached(cache, c)
    assert len(cache) == 2 and cache.lookup(b) is None and cache.lookup(a) is not None
    with pytest.raises(ValueError, match="capacity"):
        ViewCache(capacity=0)


def test_non_contiguous_and_empty_tensors_are_not_cached() -> None:
    cache = ViewCache()
    cache.store(torch.ones(4, 4).t(), as_array(torch.ones(4, 4).t(), "test"))
    cache.store(torch.ones(0), as_array(torch.ones(0), "test"))
    assert len(cache) == 0


def test_threads_sharing_a_cache_always_get_the_right_memory() -> None:
    """Torch calls the backend from several threads; eviction and drops race with lookups
    and must never hand out another tensor's view or raise."""
    import threading

    cache = ViewCache(capacity=3)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            tensors = [torch.full((16,), float(seed * 100 + i)) for i in range(6)]
            for round_ in range(400):
                index = (round_ * 7 + seed) % len(tensors)
                if round_ % 50 == 49:  # let a tensor die: its entry must go with it
                    tensors[index] = torch.full((16,), float(seed * 100 + index))
                t = tensors[index]
                view = _backend_view(cache, t)
                assert view[0] == seed * 100 + index and view.ctypes.data == t.data_ptr()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert not errors, errors[0]
