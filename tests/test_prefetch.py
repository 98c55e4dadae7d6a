"""The prefetch thread and the buffer pool: order, errors, and the memory they may hold."""

from __future__ import annotations

import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import fork_mid_stream, same_bits
from safetensors.torch import save_file

import lazyckpt
from lazyckpt import alloc, prefetch
from lazyckpt.prefetch import prefetched

MB = 1 << 20


class _Live:
    """Bytes of buffers alive right now, and the most ever, seen through finalizers (the
    test's own count, independent of the prefetcher's)."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.lock = threading.Lock()

    def track(self, tensor: torch.Tensor) -> None:
        n = tensor.numel() * tensor.element_size()
        with self.lock:
            self.now += n
            self.peak = max(self.peak, self.now)
        weakref.finalize(alloc.owner(tensor), self._free, n)

    def _free(self, n: int) -> None:
        with self.lock:
            self.now -= n


def _run(sizes: list[int], budget: int, *, keep: bool) -> tuple[_Live, list[int]]:
    live = _Live()

    def build(size: int) -> torch.Tensor:
        t = alloc.empty((size,), torch.uint8)
        t.fill_(size % 251)
        live.track(t)
        return t

    got: list[int] = []
    kept = []
    for t in prefetched(
        sizes,
        build,
        nbytes=lambda s: s,
        inline=lambda s: False,
        budget=budget,
        watch=alloc.owner,
    ):
        got.append(t.numel())
        assert int(t[0]) == t.numel() % 251
        if keep:
            kept.append(t)
        del t
    return live, got


@pytest.mark.parametrize(
    "sizes",
    [
        [40 * MB, 3 * MB, 3 * MB, 40 * MB, 2 * MB, 2 * MB, 30 * MB, 30 * MB],
        [2 * MB] * 24,
        [64 * MB, 64 * MB, 4 * MB],
    ],
    ids=["mixed", "small", "large-neighbours"],
)
def test_memory_held_stays_below_largest_plus_budget(sizes: list[int]) -> None:
    budget = 8 * MB
    live, got = _run(sizes, budget, keep=False)
    assert got == sizes
    # The caller drops each tensor before asking for the next: what is alive at once is at
    # most one tensor beyond the budget.
    assert live.peak <= max(sizes) + budget, (live.peak / MB, sizes)


def test_a_caller_that_keeps_everything_still_gets_everything() -> None:
    sizes = [4 * MB] * 12
    live, got = _run(sizes, 8 * MB, keep=True)
    assert got == sizes
    assert live.peak == sum(sizes)  # all kept, none built twice


def test_errors_arrive_at_their_item_and_inline_items_keep_their_place() -> None:
    def build(i: int) -> int:
        if i == 5:
            raise RuntimeError("item 5 is bad")
        return i

    out = []
    stream = prefetched(
        list(range(8)), build, nbytes=lambda i: 1, inline=lambda i: i % 2 == 0, budget=4
    )
    with pytest.raises(RuntimeError, match="item 5"):
        for i in stream:
            out.append(i)
    assert out == [0, 1, 2, 3, 4]


def test_lazy_load_with_and_without_prefetch_agree(tmp_path: Path) -> None:
    # Over lazyckpt.loader._WORKER_MIN_BYTES a tensor (TP-2: 300 KiB and more), so that the
    # copies are built on the worker; smaller keys are built by the caller.
    sd = {f"layer{i}": torch.randn(300 + i, 512) for i in range(12)}
    save_file(sd, tmp_path / "m.safetensors")
    results = []
    for budget in (0, 64 * 1024, 32 * MB):
        for dtype in (None, torch.float16):  # views, then copies
            opts = lazyckpt.ModelCheckpointLoadOptions(
                prefetch_bytes=budget, dtype=dtype, layout=lazyckpt.Layout(tp_size=2, tp_rank=1)
            )
            stream = lazyckpt.get_model_checkpoint_loader().lazy_load(
                tmp_path / "m.safetensors", {k: 1 for k in sd}, opts
            )
            results.append({k: v.clone() for k, v in stream})
    for got in results:
        assert list(got) == list(results[0]) and set(got) == set(sd)
    for a, b in zip(results[0::2], results[2::2]):
        assert all(same_bits(a[k], b[k]) for k in sd)
    for a, b in zip(results[1::2], results[3::2]):
        assert all(same_bits(a[k], b[k]) for k in sd)


def test_buffer_pool_reuses_freed_mappings_within_its_capacity() -> None:
    pool = alloc.BufferPool(capacity=20 * MB)
    a = pool.empty((4 * MB,), torch.uint8)
    a.fill_(7)
    address = a.data_ptr()
    del a
    assert pool.free_bytes == 4 * MB  # given back when the tensor went
    b = pool.empty((3 * MB,), torch.uint16)  # 6 MiB: does not fit the free 4 MiB mapping
    assert b.data_ptr() != address
    c = pool.empty((3 * MB,), torch.uint8)  # fits it
    assert c.data_ptr() == address and pool.free_bytes == 0
    view = c[10:]
    del c
    assert pool.free_bytes == 0  # a view keeps the lease
    del view
    assert pool.free_bytes == 4 * MB
    # Leased 6 MiB + free 4 MiB + 12 MiB new would pass 20 MiB: the free mapping is unmapped.
    d = pool.empty((12 * MB,), torch.uint8)
    assert pool.free_bytes == 0
    del b  # leased 12 + free 0 + 6 <= 20: kept
    assert pool.free_bytes == 6 * MB
    e = pool.empty((14 * MB,), torch.uint8)  # the caller holds d: past capacity, still served
    del d, e  # 26 MiB given back into a 20 MiB pool: what fits is kept
    assert pool.free_bytes <= 20 * MB
    pool.close()
    assert pool.free_bytes == 0
    assert pool.empty((1 * MB,), torch.uint8).numel() == MB  # small: a plain tensor


def test_the_loader_keeps_no_yielded_tensor_alive(tmp_path: Path) -> None:
    # Casts make copies: each yielded tensor is a pool buffer that only the caller may hold.
    sd = {f"k{i}": torch.randn(1024, 1024) for i in range(6)}
    save_file(sd, tmp_path / "m.safetensors")
    opts = lazyckpt.ModelCheckpointLoadOptions(dtype=torch.float16, prefetch_bytes=8 * MB)
    leases: list[weakref.ref[object]] = []
    for key, t in lazyckpt.get_model_checkpoint_loader().lazy_load(
        tmp_path / "m.safetensors", {}, opts
    ):
        assert same_bits(t, sd[key].to(torch.float16))
        owner = alloc.owner(t)
        assert owner is not None
        leases.append(weakref.ref(owner))
        del t, owner
        assert all(ref() is None for ref in leases[:-1]), "an earlier tensor is still alive"
    assert len(leases) == len(sd) and all(ref() is None for ref in leases)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork()")
@pytest.mark.parametrize(
    "options",
    [
        None,  # copies built on the prefetch worker
        lazyckpt.ModelCheckpointLoadOptions(),  # views, made by the caller
        lazyckpt.ModelCheckpointLoadOptions(dtype=torch.float16, prefetch_bytes=0),
    ],
    ids=["worker", "views", "no-prefetch"],
)
def test_a_stream_continued_in_a_forked_child_raises_instead_of_waiting_for_good(
    tmp_path: Path, options: lazyckpt.ModelCheckpointLoadOptions | None
) -> None:
    # The prefetch worker does not come along with fork(): the child's next() waited for it
    # for good. A stream without one is refused as well, so that whether a child may go on
    # does not depend on its keys' dtypes and sizes. The parent's stream goes on.
    def go_on(stream: Iterator[tuple[str, torch.Tensor]]) -> int:  # 0 only on the RuntimeError
        try:
            next(stream)
        except RuntimeError as exc:
            return 0 if "forked" in str(exc) else 2
        except BaseException:
            return 4
        return 3

    assert fork_mid_stream(tmp_path, go_on, options) == 0


@pytest.mark.parametrize(("rows", "worker"), [(16, False), (1024, True)])
def test_only_keys_of_many_bytes_are_built_on_the_worker(
    tmp_path: Path, rows: int, worker: bool
) -> None:
    # A small key's build is Python more than copying: on the worker it took the GIL from the
    # consumer at each of its torch calls (many-key checkpoints ran several times slower).
    sd = {f"w{i}": torch.randn(rows, 256) for i in range(6)}  # 16 KiB or 1 MiB a key
    save_file(sd, tmp_path / "m.safetensors")
    # Copies, not views; a budget of two keys ahead keeps a worker waiting for the consumer.
    options = lazyckpt.ModelCheckpointLoadOptions(dtype=torch.float16, prefetch_bytes=2 << 20)
    seen = []
    for key, t in lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.safetensors", {}, options):
        seen.append(any(th.name == "lazyckpt-prefetch" for th in threading.enumerate()))
        assert torch.equal(t, sd[key].half())
    assert len(seen) == len(sd)
    assert any(seen) == worker


def test_an_item_built_after_the_stream_closed_on_the_worker_is_not_kept() -> None:
    """The collector may close a stream dropped in a reference cycle on the worker, in the
    middle of a build: the stream's ``finally`` runs there and empties the built items, then
    the build ends. Stored after that, the item stayed for good (its watch's finalizer keeps
    the prefetcher's state, which kept the item): a tensor, or an error's frames and what they
    held."""
    taken = threading.Event()
    stream: dict[str, object] = {}
    late: list[weakref.ref[torch.Tensor]] = []

    def build(i: int) -> torch.Tensor:
        t = torch.full((4,), float(i))
        if i == 1:
            assert taken.wait(10)
            stream["it"].close()  # type: ignore[attr-defined]  # what the collector would run
            late.append(weakref.ref(t))
        return t

    items = prefetched(
        range(3), build, nbytes=lambda i: 16, inline=lambda i: False, budget=1 << 20,
        watch=lambda t: t,
    )
    stream["it"] = items
    assert next(items)[0] == 0
    taken.set()  # the stream is suspended at its yield: closing it runs its finally here
    for thread in threading.enumerate():
        if thread.name == "lazyckpt-prefetch":
            thread.join(10)
    del stream["it"], items
    assert late and late[0]() is None


def test_a_stream_closed_on_the_worker_as_it_starts_to_wait_does_not_keep_it_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Condition.wait`` allocates its waiter's lock before listing it, after the worker has
    checked ``stop``: a collection there may close a stream dropped in a reference cycle, on
    the worker. Its ``finally`` then notifies nobody, and the worker used to wait for good,
    holding the stream's build (plans, reader, buffers)."""
    stream: dict[str, object] = {}
    armed = threading.Event()
    closed = threading.Event()

    class ClosedAtWait(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            on_worker = threading.current_thread().name == "lazyckpt-prefetch"
            if on_worker and armed.is_set() and not closed.is_set():
                closed.set()
                stream["it"].close()  # type: ignore[attr-defined]  # what the collector would run
            return super().wait(timeout)

    monkeypatch.setattr(prefetch, "_condition", lambda: ClosedAtWait(threading.RLock()))
    before = set(threading.enumerate())

    def build(i: int) -> torch.Tensor:
        if i == 1:
            assert armed.wait(10)
        return torch.full((4,), float(i))

    # A budget of two items: with item 1 built and not taken, the worker waits before item 2,
    # while the stream is suspended at its yield of item 0.
    items = prefetched(range(4), build, nbytes=lambda i: 16, inline=lambda i: False, budget=32)
    stream["it"] = items
    assert next(items)[0] == 0
    (worker,) = (t for t in threading.enumerate() if t not in before)
    armed.set()
    worker.join(30)
    assert closed.is_set()
    assert not worker.is_alive()


_SUSPENDED_AT_EXIT = """
import sys, torch, lazyckpt
stream = lazyckpt.get_model_checkpoint_loader().lazy_load(
    sys.argv[1], {}, lazyckpt.ModelCheckpointLoadOptions(dtype=torch.float16))
key, t = next(stream)  # the worker builds the next casts; the stream is never closed
print(key, flush=True)
"""


def test_a_stream_left_suspended_at_exit_lets_the_process_exit(tmp_path: Path) -> None:
    # Its worker, a daemon thread inside a torch call as Python finalized, was ended with
    # pthread_exit through torch's C++ frames: std::terminate, exit status 134, nearly always.
    path = tmp_path / "m.safetensors"
    save_file({f"k{i}": torch.randn(512, 1024) for i in range(8)}, path)
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", _SUSPENDED_AT_EXIT, str(path)], capture_output=True, text=True
        )
        assert done.returncode == 0 and done.stdout == "k0\n", (done.returncode, done.stderr)
