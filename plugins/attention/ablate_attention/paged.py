"""attention=paged: decode attention that reads K/V through block tables, in a kernel.

Decode steps (one query per sequence) walk each sequence's block table inside a kernel: on a GPU
ablate_kernels.paged_decode_attention (Triton; it also runs on the CPU under TRITON_INTERPRET=1, for
tests) where it takes the shapes (ablate_attention.flash.unsupported_shape: a head dim that is a
power of two in 16..256, K and V of that same width, fp16/bf16/fp32); on the CPU ablate's native
kernel (ablate.api.native: C compiled here, fp32, a task per sequence, KV head or part of its
blocks). Elsewhere, and for sequences that feed more than one token (prefill, chunks), the PyTorch
path gathers every sequence's blocks through its table into (B, S, H_kv, D) and runs SDPA under the
causal mask. A step that mixes
both (continuous batching with chunked prefill) is run as two parts (StepInputs.part): its one-token
sequences through the decode kernel, the rest through the gather.

backend=auto times, on the first decode step of each kind (ablate_attention.decode_timing: keyed by
device, dtype, heads, head dim, block size, a class of batch size and of context length, threads),
the device's kernel (Triton on a GPU, native on the CPU) against the gather, and runs the faster for
every step of that kind in the process: which one wins differs between machines. Where the CPU has
no native kernel, auto takes Triton under its interpreter (tests), else the gather, untimed.
backend=triton, native and torch force one kernel, never timed; triton and native refuse, when the
plugin is built, a device or a model their kernel cannot take, where auto falls back to the PyTorch
path per call, warning once per reason in the process. The backend that ran is recorded per kind of
step, with the reason when the kernel was passed over and the times when it was chosen by timing.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ablate.api import (Attention, BuildContext, KVView, LayerAttention, PagedKV, PluginConfig, Requirement, Slot, Stat,
                        StepInputs, causal_mask, device_tensor, native, pad_queries, softcapped_attention,
                        unpad_queries)
from ablate_attention import decode_timing
from ablate_attention.flash import unsupported_shape
from ablate_attention.paged_shapes import decode_shape_problem, mla_hint, native_shape_problem
from ablate_attention.sdpa import plain_causal

BACKENDS = ("auto", "triton", "native", "torch")
_warned: set[str] = set()   # fallback reasons already warned about: once per process, not once per arm


@dataclass
class PagedAttentionConfig(PluginConfig):
    name: str = "paged"
    # auto: the faster, timed per kind of decode step, of the device's kernel (Triton on a GPU, native on
    # the CPU) and the PyTorch gather; the gather where no kernel can run (warned once); triton, native:
    # that kernel, refused where it cannot run; torch: always the PyTorch gather
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"attention.backend must be one of {BACKENDS}, got {self.backend!r}")


def gathered_attention(q: torch.Tensor, view: KVView, step: StepInputs,
                       layer: LayerAttention | None = None) -> torch.Tensor:
    """The PyTorch path: gather K/V through the block tables, then masked SDPA (with the layer's
    window; an explicit softmax for soft-capped scores), or is_causal where every sequence is a whole
    prompt of one length (SDPA then skips the blocks above the diagonal). q (T, H, D) -> (T, H, D)."""
    k, v = view.padded(step)                                   # (B, S, H_kv, D): k_cache[block_tables] flattened
    qp = pad_queries(q, step).transpose(1, 2)                  # (B, H, Lq, D)
    if layer is None and not step.graphed and step.memo("sdpa_is_causal", lambda: plain_causal(step)):
        out = F.scaled_dot_product_attention(qp, k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             enable_gqa=True)
        return unpad_queries(out.transpose(1, 2), step)        # (T, H, D)
    window = layer.window if layer is not None else None
    # (B, 1, Lq, S): key j <= query position, j < context; by position in a windowed layer's ring (PaddedKV.ring)
    mask = causal_mask(step, k.shape[1], window, view.ring)[:, None]
    if layer is not None and layer.softcap is not None:
        out = softcapped_attention(qp, k.transpose(1, 2), v.transpose(1, 2), mask, layer.softcap)
    else:
        out = F.scaled_dot_product_attention(qp, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             enable_gqa=True)
    return unpad_queries(out.transpose(1, 2), step)            # (T, H, D)


def one_query_and_rest(step: StepInputs) -> list[tuple[torch.Tensor, StepInputs]] | None:
    """A mixed step's sequences that feed one token and the others, each as (their indices in the step,
    the part of the step they make); None unless the step has both."""
    one = [b for b, n in enumerate(step.query_lens) if n == 1]
    if not one or len(one) == step.num_seqs:
        return None
    rest = [b for b, n in enumerate(step.query_lens) if n != 1]
    device = step.input_ids.device
    return [(device_tensor(seqs, torch.long, device), step.part(seqs)) for seqs in (one, rest)]


def _warn_once(reason: str, message: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(message, stacklevel=3)


class PagedAttention(Attention):
    name = "paged"
    config_class = PagedAttentionConfig
    graph_safe = True     # the decode kernels and the gather read lengths and block tables from tensors
    # in the block-table gather: a layer with a window or soft-capped scores never reaches the kernels
    features = frozenset({"sliding_window", "softcap"})
    reads_key_rings = True   # causal_mask(..., view.ring)
    requires = (Requirement(Slot.KV_CACHE, frozenset({"paged"}), "reads K/V through block tables"),)
    reported_stats = (Stat("backends", "the implementation that ran, per kind of step", "text", "first"),
                      Stat("decode_timings", "decode kernels timed in this arm (backend=auto, once per kind of "
                           "step in a process): the run's time holds them", "count", "max"))

    def __init__(self, config: PagedAttentionConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        import ablate_kernels  # imported here: TRITON_INTERPRET must be set before triton is imported

        self._kernel = ablate_kernels.paged_decode_attention
        device = ctx.device
        runnable = ablate_kernels.triton_available(device)
        native_runs = device.type == "cpu" and native.available()
        if config.backend == "triton":
            if not runnable:   # a bad option, like the shapes below: the job stops with this one message
                raise ValueError(f"attention=paged backend=triton: the Triton kernel cannot run on {device} "
                                 "(it needs a CUDA GPU, or TRITON_INTERPRET=1 set before triton is imported); "
                                 "use attention.backend=auto or torch")
            why = decode_shape_problem(ctx)
            if why is not None:
                raise ValueError(f"attention=paged backend=triton: the paged-decode kernel cannot take model "
                                 f"{ctx.model.config.name!r}: {why}{mla_hint(ctx)}; use attention.backend=auto "
                                 "(the PyTorch block-table gather where the kernel cannot run, recorded as such) "
                                 "or attention.backend=torch")
        if config.backend == "native":
            why = (f"it runs on the CPU, not {device}" if device.type != "cpu" else
                   None if native_runs else native.unavailable_reason())
            why = why or native_shape_problem(ctx)
            if why is not None:
                raise ValueError(f"attention=paged backend=native: the native paged-decode kernel cannot run here: "
                                 f"{why}; use attention.backend=auto or torch")
        # the kernel decode steps take: Triton where it compiles (a GPU), the native one on the CPU
        if config.backend in ("triton", "native", "torch"):
            self.decode_kernel = config.backend
        elif runnable and device.type != "cpu":
            self.decode_kernel = "triton"
        else:
            self.decode_kernel = "native" if native_runs else "triton" if runnable else "torch"
        self.forced = config.backend in ("triton", "native")
        # auto: the device's kernel and the gather, timed per kind of decode step (not the interpreter's Triton)
        timed = config.backend == "auto" and (self.decode_kernel == "native"
                                              or self.decode_kernel == "triton" and device.type != "cpu")
        self.candidates: tuple[str, ...] = (self.decode_kernel, "torch") if timed else ()
        self.chosen: dict[decode_timing.DecodeKey, decode_timing.DecodeChoice] = {}   # the keys this arm met
        self.decode_timings = 0      # timings this arm ran (the first arm of a process to meet a key times it)
        self.kernel = ablate_kernels.backend_label(device)     # triton, or triton-interpreted: never a timing
        if self.decode_kernel == "torch" and config.backend == "auto":
            _warn_once(f"device {device.type}",
                       f"attention=paged: no paged-decode kernel can run on {device} (the Triton one needs a CUDA "
                       "GPU, or TRITON_INTERPRET=1 before triton is imported; the native one the CPU and a C "
                       f"compiler: {native.unavailable_reason()}); decode steps use the PyTorch block-table "
                       "gather instead, recorded as backend 'torch'")
        self.backends: dict[str, str] = {}    # kind of step (decode, prefill) -> implementation that ran
        self._problems: dict[tuple, str | None] = {}    # what _step_problem found, per kind of inputs
        self._decided = f"paged/decode_kernel/{id(self)}"      # a step's memo of the kernel its layers take

    @property
    def backend(self) -> str:
        backends = dict(self.backends)
        if self.chosen:     # decode=native(timed: native 1.2 ms, torch 1.9 ms), with the classes if several
            many = len(self.chosen) > 1
            backends["decode"] = "; ".join(choice.label(key.classes() if many else "")
                                           for key, choice in sorted(self.chosen.items(), key=lambda kv: str(kv[0])))
        ran = ",".join(f"{kind}={impl}" for kind, impl in sorted(backends.items()))
        return f"paged({ran})" if ran else "paged"

    def __call__(self, q: torch.Tensor, view: KVView, step: StepInputs,
                 layer: LayerAttention | None = None) -> torch.Tensor:
        # K/V the model built from the cached rows itself (MLA's explicit path up-projects its latents
        # into a PaddedKV) have no block tables to walk: the generic gather reads any view; nor do the
        # kernels take a window or soft-capped scores: the gather's mask does
        if layer is None and isinstance(view, PagedKV) and self.decode_kernel != "torch":
            if step.is_decode:    # the step's first layer decides for all: a decode step runs 30 of these a token
                kernel = step.memo(self._decided, lambda: self._decode_kernel(q, view, step))
                return self._timed(q, view, step) if kernel is None else self._run(kernel, q, view, step)
            parts = step.memo("paged/one_query_and_rest", lambda: one_query_and_rest(step))
            if parts is not None:
                return self._mixed(q, view, parts)
        kind = "decode" if step.is_decode else "prefill"
        self.backends.setdefault(kind if layer is None else f"{kind}:{'+'.join(sorted(layer.features))}", "torch")
        return gathered_attention(q, view, step, layer)

    def native_paged_decode(self, step: StepInputs) -> bool:
        """Whether this decode step's plain layers run the native kernel, as its first layer decided (or,
        untimed until then, timed): a native layer call may then run it itself (Attention's contract)."""
        kernel = step.memoized(self._decided)
        if kernel is None and (key := step.memoized("paged_decode_key")) is not None:
            choice = decode_timing.choice_for(key)
            kernel = None if choice is None else choice.kernel
        return step.is_decode and kernel == "native"

    def _decode_kernel(self, q: torch.Tensor, view: PagedKV, step: StepInputs) -> str | None:
        """The kernel of a decode step's layers ("torch": the gather); None: not timed yet (_timed times it)."""
        why = self._step_problem(q, view)
        if why is not None and self.forced:    # the build-time check covers the model; this is a surprise
            raise ValueError(f"attention=paged backend={self.decode_kernel}: the paged-decode kernel cannot take "
                             f"this step: {why}; use attention.backend=auto or torch")
        if why is not None:
            self.backends["decode"] = f"torch({why})"
            _warn_once(why, f"attention=paged: {why}, which the {self.decode_kernel} paged-decode kernel does not "
                            "take; decode steps use the PyTorch block-table gather instead, recorded as backend "
                            "'torch(<why>)'")
            return "torch"
        if not self.candidates:
            self.backends["decode"] = self._label(self.decode_kernel)
            return self.decode_kernel
        choice = self._choice(q, view, step)
        return None if choice is None else choice.kernel

    def _choice(self, q: torch.Tensor, view: PagedKV, step: StepInputs) -> decode_timing.DecodeChoice | None:
        """backend=auto: the process's choice for this kind of decode step (now this arm's too), or None."""
        key = step.memo("paged_decode_key", lambda: decode_timing.decode_key(q, view.k_cache, step.kv_lens))
        choice = decode_timing.choice_for(key)
        if choice is not None:
            self.chosen.setdefault(key, choice)
        return choice

    def _mixed(self, q: torch.Tensor, view: PagedKV, parts: list[tuple[torch.Tensor, StepInputs]]) -> torch.Tensor:
        """A step where decoding sequences run beside prompts (continuous batching's mixed steps): the
        one-query sequences through the decode kernel, the rest through the gather, each over its own
        block tables; padding every sequence to the longest query would multiply the decode rows'
        work by it, under a mask SDPA cannot skip. q (T, H, D) -> (T, H, D_v)."""
        out = None
        for seq_index, part in parts:
            rows = part.rows_in_step
            part_out = self(q.index_select(0, rows), PagedKV(view.k_cache, view.v_cache,
                                                             view.block_tables.index_select(0, seq_index)), part)
            if out is None:
                out = part_out.new_empty(q.shape[0], *part_out.shape[1:])         # (T, H, D_v)
            out.index_copy_(0, rows, part_out)
        return out

    def _label(self, kernel: str) -> str:
        return self.kernel if kernel == "triton" else kernel

    def _run(self, kernel: str, q: torch.Tensor, view: PagedKV, step: StepInputs) -> torch.Tensor:
        """A decode step through `kernel`: q (B, H, D), one query per sequence; the keys of sequence b
        at block_tables[b, p // bs], p % bs -> (B, H, D)."""
        if kernel == "native":
            return native.paged_decode_attention(q, view.k_cache, view.v_cache, view.block_tables, step.kv_lens_t,
                                                 torch.get_num_threads())
        if kernel == "triton":
            return self._kernel(q, view.k_cache, view.v_cache, view.block_tables, step.kv_lens_t)
        return gathered_attention(q, view, step)

    def _timed(self, q: torch.Tensor, view: PagedKV, step: StepInputs) -> torch.Tensor:
        """backend=auto: the kernel chosen for this kind of step; the first step of a kind in the process
        times the candidates on its own inputs (decode_timing) and returns the winner's output."""
        choice = self._choice(q, view, step)
        if choice is not None:            # timed since this step's first layer asked
            return self._run(choice.kernel, q, view, step)
        if not decode_timing.can_time(q.device):     # inside a CUDA graph's capture: the default, unrecorded
            self.backends.setdefault("decode", self._label(self.decode_kernel))
            return self._run(self.decode_kernel, q, view, step)
        self.decode_timings += 1
        runs = {name: functools.partial(self._run, name, q, view, step) for name in self.candidates}
        key = step.memo("paged_decode_key", lambda: decode_timing.decode_key(q, view.k_cache, step.kv_lens))
        self.chosen[key], out = decode_timing.time_decode(key, runs, q.device)
        return out

    def _step_problem(self, q: torch.Tensor, view: PagedKV) -> str | None:
        """Why the decode kernel cannot take this step, or None: checked once per kind of inputs (every
        layer of every step has the same, but for the batch size, which no check depends on)."""
        key = (q.shape[1:], q.dtype, view.k_cache.shape, view.v_cache.shape, view.k_cache.dtype)
        if key not in self._problems:
            check = native.paged_decode_problem if self.decode_kernel == "native" else unsupported_shape
            self._problems[key] = check(q, view.k_cache, view.v_cache)
        return self._problems[key]

    def stats(self) -> dict[str, str | int]:
        return {"backends": self.backend, "decode_timings": self.decode_timings}

