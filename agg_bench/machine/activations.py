"""Saved activations: the bytes autograd keeps for backward, counted through saved-tensor hooks
(``SavedActivations``), and the regions of a training step whose saves are counted
(``saved_activation_region``, ``counting_regions``); and the working memory of a region without autograd,
counted through the tensors its operators return (``WorkingMemory``, for the memory planner). Part of the
run's telemetry (:mod:`agg_bench.machine.telemetry`, which re-exports the first names)."""
from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class _SavedHandle:
    """What autograd stores in place of a saved tensor while ``SavedActivations`` is active.

    Releasing the handle (when autograd frees the graph) releases its bytes from the live count.
    """

    __slots__ = ("tensor", "version", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: Any, owner: "SavedActivations | None"):
        # A detached alias shares storage and version counter but not the graph, so the handle does
        # not keep the autograd graph alive through a reference cycle (a tensor that does not
        # require grad has no graph to keep).
        self.tensor = tensor.detach() if tensor.requires_grad else tensor
        self.version = tensor._version
        self.key = key
        self.owner = owner

    def __del__(self) -> None:
        if self.owner is not None:
            self.owner._release(self.key)


class SavedActivations:
    """Peak bytes of tensors that autograd holds for a backward pass, counted exactly.

    Accounting rule: every tensor saved for backward while the tracker is active is counted by the
    size of its underlying storage (``untyped_storage().nbytes()``), and each storage once however
    many saved tensors or views share it. A storage leaves the count when autograd frees the last
    saved tensor that uses it (after backward, or when the graph is dropped). Storages of
    ``nn.Parameter`` objects (saved directly or as a view such as ``weight.t()``) are not counted,
    trainable or frozen: they live as long as the model whether or not a backward runs. Everything
    else is counted, including inputs that do not require grad (latents, conditioning) and buffers,
    since the graph keeps them alive. The count depends only on which tensors autograd saves, never
    on an allocator, so it is the same on every device for the same kernels (attention backends on
    different devices may save different tensors) and works on the ``meta`` device.

    ``peak_bytes`` is the largest live count seen while active; ``live_bytes`` is the current count.
    The tracker can be entered several times; counts carry over, and ``reset()`` restarts the peak.
    Trackers do not nest: an inner one sees the tensors saved inside it, the outer one does not.

    While active, autograd skips its own in-place modification check for saved tensors (a property
    of ``saved_tensors_hooks``); the tracker restores it by comparing version counters on unpack.
    Tensors saved inside non-reentrant gradient checkpointing regions are handled by checkpointing's
    own hooks and are not seen.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refs: dict[Any, int] = {}
        self._sizes: dict[Any, int] = {}
        # Handles are released from finalizers, which can run on any thread and at any allocation,
        # even inside ``_pack``; they only queue the key, and the count is settled under the lock.
        self._released: deque[Any] = deque()
        self._live_bytes = 0
        self._peak_bytes = 0
        self._hooks: Any = None

    @property
    def live_bytes(self) -> int:
        """Bytes of saved storages autograd still holds."""
        with self._lock:
            self._settle_releases()
            return self._live_bytes

    @property
    def peak_bytes(self) -> int:
        """Largest ``live_bytes`` since creation or ``reset()``."""
        with self._lock:
            return self._peak_bytes

    def reset(self) -> None:
        """Forget the peak: it restarts from the bytes that are live now."""
        with self._lock:
            self._settle_releases()
            self._peak_bytes = self._live_bytes

    @property
    def active(self) -> bool:
        """Whether the tracker's hooks are installed (inside its ``with`` block)."""
        return self._hooks is not None

    def _settle_releases(self) -> None:
        while self._released:
            key = self._released.popleft()
            count = self._refs[key] - 1
            if count == 0:
                del self._refs[key]
                self._live_bytes -= self._sizes.pop(key)
            else:
                self._refs[key] = count

    def _pack(self, tensor: torch.Tensor) -> Any:
        # Called for every saved tensor: kept to a few attribute reads and dict operations.
        base = tensor._base
        if isinstance(tensor if base is None else base, nn.Parameter):
            return tensor
        try:
            storage = tensor.untyped_storage()
            key, nbytes = storage._cdata, None
        except (RuntimeError, NotImplementedError, AttributeError):
            # Tensors without a plain storage (sparse, some subclasses) count by their own size,
            # each as its own entry.
            storage, key, nbytes = None, ("tensor", next(_unshared_keys)), tensor.numel() * tensor.element_size()
        with self._lock:
            if self._released:
                self._settle_releases()
            count = self._refs.get(key, 0)
            if count == 0:
                if nbytes is None:
                    assert storage is not None  # only a plain storage leaves its size to be read here
                    nbytes = int(storage.nbytes())
                self._sizes[key] = nbytes
                self._live_bytes += nbytes
                if self._live_bytes > self._peak_bytes:
                    self._peak_bytes = self._live_bytes
            self._refs[key] = count + 1
        return _SavedHandle(tensor, key, self)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if type(packed) is not _SavedHandle:
            return packed
        tensor = packed.tensor
        if tensor._version != packed.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: saved at version {packed.version}, now at version "
                f"{tensor._version}"
            )
        return tensor

    def _release(self, key: Any) -> None:
        self._released.append(key)

    def __enter__(self) -> "SavedActivations":
        if self.active:
            raise RuntimeError("SavedActivations is already active")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)


_unshared_keys = itertools.count()


# The tracker that ``saved_activation_region()`` blocks count into, set by a phase that counts
# saved activations in regions only; None outside such a phase.
region_tracker: ContextVar[SavedActivations | None] = ContextVar("agg_bench_saved_region", default=None)


@contextmanager
def saved_activation_region() -> Iterator[None]:
    """Mark a block whose saved tensors belong to the count of a ``Telemetry.phase(...,
    saved_activations="regions")`` around it (the training loop marks the policy network's
    forward). Outside such a phase, or inside a tracker that is already counting, it does nothing.
    """
    tracker = region_tracker.get()
    if tracker is None or tracker.active:
        yield
        return
    with tracker:
        yield


@contextmanager
def counting_regions(tracker: SavedActivations) -> Iterator[SavedActivations]:
    """Count what ``saved_activation_region()`` blocks save into ``tracker``, as a phase with
    ``saved_activations="regions"`` does (the memory planner counts a forward this way)."""
    token = region_tracker.set(tracker)
    try:
        yield tracker
    finally:
        region_tracker.reset(token)


class WorkingMemory(TorchDispatchMode):
    """Peak bytes of the tensors a region allocates and holds at once, counted exactly: the working memory of
    a computation without autograd (a VAE decode, an optimizer step), where saved-tensor hooks see nothing.

    Accounting rule: every tensor an operator returns inside the region is counted by the size of its
    storage, each storage once however many views share it; a result that shares its storage with an input
    from before the region (an in-place result, a view of a weight) is not counted. A storage leaves the count
    when the last tensor returned for it inside the region is freed. Tensors that
    existed before the region (weights, inputs, optimizer state) are not counted. The count depends only on
    which tensors the operators return, never on an allocator, so it works on fake tensors
    (:class:`torch._subclasses.fake_tensor.FakeTensorMode`, entered before this mode) and is the same on every
    device for the same kernels; a kernel's scratch space that never becomes a tensor (a convolution's
    workspace) is not seen. ``peak_bytes`` is the largest live count; ``live_bytes`` the current one.
    """

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[Any, list[int]] = {}  # storage key -> [tensors alive, bytes]
        self._released: deque[Any] = deque()
        self._live_bytes = 0
        self.peak_bytes = 0

    @property
    def live_bytes(self) -> int:
        self._settle()
        return self._live_bytes

    def _settle(self) -> None:
        # finalizers only queue their key: they can run at any allocation, inside _track too
        while self._released:
            key = self._released.popleft()
            entry = self._refs.get(key)
            if entry is not None:
                entry[0] -= 1
                if entry[0] == 0:
                    self._live_bytes -= entry[1]
                    del self._refs[key]

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        self._settle()
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [1, storage.nbytes()]
            self._live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self._live_bytes)
        else:
            entry[0] += 1
        weakref.finalize(tensor, self._released.append, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # an in-place result, or a view of a tensor from before the region, holds no memory of its own
        inputs = {t.untyped_storage()._cdata for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and (leaf.untyped_storage()._cdata not in inputs
                                                   or leaf.untyped_storage()._cdata in self._refs):
                self._track(leaf)
        return out
