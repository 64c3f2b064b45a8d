"""Tensor parallelism of the target over the ranks of the default torch.distributed group (Megatron's split,
as gpt-fast's tp.py): each rank holds its share of the attention heads (query heads with the KV heads they
read) and of the MLP's intermediate columns, so a decoder layer needs one all-reduce after `o_proj` and one
after `down_proj`. `lm_head` is split by vocabulary rows and the logits are all-gathered; the embedding,
the norms and the DFlash draft are replicated. Rank r's share of a matrix is its r-th contiguous chunk.
"""
import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor



def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def local_config(cfg, world_size: int):
    """The shapes one rank computes with: its heads, KV heads and intermediate columns."""
    if world_size == 1:
        return cfg
    sizes = {"attention heads": cfg.num_heads, "KV heads": cfg.num_kv_heads,
             "intermediate size": cfg.intermediate_size}
    bad = [f"{name} {n}" for name, n in sizes.items() if n % world_size]
    if bad:
        raise ValueError(f"tensor parallelism over {world_size} ranks needs the model's {', '.join(bad)} "
                         f"to be divisible by {world_size}")
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world_size, num_kv_heads=cfg.num_kv_heads // world_size,
                               intermediate_size=cfg.intermediate_size // world_size)


def padded_vocab(vocab_size: int, world_size: int) -> int:
    """lm_head rows, padded with zero rows to split evenly (the padding's logits are cut off after the gather)."""
    return -(-vocab_size // world_size) * world_size


def shard_tensor(name: str, tensor: Tensor, vocab_size: int, rank: int, world_size: int,
                 row_split: tuple[str, ...], column_split: tuple[str, ...]) -> Tensor:
    """Rank `rank`'s part of the HF-named target tensor `name` (a copy; the tensor itself when not split).
    row_split: modules split by output features (heads or columns); column_split: by input features (their
    sums are what the all-reduce adds up). A family's registry entry names them."""
    if world_size == 1:
        return tensor
    module, kind = name.split(".")[-2:]
    if module in row_split:
        return tensor.chunk(world_size, dim=0)[rank].clone()
    if module in column_split:
        if kind == "bias":  # added once: rank 0 keeps it, the others add zeros
            return tensor.clone() if rank == 0 else torch.zeros_like(tensor)
        return tensor.chunk(world_size, dim=1)[rank].clone()
    if module == "lm_head":
        rows = padded_vocab(vocab_size, world_size) // world_size
        part = tensor[rank * rows:(rank + 1) * rows]
        return torch.cat([part, part.new_zeros(rows - len(part), *part.shape[1:])])
    return tensor


def sum_over_ranks(x: Tensor) -> Tensor:
    dist.all_reduce(x)
    return x


def gather_vocab(logits: Tensor, vocab_size: int) -> Tensor:
    """[..., V/world] logits of each rank's vocabulary rows -> the full [..., V] on every rank."""
    world_size, lead, rows = dist.get_world_size(), logits.shape[:-1], logits.shape[-1]
    tokens = logits[..., 0].numel()
    parts = logits.new_empty(world_size * tokens, rows)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the name before torch 2.13
    gather(parts, logits.reshape(tokens, rows).contiguous())
    full = parts.view(world_size, tokens, rows).transpose(0, 1).reshape(tokens, -1)[:, :vocab_size]
    return full.reshape(*lead, -1)
