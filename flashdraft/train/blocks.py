"""The DFlash training objective (dflash.md section 4.2): random anchors, block inputs, the block attention
mask, one draft forward over every block of a batch, and the decayed cross-entropy through the frozen head.

Keys of a sequence are [context (S positions) | block 0 | ... | block A-1]; queries are the A*B block slots.
A query in block j sees context position t iff t < p_j (strictly: the anchor's own features are not
available at inference), every slot of its own block, and nothing of other blocks; an invalid block sees
nothing. Slot k of block j is labelled with the token at p_j + k (same position, not shifted); slot 0, the
anchor, carries no loss; slot k >= 1 weighs exp(-(k-1)/gamma).

DFlash2 drafts (speculators' `dflash2`) run their convolutions over each block's rows in the same forward, and
are trained as speculators trains them: KL to the target's next-token distribution plus the candidate selector's
cross-entropy (`dflash2_loss`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from flashdraft.draft import DFlashDraft
from flashdraft.layers.attention import masked_attention, position_mask


@dataclass
class Batch:
    input_ids: Tensor  # [N, S] right-padded
    loss_mask: Tensor  # [N, S] bool, False on padding
    lengths: Tensor  # [N]


@dataclass
class Blocks:
    anchors: Tensor  # [N, A] sorted anchor positions; 0 for invalid blocks (which sit after the valid ones)
    valid: Tensor  # [N, A] bool


def collate(records: list[tuple[list[int], list[int]]], pad_id: int = 0) -> Batch:
    width = max(len(ids) for ids, _ in records)
    ids = torch.full((len(records), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(records), width), dtype=torch.bool)
    for i, (row, loss) in enumerate(records):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(loss)] = torch.tensor(loss, dtype=torch.bool)
    return Batch(ids, mask, torch.tensor([len(r) for r, _ in records]))


def anchor_candidates(loss_mask: Tensor, lengths: Tensor, block_size: int) -> Tensor:
    """[N, S] bool: p <= len - B, and both p and p + 1 are response tokens."""
    s = loss_mask.shape[1]
    pos = torch.arange(s, device=loss_mask.device)
    following = torch.cat([loss_mask[:, 1:], torch.zeros_like(loss_mask[:, :1])], dim=1)
    return loss_mask & following & (pos[None, :] <= lengths[:, None] - block_size)


def sample_anchors(loss_mask: Tensor, lengths: Tensor, num_anchors: int, block_size: int,
                   generator: torch.Generator | None = None) -> Blocks:
    """Up to `num_anchors` distinct anchors per sequence, uniform over the candidates, sorted; fresh each call."""
    candidates = anchor_candidates(loss_mask, lengths, block_size).cpu()
    n, s = candidates.shape
    count = max(1, min(num_anchors, s))
    scores = torch.rand((n, s), generator=generator).masked_fill(~candidates, -1.0)
    top = scores.topk(count, dim=1)
    valid = top.values >= 0
    anchors = torch.where(valid, top.indices, s).sort(dim=1).values  # invalid ones sort last
    valid = anchors < s
    keep = max(1, int(valid.sum(1).max()))  # no column of blocks that are invalid in every sequence
    anchors, valid = anchors[:, :keep].masked_fill(~valid[:, :keep], 0), valid[:, :keep]
    device = loss_mask.device
    return Blocks(anchors.to(device), valid.to(device))


def all_anchors(loss_mask: Tensor, lengths: Tensor, block_size: int, limit: int) -> Blocks:
    """Every candidate anchor (the first `limit` per sequence), for evaluation."""
    candidates = anchor_candidates(loss_mask, lengths, block_size)
    s = candidates.shape[1]
    count = max(1, min(limit, int(candidates.sum(1).max())))
    pos = torch.arange(s, device=candidates.device).expand_as(candidates)
    keyed = torch.where(candidates, pos, s).sort(dim=1).values[:, :count]
    valid = keyed < s
    return Blocks(keyed.masked_fill(~valid, 0), valid)


def block_mask(blocks: Blocks, context_len: int, block_size: int) -> Tensor:
    """The recipe's mask, [N, A*B, S + A*B] bool (True = attend)."""
    n, a = blocks.anchors.shape
    device = blocks.anchors.device
    query_block = torch.arange(a * block_size, device=device) // block_size
    anchor_of_query = blocks.anchors[:, query_block]  # [N, Q]
    valid_query = blocks.valid[:, query_block]  # [N, Q]
    context = torch.arange(context_len, device=device)[None, None, :] < anchor_of_query[:, :, None]
    same_block = (query_block[:, None] == query_block[None, :])[None]
    return torch.cat([context, same_block.expand(n, -1, -1)], dim=2) & valid_query[:, :, None]


def apply_layer_rules(mask: Tensor, query_pos: Tensor, key_pos: Tensor, is_causal: bool,
                      sliding_window: int | None) -> Tensor:
    """A sliding / causal layer's extra rules by absolute position (the same as the draft's inference mask)."""
    if not is_causal and sliding_window is None:
        return mask
    return mask & position_mask(query_pos, key_pos, is_causal, sliding_window)


def sdpa_safe(mask: Tensor, context_len: int) -> Tensor:
    """Let a query that sees nothing (an invalid block) see its own key: SDPA gives NaN for an empty row,
    and nothing attends to an invalid block's keys, so this changes no valid output."""
    empty = ~mask.any(dim=-1)  # [N, Q]
    if not bool(empty.any()):
        return mask
    q = mask.shape[1]
    own = torch.zeros_like(mask)
    index = torch.arange(q, device=mask.device)
    own[:, index, context_len + index] = True
    return mask | (own & empty[:, :, None])


@dataclass
class BlockInputs:
    block_ids: Tensor  # [N, A, B]: anchor token then mask tokens (all mask for invalid blocks)
    positions: Tensor  # [N, A, B]
    labels: Tensor  # [N, A, B]
    weights: Tensor  # [N, A, B] float: decay * validity * loss mask; 0 for slot 0


def block_inputs(batch: Batch, blocks: Blocks, block_size: int, mask_token_id: int, gamma: float) -> BlockInputs:
    s = batch.input_ids.shape[1]
    offsets = torch.arange(block_size, device=blocks.anchors.device)
    positions = blocks.anchors[:, :, None] + offsets  # [N, A, B]
    flat = positions.clamp(max=s - 1).flatten(1)
    labels = batch.input_ids.gather(1, flat).view_as(positions)
    in_range = (positions < batch.lengths[:, None, None]) & blocks.valid[:, :, None]
    label_ok = batch.loss_mask.gather(1, flat).view_as(positions) & in_range
    decay = torch.exp(-(offsets.float() - 1).clamp(min=0) / gamma)
    decay[0] = 0.0
    weights = decay * label_ok.float()
    block_ids = torch.full_like(positions, mask_token_id)
    anchor_ids = batch.input_ids.gather(1, blocks.anchors)
    block_ids[:, :, 0] = torch.where(blocks.valid, anchor_ids, mask_token_id)
    return BlockInputs(block_ids, positions, labels, weights)


def draft_blocks_forward(draft: DFlashDraft, features: Tensor, noise: Tensor, positions: Tensor,
                         masks: dict[tuple[bool, int | None], Tensor]) -> Tensor:
    """features [N, S, L*H], noise [N, Q, H] (embedded block tokens), positions [N, Q], masks by layer kind
    [N, Q, S + Q] -> hidden [N, Q, H] after the final norm. The same computation as the draft's
    `forward_with_context`, for every block of the batch at once."""
    s = features.shape[1]
    x = noise.to(draft.fc.weight.dtype)
    context = draft.fuse(features)
    cos_sin = draft.rotary(positions, x.dtype)[:, None]  # [N, 1, Q, 2, D]: broadcast over heads
    context_cos_sin = draft.rotary(torch.arange(s, device=positions.device), x.dtype)
    block_size = draft.cfg.block_size
    for i, layer in enumerate(draft.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        if layer.convolved:  # DFlash2: the layer's own convolutions, over the rows of each block
            changes = layer.attention_conv.changes(h)
            h = _block_conv(layer.attention_conv, h, changes, 0, block_size)
        query, block_k, block_v = attn.project_qkv(h, cos_sin)
        context_k, context_v = attn.project_kv(context, context_cos_sin)
        keys = torch.cat([context_k, block_k.to(context_k.dtype)], dim=-2)
        values = torch.cat([context_v, block_v.to(context_v.dtype)], dim=-2)
        out = masked_attention(query, keys, values.to(keys.dtype), masks[draft.layer_attention[i]], attn.scale)
        out = attn.o_proj(out)
        if layer.convolved:
            out = _block_conv(layer.attention_conv, out, changes, 1, block_size)
        x = x + out
        h = layer.post_attention_layernorm(x)
        if not layer.convolved:
            x = x + layer.mlp(h)
            continue
        changes = layer.mlp_conv.changes(h)
        out = layer.mlp(_block_conv(layer.mlp_conv, h, changes, 0, block_size))
        x = x + _block_conv(layer.mlp_conv, out, changes, 1, block_size)
    return draft.norm(x)


def _block_conv(conv, x: Tensor, changes: Tensor, side: int, block_size: int) -> Tensor:
    """A `LocalConv` side over [N, A*B, H] rows: each block of B rows convolved on its own."""
    return conv(x.unflatten(1, (-1, block_size)), changes.unflatten(1, (-1, block_size)), side).flatten(1, 2)


def layer_masks(draft: DFlashDraft, blocks: Blocks, positions: Tensor, context_len: int) -> dict:
    """One SDPA-ready mask per distinct (is_causal, sliding_window) layer kind."""
    block_size = positions.shape[1] // blocks.anchors.shape[1]
    base = block_mask(blocks, context_len, block_size)
    context_pos = torch.arange(context_len, device=positions.device).expand(positions.shape[0], -1)
    key_pos = torch.cat([context_pos, positions], dim=1)
    return {kind: sdpa_safe(apply_layer_rules(base, positions, key_pos, *kind), context_len)
            for kind in draft.attention_kinds}


@dataclass
class StepOutput:
    loss: Tensor  # scalar, weighted mean CE (DFlash2: token loss + alpha * selector loss)
    accuracy: float  # top-1 over the supervised slots (DFlash2: the selector's teacher-forced pick)
    acceptance: float  # estimated acceptance length: mean over valid blocks of 1 + accepted prefix
    blocks: int
    tokens: int
    token_loss: Tensor | None = None  # DFlash2: the two terms apart (detached)
    selector_loss: Tensor | None = None


def _chunk_loss(hidden: Tensor, labels: Tensor, weights: Tensor, draft: DFlashDraft, head) -> tuple[Tensor, Tensor]:
    logits = draft.compute_logits(hidden, head).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * weights).sum(), logits.argmax(-1) == labels


def _chunked(fn, parts: tuple, chunk: int, extra: tuple) -> list[tuple]:
    """fn over slices of `parts` (tensors of the same length), recomputed in backward when training, so the
    [tokens, vocab] logits never all live at once."""
    out = []
    for start in range(0, len(parts[0]), chunk):
        piece = tuple(p[start:start + chunk] for p in parts)
        if torch.is_grad_enabled():
            out.append(checkpoint(fn, *piece, *extra, use_reentrant=False))
        else:
            out.append(fn(*piece, *extra))
    return out


def _summary(loss: Tensor, right: Tensor, selected: Tensor, inputs: BlockInputs, blocks: Blocks,
             counted: Tensor | None = None, **terms) -> StepOutput:
    """`right`: each supervised slot drafted its target (acceptance walks these); accuracy is over the slots
    `counted` (default all: DFlash2 counts only slots whose target was among the selector's candidates)."""
    n, a, b = inputs.labels.shape
    grid = torch.zeros(n * a * b, dtype=torch.float32, device=right.device)
    grid[selected] = right.float()
    grid = grid.view(n, a, b)[:, :, 1:]
    accepted = grid.cumprod(dim=-1).sum(-1)[blocks.valid]
    scored = right if counted is None else right[counted]
    return StepOutput(loss=loss, accuracy=float(scored.float().mean()) if len(scored) else 0.0,
                      acceptance=float(1 + accepted.mean()) if accepted.numel() else 1.0,
                      blocks=int(blocks.valid.sum()), tokens=len(selected), **terms)


def block_loss(draft: DFlashDraft, hidden: Tensor, inputs: BlockInputs, blocks: Blocks, head,
               chunk: int = 8192) -> StepOutput:
    """Decayed CE on the supervised slots only, through the frozen head in chunks."""
    n, a, b = inputs.labels.shape
    weights = inputs.weights.flatten()
    selected = (weights > 0).nonzero().squeeze(1)
    h = hidden.reshape(n * a * b, -1)[selected]
    labels, w = inputs.labels.flatten()[selected], weights[selected]
    parts = _chunked(_chunk_loss, (h, labels, w), chunk, (draft, head))
    total = sum((p[0] for p in parts), hidden.new_zeros((), dtype=torch.float32))
    right = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0, dtype=torch.bool, device=hidden.device)
    return _summary(total / w.sum().clamp(min=1e-9), right, selected, inputs, blocks)


def _dflash2_chunk(hidden: Tensor, target_hidden: Tensor, predecessors: Tensor, weights: Tensor,
                   draft: DFlashDraft, head) -> tuple[Tensor, Tensor, Tensor]:
    """Per slot: KL(target || draft) over the vocabulary, and the selector's cross-entropy over its training
    candidates (the draft's top-k, the target's argmax put in place of the k-th when it is not among them),
    scored as `CandidateSelector.walk` scores them with the true token before as the predecessor."""
    logits = draft.compute_logits(hidden, head).float()
    with torch.no_grad():
        target_logits = head(target_hidden).float()
        target_ids = target_logits.argmax(-1)
    kl = F.kl_div(logits.log_softmax(-1), target_logits.log_softmax(-1), reduction="none", log_target=True).sum(-1)
    selector = draft.candidate_selector
    top_k = selector.top_k
    candidates = logits.detach().topk(top_k, dim=-1).indices  # [T, k]
    matches = candidates == target_ids[:, None]
    present = matches.any(-1)
    label = torch.where(present, matches.int().argmax(-1), top_k - 1)
    candidates[:, -1] = torch.where(present, candidates[:, -1], target_ids)
    pair = selector.transition_scores(selector.gates(hidden), predecessors, candidates)
    scores = logits.gather(-1, candidates) + pair.float()
    ce = F.cross_entropy(scores, label, reduction="none")
    picked = candidates.gather(-1, scores.detach().argmax(-1, keepdim=True))[:, 0]
    return (kl * weights).sum(), (ce * weights).sum(), (picked == target_ids) & present, present


def dflash2_loss(draft: DFlashDraft, hidden: Tensor, target_hidden: Tensor, batch: Batch, inputs: BlockInputs,
                 blocks: Blocks, head, selector_alpha: float = 1.0, chunk: int = 8192) -> StepOutput:
    """speculators' DFlash2 objective: token loss KL(target || draft) against the target's own next-token
    distribution (its head over its final-normed states at the position before each slot) plus `selector_alpha`
    times the selector's K-way cross-entropy towards the target's argmax; each decayed by slot as DFlash's
    (`inputs.weights`) and divided by the number of supervised slots (not by the weights' sum)."""
    n, a, b = inputs.labels.shape
    weights = inputs.weights.flatten()
    selected = (weights > 0).nonzero().squeeze(1)
    before = inputs.positions.flatten()[selected] - 1  # slot k >= 1 follows position p + k - 1
    rows = selected // (a * b)
    h = hidden.reshape(n * a * b, -1)[selected]
    parts = _chunked(_dflash2_chunk, (h, target_hidden[rows, before], batch.input_ids[rows, before],
                                      weights[selected]), chunk, (draft, head))
    zero = hidden.new_zeros((), dtype=torch.float32)
    count = len(selected) + 1e-5
    token = sum((p[0] for p in parts), zero) / count
    selector = sum((p[1] for p in parts), zero) / count
    right, present = ((torch.cat([p[i] for p in parts]) for i in (2, 3)) if parts else
                      (torch.zeros(0, dtype=torch.bool, device=hidden.device),) * 2)
    return _summary(token + selector_alpha * selector, right, selected, inputs, blocks, present,
                    token_loss=token.detach(), selector_loss=selector.detach())


def blocks_step(draft: DFlashDraft, target, batch: Batch, features: Tensor, blocks: Blocks, gamma: float,
                loss_chunk: int = 8192, target_hidden: Tensor | None = None,
                selector_alpha: float = 1.0) -> StepOutput:
    """One forward of the objective for a batch whose target features are given (DFlash2: and the target's
    final-normed hidden states [N, S, H], `target_features(..., final=True)`)."""
    cfg = draft.cfg
    b = cfg.block_size
    inputs = block_inputs(batch, blocks, b, cfg.mask_token_id, gamma)
    n, a, _ = inputs.block_ids.shape
    noise = target.token_embedding(inputs.block_ids.view(n, a * b)) * cfg.input_embedding_scale
    positions = inputs.positions.view(n, a * b)
    masks = layer_masks(draft, blocks, positions, batch.input_ids.shape[1])
    hidden = draft_blocks_forward(draft, features, noise, positions, masks)
    if cfg.dflash2:
        if target_hidden is None:
            raise ValueError("a DFlash2 draft's loss needs the target's final hidden states")
        return dflash2_loss(draft, hidden, target_hidden, batch, inputs, blocks, target.logits, selector_alpha,
                            loss_chunk)
    return block_loss(draft, hidden, inputs, blocks, target.logits, loss_chunk)
