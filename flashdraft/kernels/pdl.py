"""Programmatic dependent launch (Hopper and newer GPUs).

A decode step is some 700 kernels of a few microseconds each, and a kernel launched the plain way starts only
after the one before it has finished and its writes are flushed: a gap per launch, and every kernel's ramp-up
and tail on its own. A kernel launched with `launch(...)`'s options may be placed on the GPU as soon as every
program of the kernel before it has called `start_dependents` (or finished), so it can read what no earlier kernel
writes (the weights) while that kernel finishes, and waits (`wait_for_inputs`) before it reads activations or
writes anything. The wait is a no-op when the kernel was launched the plain way, and off the GPU (interpreter, CPU)
or before Hopper none of this is compiled in.

Every kernel here waits before it starts its dependents. torch.compile's own kernels are launched the same way
(`compile_options`), and they read early whatever the kernel just before them did not write: safe only if, when a
kernel is placed, every kernel but the one just before it has finished, which holds once each kernel passes its
wait (all before it done) before letting the next be placed.
"""
import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: plain launches
    gdc_launch_dependents = gdc_wait = None

ENABLED = gdc_wait is not None and os.environ.get("FLASHDRAFT_PDL", "1") != "0"
INDUCTOR = True  # torch.compile's kernels too (compile_options); off only to compare


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def launch(t: torch.Tensor) -> dict:
    """Keyword arguments for a kernel launch on t's device: the kernel's PDL constexpr and Triton's launch_pdl."""
    on = (ENABLED and t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
          and _hopper(t.device.index if t.device.index is not None else torch.cuda.current_device()))
    return dict(PDL=on, launch_pdl=True) if on else dict(PDL=False)


@triton.jit
def start_dependents(PDL: tl.constexpr):
    """Let the next kernel's programs be placed once all of this kernel's have started."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the kernels before this one have finished and their writes are visible."""
    if PDL:
        gdc_wait()


def compile_options() -> dict:
    """torch.compile's options for the layers: its fused kernels launched with PDL too where ours are (inductor's
    triton.enable_pdl; it leaves them plain before Hopper, and torch builds without the option get none)."""
    import torch._inductor.config as inductor_config
    return {"triton.enable_pdl": True} if ENABLED and INDUCTOR and hasattr(inductor_config.triton, "enable_pdl") else {}
