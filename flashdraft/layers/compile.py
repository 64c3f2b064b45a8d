"""torch.compile for a layer class: one compiled graph per input shape serves every layer of the class."""


def compile_layer_forward(forward, backend="inductor"):
    """torch.compile a layer class's forward, called as `compiled(layer, *args)`: parameters become graph inputs,
    so one compiled graph per input shape serves every layer of the class (no recompile per layer). Callers use it
    only for the fixed widths that CUDA graphs capture; the attended length (a step's bucket: the mask's width and
    the rows read) is left to dynamo's automatic dynamic shapes, so the first bucket compiles a static graph and
    the second one graph that serves every other bucket, where static shapes compiled (and on a warm start traced
    again) one graph per bucket: 0.84 s per captured step of the Gemma 4 31B shape (H100, 2026-12-06). A width
    of 1 stays specialised (dynamo never makes a size-1 dimension dynamic)."""
    import torch
    import torch._dynamo

    from flashdraft.kernels import pdl
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(forward, dynamic=None, backend=backend,
                         options=pdl.compile_options() if backend == "inductor" else None)


def preload_compiler() -> "threading.Thread":
    """Import torch.compile's modules and start inductor's compile workers in a background thread, to overlap
    with reading the weights (2.4 s between the weights and the first capture of the Gemma 4 31B shape on an H100,
    2026-12-06). Join it before the first compile."""
    import threading

    def load() -> None:
        import torch._dynamo  # noqa: F401
        from torch._inductor.async_compile import AsyncCompile
        AsyncCompile.warm_pool()

    thread = threading.Thread(target=load, name="import-compiler", daemon=True)
    thread.start()
    return thread
