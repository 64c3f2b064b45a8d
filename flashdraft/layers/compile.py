"""torch.compile for a layer class: one compiled graph per input shape serves every layer of the class."""


def compile_layer_forward(forward):
    """torch.compile a layer class's forward, called as `compiled(layer, *args)`: parameters become graph inputs,
    so one compiled graph per input shape serves every layer of the class (no recompile per layer). Static
    shapes: callers use it only for the fixed widths that CUDA graphs capture."""
    import torch
    import torch._dynamo

    from flashdraft.kernels import pdl
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(forward, dynamic=False, options=pdl.compile_options())
