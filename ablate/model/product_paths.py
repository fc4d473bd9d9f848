"""The path each CPU matrix product takes, as one object: PRODUCT_PATHS, a ProductPaths.

A product of Linear (ablate/model/linear.py) on the CPU runs on one of four paths: MKL through
F.linear, oneDNN on a weight packed into its blocked layout, numpy's BLAS (one-row steps lent to it:
ablate/model/numpy_blas.py) or ablate's native matrix-vector kernel (up to 16 fp32 or bf16 rows:
ablate/model/native/). Which one is a choice per kind of product, keyed by (d_out, d_in, dtype, row
class, torch threads), made by the first product of that kind: timed (linear.py) unless forced; and
the layout the weights of a shape are held in (row-major or input-major), settled with the first
streamed kind of that shape. The object holds every piece of that state:

- the choices made so far, listed for the results by `choices()` (environment.json's `linear_paths`);
- how one-row steps run, per (dtype, threads): lent to numpy's BLAS, on torch's paths, or on the
  native kernel with the layers as native calls (ONE_ROW_WAYS), and the threads lent during a numpy
  step (`one_row_step`, around each step of the engine);
- what is forced: `force()` (the config's `cpu_products`; benchmarks/decode_profile.py per row class);
- `timings`, the count of timings so far (each run's `path_timings` column);
- the Linear layers alive, the population a timing runs over;
- the native kernels' library (`native`: its state in the listing; `without_native()`).

`reset()` forgets every choice; `snapshot()` and `restore()` keep and bring back the whole state.
"""
from __future__ import annotations

import bisect
import contextlib
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ablate.model import native, numpy_blas

MKL, ONEDNN, NUMPY, NATIVE = "mkl", "onednn", "numpy", "native"
PATHS = (MKL, ONEDNN, NUMPY, NATIVE)
TORCH_PATHS = (MKL, ONEDNN, NATIVE)          # what one product can run on inside torch's thread pool
SETTINGS = ("auto", *PATHS)                  # the config's cpu_products
ROW_CLASSES = (1, 16, 128)                   # upper bounds: 1 row, 2-16, 17-128, more
STREAMED_CLASS = 1                           # row classes up to this one (<= 16 rows) are bound by reading W
ONE_ROW_PATHS = (NUMPY,)                     # paths of one-row products only
STREAMED_PATHS = (NATIVE,)                   # paths of products of up to 16 rows only
ROW_MAJOR, INPUT_MAJOR = "row-major", "input-major"   # how a weight is held: W, or W^T, contiguous
# how a one-row step runs its products: lent to numpy's BLAS; each on torch's fastest path for its shape;
# or every one on the native kernel, the layers' dense arithmetic in native calls around them
# (ablate/model/native/layers.py), timed as such (path_timing.choose_one_row)
ONE_ROW_WAYS = (NUMPY, "torch", "native layers")


def row_class(rows: int) -> int:
    """The class of a product's row count whose path is chosen on its own: an index into ROW_CLASSES
    (one past its end for more rows). A bisection: this runs for every product of every step."""
    return bisect.bisect_left(ROW_CLASSES, rows)


def row_class_name(index: int) -> str:
    """'1', '2-16', '17-128', '129+'."""
    low = 1 if index == 0 else ROW_CLASSES[index - 1] + 1
    if index == len(ROW_CLASSES):
        return f"{low}+"
    high = ROW_CLASSES[index]
    return str(high) if low == high else f"{low}-{high}"


ROW_CLASS_NAMES = tuple(row_class_name(i) for i in range(len(ROW_CLASSES) + 1))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Snapshot:
    """The whole state of a ProductPaths at one moment (ProductPaths.snapshot)."""
    paths: dict
    layouts: dict
    one_row: dict
    forced: dict
    setting: str
    layers: weakref.WeakSet


class ProductPaths:
    """Which path each kind of CPU product takes in this process (see the module docstring)."""

    def __init__(self) -> None:
        self._paths: dict[tuple, str] = {}                  # (d_out, d_in, dtype, row class, threads) -> path
        self._layouts: dict[tuple, str] = {}                # (d_out, d_in, dtype) -> ROW_MAJOR | INPUT_MAJOR
        self._one_row: dict[tuple[torch.dtype, int], str] = {}    # (dtype, threads) -> how one-row steps run (ONE_ROW_WAYS)
        self._forced: dict[int, str] = {}                   # row class -> the path forced for it
        self._setting = "auto"                              # what force() was given, as the results say it
        self._timings = 0
        self._layers: weakref.WeakSet = weakref.WeakSet()
        self.lent: int | None = None                        # torch's threads while a one-row step lends them
        self.generation = 0    # bumped by every change (changed()): the native plans are made again
        self.native = native.LIBRARY

    # -- the public API ------------------------------------------------------------------------------

    def choices(self) -> dict[str, str]:
        """The paths chosen in this process, for the results: "d_out x d_in dtype R rows threads" ->
        path, "d_out x d_in dtype weights" -> the layout they are held in, "one-row steps dtype threads"
        -> how those steps run (ONE_ROW_WAYS), the native kernels' state (built, not asked for, or why
        they are unavailable) and what was forced (cpu_products)."""
        paths = {f"{o}x{i} {_name(dtype)} {row_class_name(rows)} rows {threads} threads": path
                 for (o, i, dtype, rows, threads), path in sorted(self._paths.items(), key=str)}
        layouts = {f"{o}x{i} {_name(dtype)} weights": layout
                   for (o, i, dtype), layout in sorted(self._layouts.items(), key=str)}
        steps = {f"one-row steps {_name(dtype)} {threads} threads": way
                 for (dtype, threads), way in sorted(self._one_row.items(), key=str)}
        return paths | layouts | steps | {"native kernels": self.native.state(), "cpu_products": self._setting}

    @property
    def setting(self) -> str:
        """What is forced, as the results record it: "auto", a path, or "1 rows: numpy, 2-16 rows: mkl"."""
        return self._setting

    def force(self, how: str | Mapping[str, str] | None) -> None:
        """Force products onto a path: `how` is "auto" (or None: every kind timed), a path (every row
        class it takes: numpy one row, native up to 16, the others all), or {row class name: path}
        ({"1": "native", "2-16": "onednn"}; classes not named are timed). A forced path takes the
        products it can run (oneDNN: a dtype it packs; native: fp32 and bf16; numpy: fp32 one-row
        steps); the others are timed as under auto. The choices the change affects are forgotten. A
        ValueError names what is wrong: an unknown path or row class, or one that cannot run here."""
        forced, setting = self._parse(how)
        for path in sorted(set(forced.values())):
            if (why := self._unavailable(path)) is not None:
                raise ValueError(f"cpu_products={setting}: {path} cannot run here: {why}")
        self._set(forced, setting)

    @contextlib.contextmanager
    def forced(self, how: str | Mapping[str, str] | None):
        """force(how) for the block; what was forced before comes back after (a job of a sweep)."""
        before, setting = dict(self._forced), self._setting
        self.force(how)
        try:
            yield self
        finally:
            self._set(before, setting)

    def reset(self, layers: bool = False) -> None:
        """Forget every choice and what is forced: the next products are timed again, as in a fresh
        process. With `layers`, also stop timing over the layers alive now (a test's timings then run
        over the layers it makes only). The count of timings runs on."""
        self._paths.clear()
        self._layouts.clear()
        self._one_row.clear()
        self._forced, self._setting = {}, "auto"
        self.changed()
        if layers:
            self._layers = weakref.WeakSet()

    @property
    def timings(self) -> int:
        """Product-path timings run so far in this process: a run that times one has the timing in its time."""
        return self._timings

    def snapshot(self) -> Snapshot:
        """The choices, what is forced and the layers timed over, to restore() later."""
        return Snapshot(dict(self._paths), dict(self._layouts), dict(self._one_row), dict(self._forced), self._setting,
                        weakref.WeakSet(self._layers))

    def restore(self, saved: Snapshot) -> None:
        self._paths, self._layouts, self._one_row = dict(saved.paths), dict(saved.layouts), dict(saved.one_row)
        self._forced, self._setting = dict(saved.forced), saved.setting
        self._layers = weakref.WeakSet(saved.layers)
        self.changed()

    def without_native(self, reason: str):    # a block with the native kernels off, as where none can be built
        return self.native.switched_off(reason)

    # -- for ablate/model/linear.py ------------------------------------------------------------------

    def changed(self) -> None:
        """Count a change of the paths, the layouts (a weight laid out anew) or what is forced."""
        self.generation += 1

    def path_for(self, key: tuple) -> str | None:
        """The path chosen for products of `key` (d_out, d_in, dtype, row class, threads), or None yet."""
        return self._paths.get(key)

    def keep(self, key: tuple, path: str) -> None:
        self._paths[key] = path
        self.changed()

    def layout_for(self, shape: tuple) -> str | None:
        """The layout the weights of `shape` (d_out, d_in, dtype) are held in, or None: not settled yet."""
        return self._layouts.get(shape)

    def keep_layout(self, shape: tuple, layout: str) -> None:
        self._layouts[shape] = layout
        self.changed()

    def uses(self, shape: tuple, path: str) -> bool:
        """Whether a kind of product of `shape` (d_out, d_in, dtype) has `path` chosen."""
        return any(key[:3] == shape and chosen == path for key, chosen in self._paths.items())

    def forced_path(self, rows_class: int) -> str | None:
        return self._forced.get(rows_class)

    def keep_one_row(self, dtype: torch.dtype, threads: int, way: str) -> None:
        """How one-row steps of this dtype and thread count run: one of ONE_ROW_WAYS."""
        self._one_row[dtype, threads] = way

    def one_row_known(self, dtype: torch.dtype, threads: int) -> bool:
        """Whether the one-row steps' path is settled: forced, or timed already (else linear.py times it)."""
        return 0 in self._forced or (dtype, threads) in self._one_row

    def lends_one_row(self, dtype: torch.dtype, threads: int) -> bool:
        """Whether one-row steps of this dtype and thread count lend their products to numpy's BLAS."""
        forced = self._forced.get(0)
        if forced is not None:
            return forced == NUMPY and dtype == torch.float32
        return self._one_row.get((dtype, threads)) == NUMPY

    def timed(self) -> None:                # one timing of the paths more
        self._timings += 1

    def add_layer(self, layer) -> None:
        self._layers.add(layer)

    def layers(self) -> list:
        """Every Linear alive (made since the last reset(layers=True))."""
        return list(self._layers)

    @contextlib.contextmanager
    def one_row_step(self, rows: int, weight: torch.Tensor):
        """A step of `rows` product rows through a model holding `weight` (its dtype and device): lent to
        numpy's BLAS when the rows are one and numpy was chosen for them. numpy's BLAS then runs on as
        many threads as torch had, and torch's own operations on the calling thread: two busy pools on
        the same cores would take turns badly (ablate/model/numpy_blas.py)."""
        threads = torch.get_num_threads()
        if (rows != 1 or self.lent is not None or weight.device.type != "cpu"
                or not self.lends_one_row(weight.dtype, threads)):
            yield
            return
        numpy_blas.blas_threads(threads)
        if 0 in self._forced:
            self._one_row[weight.dtype, threads] = NUMPY        # for the listing: no timing recorded it
        self.lent = threads
        try:
            with numpy_blas.torch_threads(1):
                yield
        finally:
            self.lent = None

    # -- inside ------------------------------------------------------------------------------------

    def _parse(self, how: str | Mapping[str, str] | None) -> tuple[dict[int, str], str]:
        """(row class -> path, the setting as recorded) from what force() was given."""
        if how is None or how == "auto":
            return {}, "auto"
        if isinstance(how, str):
            if how not in PATHS:
                raise ValueError(f"cpu_products must be one of {', '.join(SETTINGS)}, got {how!r}")
            classes = ([0] if how in ONE_ROW_PATHS else range(STREAMED_CLASS + 1) if how in STREAMED_PATHS
                       else range(len(ROW_CLASS_NAMES)))
            return {c: how for c in classes}, how
        if not isinstance(how, Mapping):
            raise ValueError(f"cpu_products must be one of {', '.join(SETTINGS)}, got {how!r}")
        forced = {}
        for name, path in how.items():
            if name not in ROW_CLASS_NAMES:
                raise ValueError(f"no row class {name!r}: the row classes are {', '.join(ROW_CLASS_NAMES)}")
            if path not in PATHS:
                raise ValueError(f"row class {name}: no path {path!r}; the paths are {', '.join(PATHS)}")
            if path in ONE_ROW_PATHS and name != ROW_CLASS_NAMES[0]:
                raise ValueError(f"row class {name}: {path} takes one-row products only (row class 1)")
            if path in STREAMED_PATHS and ROW_CLASS_NAMES.index(name) > STREAMED_CLASS:
                raise ValueError(f"row class {name}: {path} takes products of up to {ROW_CLASSES[STREAMED_CLASS]} "
                                 f"rows only (row classes {', '.join(ROW_CLASS_NAMES[:STREAMED_CLASS + 1])})")
            forced[ROW_CLASS_NAMES.index(name)] = path
        setting = ", ".join(f"{ROW_CLASS_NAMES[c]} rows: {p}" for c, p in sorted(forced.items())) or "auto"
        return forced, setting

    def _unavailable(self, path: str) -> str | None:
        """Why `path` cannot run in this process at all, or None."""
        if path == ONEDNN and not torch.backends.mkldnn.is_available():
            return "this torch has no oneDNN (mkldnn)"
        if path == NATIVE:
            return None if native.available() else f"no native kernels ({native.unavailable_reason()})"
        if path == NUMPY:
            return numpy_blas.unavailable_reason(torch.get_num_threads())
        return None

    def _set(self, forced: dict[int, str], setting: str) -> None:
        """Forget the choices a change of what is forced affects, then force. A class whose forcing
        changes loses its choices, except one-row choices among torch's paths (timed under auto and
        under forced numpy alike) when numpy's forcing alone changes; its one-row step choice goes."""
        for c in {c for c in set(self._forced) | set(forced) if self._forced.get(c) != forced.get(c)}:
            torch_forced = {self._forced.get(c), forced.get(c)} & set(TORCH_PATHS)
            if c != 0 or torch_forced or forced.get(c) is None:
                self._paths = {k: v for k, v in self._paths.items() if k[3] != c}
            if c == 0:
                self._one_row.clear()
        self._forced, self._setting = dict(forced), setting
        self.changed()


PRODUCT_PATHS = ProductPaths()
one_row_step = PRODUCT_PATHS.one_row_step      # for the engine's runner: around each step's forward pass
