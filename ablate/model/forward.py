"""The slots one forward pass goes through: each layer stores its K/V in the cache, reads the layer's
view back and attends over it. Failures inside a plugin, and views or outputs of the wrong shape,
are reported as PluginError naming the plugin and the method; shapes are checked on the first layer
(every layer of a step has the same).

The calls are wrapped in plain try blocks rather than ablate.api.blame: they run three times a layer
on every step, where a try costs nothing, and a ValueError raised there is a plugin's bug to name,
not an option it reports."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ablate.api.kv import KVView, PagedPlaces, view_problem
from ablate.api.kv_cache import KVCache
from ablate.api.packing import LayerAttention
from ablate.api.plugin import PluginError
from ablate.api.slots import Attention
from ablate.api.step import StepInputs
from ablate.model.linear import products_stay_eager
from ablate.model.moe import experts_stay_eager


@functools.cache
def compiled(fn: Callable) -> Callable:
    """`fn` through torch.compile, once per function: every layer and arm shares the compiled code
    (parameters are inputs, not constants), and dynamic shapes spare a recompile per batch size.
    The matrix products stay eager (ablate/model/linear.py; moe.py's grouped ones). torch._dynamo is
    imported on the first call, not with this module: it costs seconds, and imports triton."""
    products_stay_eager()
    experts_stay_eager()
    return torch.compile(fn, dynamic=True)


@dataclass
class Forward:
    step: StepInputs
    kv_cache: KVCache
    attention: Attention
    checked_layer: int = 0      # the layer whose view and output shapes are checked
    compile: bool = False       # the layers' dense arithmetic through torch.compile (engine.graphs on a CPU)
    moe_experts: str = "loop"   # how a mixture of experts computes its experts (engine.moe_experts: ablate/model/moe.py)
    native_layers: int = 0      # layers that ran as native calls (ablate/model/native/layers.py)
    one_call_layers: int = 0    # of those, layers whose cache write and attention ran inside one call

    def dense(self, fn, *args):
        """fn(*args): a layer's arithmetic between the slots (projections, norms, MLP), compiled when
        asked (engine.graphs on a CPU: one compiled function shared by every layer and arm)."""
        return compiled(fn)(*args) if self.compile else fn(*args)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVView:
        """Write this step's k (T, H_kv, D_k), v (T, H_kv, D_v) of `layer`; return the layer's view."""
        cache = self.kv_cache
        try:
            cache.write(layer, self.step, k, v)
        except PluginError:
            raise
        except (Exception, SystemExit) as err:    # sys.exit in a plugin fails its arm only
            raise PluginError(cache, "write", f"layer {layer}: {type(err).__name__}: {err}") from err
        try:
            view = cache.view(layer, self.step)
        except PluginError:
            raise
        except (Exception, SystemExit) as err:    # sys.exit in a plugin fails its arm only
            raise PluginError(cache, "view", f"layer {layer}: {type(err).__name__}: {err}") from err
        if layer == self.checked_layer:
            problem = view_problem(view, self.step, cache.spec)
            if problem:
                raise PluginError(cache, "view", f"layer {layer}: {problem}")
        return view

    def attend(self, layer: int, q: torch.Tensor, view: KVView, features: LayerAttention | None = None) -> torch.Tensor:
        """attention(q (T, H, D), view) -> (T, H, D_v), checked. A layer with a sliding window or
        soft-capped scores passes its LayerAttention, which only a plugin declaring those features is
        given (the arm's build refused the others: Attention.missing_features)."""
        try:
            if features is None:
                out = self.attention(q, view, self.step)
            else:
                out = self.attention(q, view, self.step, features)
        except PluginError:
            raise
        except (Exception, SystemExit) as err:    # sys.exit in a plugin fails its arm only
            raise PluginError(self.attention, "__call__", f"layer {layer}: {type(err).__name__}: {err}") from err
        if layer == self.checked_layer and (out.shape[:2] != q.shape[:2] or out.dtype != q.dtype):
            raise PluginError(self.attention, "__call__", f"returned {tuple(out.shape)} {out.dtype} for queries "
                              f"{tuple(q.shape)} {q.dtype}: expected (T, H, D_v) in the queries' dtype")
        return out

    def paged_places(self) -> PagedPlaces | None:
        """Where every layer's K/V rows of this decode step go and are read (KVCache.paged_slots), where the
        arm's attention runs the native paged kernel for the step (Attention.native_paged_decode): a
        native layer may then write and read them itself. None: every layer calls the slots. Asked by a
        layer after one that called the attention (ablate/model/native_plan.py)."""
        if not _asked(self.attention, "native_paged_decode", self.step):
            return None
        return _asked(self.kv_cache, "paged_slots", self.step)


def _asked(plugin, method: str, *args):
    """plugin.method(*args), a failure inside it reported as the plugin's (PluginError)."""
    try:
        return getattr(plugin, method)(*args)
    except PluginError:
        raise
    except (Exception, SystemExit) as err:    # sys.exit in a plugin fails its arm only
        raise PluginError(plugin, method, f"{type(err).__name__}: {err}") from err
