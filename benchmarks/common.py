"""Timing helpers every benchmark shares: same process, alternating runs, medians, ratios."""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import random
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def load_line(when: str) -> str:
    """``"load average WHEN: 1m 5m 15m"``: what every table of a shared machine should be read with."""
    return f"load average {when}: " + " ".join(f"{load:.2f}" for load in os.getloadavg())


def alternate(candidates: Mapping[str, Callable[[], object]], repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Time each callable ``repeats`` times, interleaving them, and return the median seconds.

    Interleaving spreads machine noise (other processes, frequency scaling) evenly over every
    candidate, which matters more than the absolute figures on a shared 2-core machine. Each round
    runs the candidates in a new random order (seeded): a call right after another finds that
    one's code and data in the caches, so a fixed order, or one reversed every other round, gave a
    hand-written first step 0.63-0.75x and 1.37-1.46x of an identical copy of itself.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    order, shuffle = list(candidates.items()), random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(order)
        for name, fn in order:
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def build_shuffled(builders: Mapping[str, Callable[[], T]], rng: random.Random) -> tuple[dict[str, T], list[Any]]:
    """Call every builder in a random order, each after an allocation of random size.

    Where a model's weights and optimizer state land in memory shifts a loop's speed by a percent
    or more: two identical hand-written loops built one after the other measured 1.5-2.5% apart,
    always the same way round, over many runs. Building every candidate afresh each round, in a
    random order with random gaps, makes that placement a random effect of the round, which the
    median over rounds averages out, instead of a bias one candidate keeps for the whole session.
    Returns what the builders built, in the mapping's order, and the padding to keep alive until
    the round is over.
    """
    built, padding = {}, []
    for name in rng.sample(list(builders), len(builders)):
        padding.append(torch.empty(rng.randrange(1, 1 << 16), dtype=torch.uint8))
        built[name] = builders[name]()
    return {name: built[name] for name in builders}, padding


def table(title: str, medians: Mapping[str, float], baseline: str) -> str:
    """Format medians as a Markdown table with each ratio against ``baseline``."""
    base = medians[baseline]
    rows = [f"### {title}", "", "| candidate | median (ms) | ratio vs " + baseline + " |", "| --- | ---: | ---: |"]
    rows += [f"| {name} | {value * 1e3:.2f} | {value / base:.3f} |" for name, value in medians.items()]
    return "\n".join(rows)


def ratio_table(title: str, results: Mapping[str, tuple[float, float, float, float]], baseline: str) -> str:
    """Format ``{name: (median seconds, q1, median, q3 of the ratio)}`` as a Markdown table."""
    rows = [
        f"### {title}",
        "",
        f"| candidate | median (ms) | ratio vs {baseline}: median of rounds | interquartile range |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, (seconds, q1, median, q3) in results.items():
        rows.append(f"| {name} | {seconds * 1e3:.2f} | {median:.3f} | {q1:.3f} - {q3:.3f} |")
    return "\n".join(rows)


class Lockstep:
    """Run several training loops batch by batch in turn, timing every batch of every loop.

    On a shared virtual machine the speed of the CPU drifts by tens of percent within seconds,
    so loops timed one after the other see different machines. Here each loop runs in its own
    thread, but only one at a time: a loop wraps its batch iterables with `wrap`, and before each
    batch is fetched the turn passes to the next loop. One turn covers fetching one batch and all
    the work the loop does with it (plus anything it does at the end of a pass), so the loops'
    totals are compared at a granularity of one batch, where the drift cancels.

    Call `run({name: fn})`: `fn(wrap)` runs one loop. Every loop runs in a thread of its own
    (the calling thread only waits), so that all of them run alike. Turns follow the order of
    the mapping: a loop runs faster right after its twin, so callers should vary that order
    between runs. Returns the seconds each loop spent in its own turns.

    `batches_per_turn=None` hands the turn on only when a pass starts: a turn is then one whole
    pass (and the work after it), long enough that each loop runs with caches it warmed itself,
    short enough that the drift between neighbouring turns stays small.
    """

    def __init__(self, batches_per_turn: int | None = 1) -> None:
        self.batches_per_turn = batches_per_turn
        self._condition = threading.Condition()
        self._order: list[str] = []
        self._turn = 0
        self._started = 0.0
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, iterable: Any) -> Any:
        """`iterable`, handing the turn on before each item is fetched."""

        every = self.batches_per_turn

        def generate() -> Any:
            iterator = iter(iterable)
            fetched = 0
            while True:
                if fetched == 0 or (every is not None and fetched % every == 0):
                    self._pass_turn(name)
                try:
                    item = next(iterator)
                except StopIteration:
                    return  # keep the turn: the loop's end-of-pass work is part of it
                fetched += 1
                yield item

        return generate()

    def run(self, loops: Mapping[str, Callable]) -> dict[str, float]:
        self._order = list(loops)
        self.seconds = dict.fromkeys(self._order, 0.0)
        self._turn, self._started = 0, time.perf_counter()
        threads = [threading.Thread(target=self._thread, args=item, daemon=True) for item in loops.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return self.seconds

    def _thread(self, name: str, fn: Callable) -> None:
        with self._condition:
            self._condition.wait_for(lambda: self._order[self._turn] == name)
            self._started = time.perf_counter()
        self._loop(name, fn)

    def _loop(self, name: str, fn: Callable) -> None:
        try:
            fn(lambda iterable: self.wrap(name, iterable))
        finally:
            with self._condition:
                self.seconds[name] += time.perf_counter() - self._started
                index = self._order.index(name)
                self._order.pop(index)
                if self._order:
                    self._turn = index % len(self._order)
                    self._started = time.perf_counter()
                self._condition.notify_all()

    def _pass_turn(self, name: str) -> None:
        with self._condition:
            self.seconds[name] += time.perf_counter() - self._started
            self._turn = (self._order.index(name) + 1) % len(self._order)
            self._condition.notify_all()
            self._condition.wait_for(lambda: self._order[self._turn] == name)
            self._started = time.perf_counter()


def fsync_file(path: str) -> None:
    """Flush `path` to disk, as the managers' durable writes do for their files."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def profile_call(call: Callable[[], object], title: str, lines: int) -> str:
    """cProfile of one `call()`: the top `lines` entries by cumulative time, under a `## title` heading."""
    prof = cProfile.Profile()
    prof.enable()
    call()
    prof.disable()
    out = io.StringIO()
    out.write(f"\n## {title}\n")
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(lines)
    return out.getvalue()


# Instructions of one region of a child process, counted by callgrind. The child runs under
# `valgrind --tool=callgrind --instr-atstart=no` (imports and set-up run uninstrumented, several
# times faster) and switches instrumentation on and off around the region through callgrind's
# client requests, which only C can issue: a two-function library, compiled once per run.
_CALLGRIND_HELPER = """
#include <valgrind/callgrind.h>
void danling_bench_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void danling_bench_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
"""
CALLGRIND_LIBRARY = "DANLING_BENCH_CALLGRIND"
"""Environment variable naming the compiled helper in a child that `count_region` runs."""


def callgrind_helper(directory: str) -> str:
    """Compile the start/stop helper into `directory` and return its path.

    Raises:
        RuntimeError: valgrind, its headers or a C compiler is missing (naming which).
    """
    import shutil

    if shutil.which("valgrind") is None:
        raise RuntimeError("counting instructions needs 'valgrind' on PATH")
    return _compile_library(directory, "callgrind_helper", _CALLGRIND_HELPER, "counting instructions")


def _compile_library(directory: str, name: str, source: str, purpose: str) -> str:
    """Compile C `source` into `directory`/`name`.so with the system's `cc`; its path."""
    import shutil
    import subprocess

    if shutil.which("cc") is None:
        raise RuntimeError(f"{purpose} needs 'cc' on PATH")
    path, library = os.path.join(directory, name + ".c"), os.path.join(directory, name + ".so")
    with open(path, "w") as file:
        file.write(source)
    done = subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", library, path], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {name} for {purpose} failed (headers missing?):\n{done.stderr}")
    return library


class counted_region:
    """In a child run by `count_region`, instructions are collected inside this block only (no-op elsewhere)."""

    def __enter__(self) -> None:
        library = os.environ.get(CALLGRIND_LIBRARY)
        if library:
            import ctypes

            helper = ctypes.CDLL(library)
            # Both symbols are looked up before counting starts: a first attribute access on a
            # CDLL builds the function object (thousands of instructions), which is not the region's.
            self.stop = helper.danling_bench_stop
            helper.danling_bench_start()
        else:
            self.stop = None

    def __exit__(self, *exc: object) -> None:
        if self.stop is not None:
            self.stop()


def count_region(command: list[str], library: str, env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Run `command` (a Python child using `counted_region`) under callgrind: its region's instructions and stdout."""
    import re
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        # PYTHONHASHSEED: the same dict and set orders in every run, so the count repeats.
        environment = {**(env or os.environ), CALLGRIND_LIBRARY: library, "PYTHONHASHSEED": "0"}
        valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
        valgrind.append(f"--callgrind-out-file={os.path.join(directory, 'out')}")
        done = subprocess.run([*valgrind, *command], capture_output=True, text=True, env=environment, check=False)
    match = re.search(r"Collected\s*:\s*([\d,]+)", done.stderr)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"callgrind run of {command} failed:\n{done.stderr[-2000:]}")
    return int(match.group(1).replace(",", "")), done.stdout


# Bytes held by live heap allocations, counted by a preloaded library that wraps glibc's
# allocator: the peak of what the code under test holds, whatever the allocator keeps resident
# afterwards. Resident memory (`VmHWM`) also counts freed blocks glibc has not handed back, whose
# amount depends on what the process freed before (its mmap threshold rises with each large free)
# and moves by a few hundred KiB between fresh processes: at 0.4 MiB of data that is the figure.
# Every allocation goes through malloc in a counted child (`PYTHONMALLOC=malloc`: Python's own
# arenas too), torch's CPU tensors (posix_memalign) and numpy's arrays included.
# Anonymous memory maps made through libc's `mmap` (Python's `mmap` module) count at their length.
_HEAP_COUNTER = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stddef.h>
extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);
static long long live, peak;
static void add(long long bytes) {
    long long now = __atomic_add_fetch(&live, bytes, __ATOMIC_RELAXED);
    long long top = __atomic_load_n(&peak, __ATOMIC_RELAXED);
    while (now > top && !__atomic_compare_exchange_n(&peak, &top, now, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
}
static void held(void *p) {
    if (p) add((long long)malloc_usable_size(p));
}
static void released(void *p) {
    if (p) __atomic_sub_fetch(&live, (long long)malloc_usable_size(p), __ATOMIC_RELAXED);
}
void *malloc(size_t n) { void *p = __libc_malloc(n); held(p); return p; }
void *calloc(size_t k, size_t n) { void *p = __libc_calloc(k, n); held(p); return p; }
void free(void *p) { released(p); __libc_free(p); }
void *realloc(void *old, size_t n) {
    size_t before = old ? malloc_usable_size(old) : 0;
    void *p = __libc_realloc(old, n);
    if (p || n == 0) {  /* a failed realloc leaves the old block held */
        __atomic_sub_fetch(&live, (long long)before, __ATOMIC_RELAXED);
        held(p);
    }
    return p;
}
void *memalign(size_t a, size_t n) { void *p = __libc_memalign(a, n); held(p); return p; }
void *aligned_alloc(size_t a, size_t n) { return memalign(a, n); }
int posix_memalign(void **out, size_t a, size_t n) {
    void *p = memalign(a, n);
    if (!p) return ENOMEM;
    *out = p;
    return 0;
}
/* Anonymous memory maps (Python's `mmap.mmap(-1, n)`, which danling's binary metric store grows
   with mremap) are counted at their mapped length: an upper bound of what they hold, since pages
   never touched are not resident. glibc's own maps for large blocks are not seen here (it calls
   the system directly), and need not be: those blocks are counted as malloc'd above. */
#include <dlfcn.h>
#include <stdarg.h>
#include <sys/mman.h>
#include <sys/types.h>
#define SLOTS 4096
static void *map_at[SLOTS];
static size_t map_length[SLOTS];
static char map_lock;
static void lock(void) { while (__atomic_test_and_set(&map_lock, __ATOMIC_ACQUIRE)) {} }
static void unlock(void) { __atomic_clear(&map_lock, __ATOMIC_RELEASE); }
static size_t forget(void *at) {  /* the counted length of the map at `at`, no longer counted; 0 if none */
    size_t length = 0;
    lock();
    for (int i = 0; i < SLOTS; i++) {
        if (map_at[i] == at && map_length[i]) {
            length = map_length[i];
            map_length[i] = 0;
            map_at[i] = 0;
            break;
        }
    }
    unlock();
    return length;
}
static void remember(void *at, size_t length) {
    lock();
    for (int i = 0; i < SLOTS; i++) {
        if (!map_length[i]) {
            map_at[i] = at;
            map_length[i] = length;
            unlock();
            add((long long)length);
            return;
        }
    }
    unlock();  /* table full: left uncounted */
}
static void *mapped(void *p, size_t length, int flags, int fd) {
    if (p != MAP_FAILED && (flags & MAP_ANONYMOUS) && fd == -1) remember(p, length);
    return p;
}
void *mmap(void *at, size_t length, int prot, int flags, int fd, off_t offset) {
    static void *(*next)(void *, size_t, int, int, int, off_t);
    if (!next) next = (void *(*)(void *, size_t, int, int, int, off_t))dlsym(RTLD_NEXT, "mmap");
    return mapped(next(at, length, prot, flags, fd, offset), length, flags, fd);
}
void *mmap64(void *at, size_t length, int prot, int flags, int fd, off_t offset) {  /* large-file builds call this */
    static void *(*next)(void *, size_t, int, int, int, off_t);
    if (!next) next = (void *(*)(void *, size_t, int, int, int, off_t))dlsym(RTLD_NEXT, "mmap64");
    return mapped(next(at, length, prot, flags, fd, offset), length, flags, fd);
}
int munmap(void *at, size_t length) {
    static int (*next)(void *, size_t);
    if (!next) next = (int (*)(void *, size_t))dlsym(RTLD_NEXT, "munmap");
    size_t counted = forget(at);
    int done = next(at, length);
    if (counted) add(-(long long)counted);
    return done;
}
void *mremap(void *old, size_t old_length, size_t length, int flags, ...) {
    static void *(*next)(void *, size_t, size_t, int, ...);
    if (!next) next = (void *(*)(void *, size_t, size_t, int, ...))dlsym(RTLD_NEXT, "mremap");
    void *fixed = NULL;
    if (flags & MREMAP_FIXED) { va_list rest; va_start(rest, flags); fixed = va_arg(rest, void *); va_end(rest); }
    void *p = next(old, old_length, length, flags, fixed);
    if (p != MAP_FAILED) {
        size_t counted = forget(old);
        if (counted) { add(-(long long)counted); remember(p, length); }
    }
    return p;
}
long long danling_heap_live(void) { return __atomic_load_n(&live, __ATOMIC_RELAXED); }
long long danling_heap_peak(void) { return __atomic_load_n(&peak, __ATOMIC_RELAXED); }
void danling_heap_reset(void) { __atomic_store_n(&peak, __atomic_load_n(&live, __ATOMIC_RELAXED), __ATOMIC_RELAXED); }
"""
HEAP_LIBRARY = "DANLING_BENCH_HEAP"
"""Environment variable naming the preloaded heap counter in a child that `heap_environment` built."""


def heap_counter(directory: str) -> str:
    """Compile the heap counter into `directory` and return its path.

    Raises:
        RuntimeError: no C compiler, or the build failed (naming why).
    """
    return _compile_library(directory, "heap_counter", _HEAP_COUNTER, "counting heap bytes")


def heap_environment(library: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) for a child whose every allocation `library` counts."""
    environment = dict(env or os.environ)
    preload = environment.get("LD_PRELOAD")
    environment["LD_PRELOAD"] = f"{library} {preload}" if preload else library
    environment["PYTHONMALLOC"] = "malloc"  # small Python objects through malloc too, not arenas of their own
    environment[HEAP_LIBRARY] = library
    return environment


class heap_region:
    """Peak bytes of live heap allocations inside this block above those live at its start.

    `peak_bytes` is set on exit; it stays `None` in a process not started with
    `heap_environment` (nothing is counted there). Regions do not nest: entering one resets the
    process's one peak, which an enclosing region would then read from.
    """

    def __enter__(self) -> heap_region:
        self.peak_bytes: int | None = None
        self._read_peak = None  # the counter's peak reader, in a counted child only
        library = os.environ.get(HEAP_LIBRARY)
        if library:
            import ctypes

            counter = ctypes.CDLL(library)
            for name in ("danling_heap_live", "danling_heap_peak"):
                getattr(counter, name).restype = ctypes.c_longlong
            # Functions looked up before the reset: building them allocates, which is not the block's.
            live, self._read_peak = counter.danling_heap_live, counter.danling_heap_peak
            reset = counter.danling_heap_reset
            reset()
            self._start = live()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._read_peak is not None:
            self.peak_bytes = self._read_peak() - self._start
