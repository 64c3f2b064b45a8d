"""Target features for training: the target's own forward over right-padded sequences, with no state.

Plain causal attention keeps padding out of every real position. Only the layers up to the deepest captured
one run (all of them when the final hidden states are asked for too).
"""
from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def target_features(target, input_ids: Tensor, layer_ids: list[int], final: bool = False):
    """input_ids [N, S] (right-padded) -> concatenated outputs of decoder layers `layer_ids` [N, S, L*H],
    in that order (layer id i = HF hidden_states[i + 1]), as the target's forward captures them.
    `final`: also the final-normed last hidden states [N, S, H] (what the target's head reads), as a pair."""
    n, s = input_ids.shape
    positions = torch.arange(s, device=input_ids.device).expand(n, s)
    if not final:
        _, features = target(input_ids, positions, capture=layer_ids, fresh=True, last_layer=max(layer_ids))
        return features
    last = target.cfg.num_layers - 1
    _, captured = target(input_ids, positions, capture=[*layer_ids, last], fresh=True, last_layer=last)
    hidden = captured.shape[-1] // (len(layer_ids) + 1)
    return captured[..., :-hidden], target.model.norm(captured[..., -hidden:])
