"""An independent oracle for the Qwen3.5 MTP drafter: a tiny random HF `qwen3_5_text` folder that also holds the
MTP block (mtp.*, one layer, HF's names), a plain-PyTorch reference of the MTP chain written from the
architecture's description (not from the drafter's code), checks of that reference against transformers' own
Qwen3.5 modules (norm, gated attention layer, and the whole chain as one causal sequence through an HF decoder
layer), and the drafter's greedy proposals against the reference.

The MTP step for the pair (h, t) at position p: x = fc([norm_emb(embed(t)) | norm_hidden(h)]), one gated
full-attention decoder layer at p over the layer's own K/V of positions <= p, h' = mtp.norm(x), logits =
lm_head(h'). For a committed t_0..t_n the context rows are (zeros, t_0) at 0 and (hidden[i-1], t_i) at i; the
proposals after the anchor t_n: (hidden[n-1], t_n) at n, then (h'_j, d_j) at n + j."""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny import write_tokenizer

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("this transformers has no qwen3_5", allow_module_level=True)
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen35  # noqa: E402

VOCAB = 320
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=8, max_position_embeddings=1024, rms_norm_eps=1e-6,
              eos_token_id=2, tie_word_embeddings=False,
              # half of each head rotates (8 of 16 dims), a small theta so that positions differ visibly
              rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
STD = 0.2  # matrices and trunk parameters
NORM_STD = 0.1  # MTP norm weights, around 0: the norms scale by (1 + w)
K = 3


# ---------------------------------------------------------------------------------------------------- the folder
def make_qwen35_mtp_folder(tmp_path, seed: int = 0, **overrides) -> Path:
    """A tiny random HF qwen3_5_text checkpoint (config.json, model.safetensors, tokenizer files) whose
    safetensors also hold an MTP block of one layer under HF's names (config `mtp_num_hidden_layers: 1`), all
    float32. `overrides`: config fields (e.g. tie_word_embeddings=True)."""
    from safetensors.torch import load_file, save_file
    cfg = {**CONFIG, **overrides}
    folder = Path(tmp_path) / f"qwen3_5_mtp_seed{seed}{'_tied' if cfg['tie_word_embeddings'] else ''}"
    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, cfg["vocab_size"])
    hf_cfg = transformers.AutoConfig.for_model("qwen3_5_text", **cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, STD)
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")

    H, I, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    g = torch.Generator().manual_seed(10_000 + seed)
    shapes = {"mtp.fc.weight": (H, 2 * H),
              "mtp.pre_fc_norm_embedding.weight": (H,), "mtp.pre_fc_norm_hidden.weight": (H,),
              "mtp.norm.weight": (H,),
              "mtp.layers.0.input_layernorm.weight": (H,), "mtp.layers.0.post_attention_layernorm.weight": (H,),
              "mtp.layers.0.self_attn.q_proj.weight": (nh * D * 2, H),
              "mtp.layers.0.self_attn.k_proj.weight": (nkv * D, H),
              "mtp.layers.0.self_attn.v_proj.weight": (nkv * D, H),
              "mtp.layers.0.self_attn.o_proj.weight": (H, nh * D),
              "mtp.layers.0.self_attn.q_norm.weight": (D,), "mtp.layers.0.self_attn.k_norm.weight": (D,),
              "mtp.layers.0.mlp.gate_proj.weight": (I, H), "mtp.layers.0.mlp.up_proj.weight": (I, H),
              "mtp.layers.0.mlp.down_proj.weight": (H, I)}
    mtp = {name: torch.randn(shape, generator=g) * (NORM_STD if len(shape) == 1 else STD)
           for name, shape in shapes.items()}
    save_file(tensors | mtp, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 1}, indent=2))
    return folder


def read_folder(folder: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file
    return load_file(folder / "model.safetensors"), json.loads((folder / "config.json").read_text())


def hf_model(folder: Path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None
    return hf


def hf_hidden(hf, tokens: torch.Tensor) -> torch.Tensor:
    """The target's hidden states after its final norm, [T, H] (transformers' last_hidden_state)."""
    with torch.no_grad():
        return hf.model(tokens[None]).last_hidden_state[0]


# ------------------------------------------------------------------------------------------------- the reference
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm, in float32: x * rsqrt(mean(x^2) + eps) * (1 + w)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())


def rope_params(cfg: dict) -> tuple[float, float]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 1e7))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    return float(theta), float(factor)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rotary: int, theta: float) -> torch.Tensor:
    """x [T, heads, D] at positions [T]: rotate_half RoPE on the first `rotary` dims of each head."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    angles = positions.double()[:, None] * inv_freq  # [T, rotary / 2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).float()[:, None]  # [T, 1, rotary]
    sin = torch.cat([angles.sin(), angles.sin()], -1).float()[:, None]
    rot, rest = x[..., :rotary], x[..., rotary:]
    x1, x2 = rot[..., :rotary // 2], rot[..., rotary // 2:]
    rotated = torch.cat([-x2, x1], -1)
    return torch.cat([rot * cos + rotated * sin, rest], -1)


def empty_context(cfg: dict) -> dict:
    nkv, D = cfg["num_key_value_heads"], cfg["head_dim"]
    return dict(k=torch.zeros(0, nkv, D), v=torch.zeros(0, nkv, D), pos=torch.zeros(0, dtype=torch.long))


def gated_attention_layer(w: dict, prefix: str, cfg: dict, x: torch.Tensor, positions: torch.Tensor,
                          context: dict) -> tuple[torch.Tensor, dict]:
    """One Qwen3.5 gated full-attention decoder layer (weights w[prefix + ...]) on rows x [T, H] at positions
    [T], attending causally (by position) over the context's K/V and the rows' own; returns (the layer's output
    [T, H], the context with the rows' K/V added)."""
    eps, nh, nkv, D = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta, factor = rope_params(cfg)
    rotary = int(D * factor)
    T = x.shape[0]
    a = rms_norm(x, w[prefix + "input_layernorm.weight"], eps)
    q_gate = F.linear(a, w[prefix + "self_attn.q_proj.weight"]).view(T, nh, 2 * D)
    q, gate = q_gate[..., :D], q_gate[..., D:].reshape(T, nh * D)
    q = rms_norm(q, w[prefix + "self_attn.q_norm.weight"], eps)
    k = rms_norm(F.linear(a, w[prefix + "self_attn.k_proj.weight"]).view(T, nkv, D),
                 w[prefix + "self_attn.k_norm.weight"], eps)
    v = F.linear(a, w[prefix + "self_attn.v_proj.weight"]).view(T, nkv, D)
    q, k = apply_rope(q, positions, rotary, theta), apply_rope(k, positions, rotary, theta)
    context = dict(k=torch.cat([context["k"], k]), v=torch.cat([context["v"], v]),
                   pos=torch.cat([context["pos"], positions]))
    group = nh // nkv
    keys = context["k"].repeat_interleave(group, dim=1)  # [S, nh, D]: query head h reads kv head h // group
    values = context["v"].repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, keys) * D ** -0.5
    visible = context["pos"][None, :] <= positions[:, None]  # [T, S]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), values).reshape(T, nh * D)
    x = x + F.linear(attn * torch.sigmoid(gate), w[prefix + "self_attn.o_proj.weight"])
    m = rms_norm(x, w[prefix + "post_attention_layernorm.weight"], eps)
    act = F.silu(F.linear(m, w[prefix + "mlp.gate_proj.weight"])) * F.linear(m, w[prefix + "mlp.up_proj.weight"])
    mlp = F.linear(act, w[prefix + "mlp.down_proj.weight"])
    return x + mlp, context


def lm_head_weight(sd: dict, cfg: dict) -> torch.Tensor:
    if cfg.get("tie_word_embeddings") or "lm_head.weight" not in sd:
        return sd["model.embed_tokens.weight"]
    return sd["lm_head.weight"]


def mtp_input(sd: dict, cfg: dict, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """fc([norm_emb(embed(t)) | norm_hidden(h)]) for pairs (hidden [T, H], tokens [T])."""
    eps = cfg["rms_norm_eps"]
    e = F.embedding(tokens, sd["model.embed_tokens.weight"])
    both = torch.cat([rms_norm(e, sd["mtp.pre_fc_norm_embedding.weight"], eps),
                      rms_norm(hidden, sd["mtp.pre_fc_norm_hidden.weight"], eps)], -1)
    return F.linear(both, sd["mtp.fc.weight"])


def reference_mtp_chain(sd: dict, cfg: dict, target_hidden: torch.Tensor, tokens, k: int):
    """The MTP head's k greedy proposals after the anchor tokens[n] (n = len(tokens) - 1 >= 1), its context the
    committed tokens[:n + 1] with target_hidden[:n] (the target's hidden states after its final norm; rows past
    n - 1 are not read). Returns ([d_1..d_k], logits [k, V])."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    n = len(tokens) - 1
    assert n >= 1 and target_hidden.shape[0] >= n
    target_hidden = target_hidden.float()
    prefix = "mtp.layers.0."
    lm_head = lm_head_weight(sd, cfg)
    with torch.no_grad():
        # context: (zeros, t_0) at 0, (hidden[i-1], t_i) at i for 1 <= i <= n - 1
        pair_hidden = torch.cat([torch.zeros(1, target_hidden.shape[1]), target_hidden[:n - 1]])
        x = mtp_input(sd, cfg, pair_hidden, tokens[:n])
        _, context = gated_attention_layer(sd, prefix, cfg, x, torch.arange(n), empty_context(cfg))
        h, t = target_hidden[n - 1], tokens[n]
        proposals, logits = [], []
        for j in range(k):
            x = mtp_input(sd, cfg, h[None], t[None])
            x, context = gated_attention_layer(sd, prefix, cfg, x, torch.tensor([n + j]), context)
            h = rms_norm(x, sd["mtp.norm.weight"], cfg["rms_norm_eps"])[0]
            step = F.linear(h, lm_head)
            t = step.argmax()
            proposals.append(int(t))
            logits.append(step)
    return proposals, torch.stack(logits)


# --------------------------------------------------------------- the reference against transformers' own modules
def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def causal_mask(T: int) -> torch.Tensor:
    return torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]


def hf_layer_forward(hf, layer, x: torch.Tensor) -> torch.Tensor:
    """An HF Qwen3_5DecoderLayer (full attention) over rows x [T, H] at positions 0..T-1, causal."""
    T = x.shape[0]
    position_ids = torch.arange(T)[None, None].expand(3, 1, T)  # text positions: the three M-RoPE axes agree
    with torch.no_grad():
        cos_sin = hf.model.rotary_emb(x[None], position_ids)
        out = layer(x[None], position_embeddings=cos_sin, attention_mask=causal_mask(T))
    return (out[0] if isinstance(out, tuple) else out)[0]


def hf_mtp_modules(hf, sd: dict, cfg: dict):
    """transformers' own modules holding the MTP weights: its decoder layer (full attention), and its RMSNorm
    for each of the three MTP norms."""
    full = hf.config.layer_types.index("full_attention")
    layer = hf_qwen35.Qwen3_5DecoderLayer(hf.config, full).float().eval()
    prefix = "mtp.layers.0."
    layer.load_state_dict({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}, strict=True)
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = hf_qwen35.Qwen3_5RMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"]).eval()
        norms[name].weight.data.copy_(sd[f"mtp.{name}.weight"])
    return layer, norms


def hf_whole_sequence(hf, sd: dict, cfg: dict, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The MTP head over the pairs (hidden [T, H], tokens [T]) at positions 0..T-1 as one causal sequence,
    through transformers' modules only (its embedding, norms and decoder layer): the post-norm rows [T, H]."""
    layer, norms = hf_mtp_modules(hf, sd, cfg)
    with torch.no_grad():
        e = hf.model.embed_tokens(tokens)
        x = F.linear(torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](hidden)], -1),
                     sd["mtp.fc.weight"])
        return norms["norm"](hf_layer_forward(hf, layer, x))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = make_qwen35_mtp_folder(tmp_path_factory.mktemp("mtp_ref"), seed=0)
    sd, cfg = read_folder(folder)
    return folder, sd, cfg, hf_model(folder)


def test_folder_holds_the_mtp_block_and_transformers_leaves_it_out(checkpoint):
    folder, sd, cfg, hf = checkpoint
    assert cfg["mtp_num_hidden_layers"] == 1 and cfg["model_type"] == "qwen3_5_text"
    H, D = cfg["hidden_size"], cfg["head_dim"]
    assert sd["mtp.fc.weight"].shape == (H, 2 * H)
    assert sd["mtp.layers.0.self_attn.q_proj.weight"].shape == (2 * cfg["num_attention_heads"] * D, H)
    assert all(v.dtype == torch.float32 for v in sd.values())
    assert not any(name.startswith("mtp.") for name in hf.state_dict())
    # what transformers loaded is what the folder holds
    assert torch.equal(hf.model.embed_tokens.weight, sd["model.embed_tokens.weight"])
    assert torch.equal(hf.lm_head.weight, sd["lm_head.weight"])


def test_reference_norm_matches_transformers(checkpoint):
    _, sd, cfg, _ = checkpoint
    norm = hf_qwen35.Qwen3_5RMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"])
    norm.weight.data.copy_(sd["mtp.pre_fc_norm_hidden.weight"])
    x = torch.randn(5, cfg["hidden_size"], generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, sd["mtp.pre_fc_norm_hidden.weight"], cfg["rms_norm_eps"]), norm(x))


@pytest.mark.parametrize("weights", ["trunk", "mtp"])
def test_reference_layer_matches_transformers_decoder_layer(checkpoint, weights):
    """The reference's gated attention layer against transformers' Qwen3_5DecoderLayer with the same weights (the
    trunk's full-attention layer itself, and one holding the MTP layer's weights), over a sequence in one go and
    row by row through the reference's K/V context."""
    _, sd, cfg, hf = checkpoint
    full = hf.config.layer_types.index("full_attention")
    if weights == "trunk":
        layer, prefix = hf.model.layers[full], f"model.layers.{full}."
    else:
        layer, prefix = hf_mtp_modules(hf, sd, cfg)[0], "mtp.layers.0."
    T = 23
    x = torch.randn(T, cfg["hidden_size"], generator=torch.Generator().manual_seed(1)) * 2
    want = hf_layer_forward(hf, layer, x)
    whole, _ = gated_attention_layer(sd, prefix, cfg, x, torch.arange(T), empty_context(cfg))
    rows, context = [], empty_context(cfg)
    for p in range(T):
        out, context = gated_attention_layer(sd, prefix, cfg, x[p:p + 1], torch.tensor([p]), context)
        rows.append(out)
    assert relative_error(whole, want) < 1e-5
    assert relative_error(torch.cat(rows), want) < 1e-5
    # not a layer that ignores position: a shifted sequence start changes nothing (RoPE is relative), but
    # reversed positions do
    reversed_, _ = gated_attention_layer(sd, prefix, cfg, x, torch.arange(T).flip(0), empty_context(cfg))
    assert relative_error(reversed_, want) > 1e-2


def chain_against_transformers(sd, cfg, hf, hidden, tokens, k=K):
    """(reference proposals, reference logits [k, V], transformers' logits of the same chain [k, V]): step j's
    sequence is the context pairs, the anchor's, and the pairs (h'_i, d_i) of the steps before it, with h'_i
    transformers' own post-norm row of step i and d_i the reference's proposal, run as one causal sequence."""
    n = len(tokens) - 1
    proposals, logits = reference_mtp_chain(sd, cfg, hidden, tokens, k)
    pair_hidden = torch.cat([torch.zeros(1, hidden.shape[1]), hidden[:n]])
    pair_tokens = tokens[:n + 1].clone()
    want = []
    for j in range(k):
        last = hf_whole_sequence(hf, sd, cfg, pair_hidden, pair_tokens)[-1]
        with torch.no_grad():
            want.append(hf.lm_head(last))
        pair_hidden = torch.cat([pair_hidden, last[None]])
        pair_tokens = torch.cat([pair_tokens, torch.tensor([proposals[j]])])
    return proposals, logits, torch.stack(want)


@pytest.mark.parametrize("n", [1, 2, 17])
def test_reference_chain_matches_transformers_as_one_sequence(checkpoint, n):
    """Each chained step's logits equal transformers' modules run over the whole sequence of pairs (context,
    anchor, earlier proposals with the previous step's post-norm output) as one causal sequence, and the
    proposals are their argmax."""
    _, sd, cfg, hf = checkpoint
    tokens = torch.randint(0, VOCAB, (n + 1,), generator=torch.Generator().manual_seed(n))
    hidden = hf_hidden(hf, tokens)
    proposals, logits, want = chain_against_transformers(sd, cfg, hf, hidden, tokens)
    assert relative_error(logits, want) < 1e-5
    assert proposals == want.argmax(-1).tolist()


@pytest.mark.parametrize("name", ["mtp.fc.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
                                  "mtp.layers.0.self_attn.k_norm.weight", "mtp.layers.0.self_attn.q_proj.weight"])
def test_the_cross_check_fails_when_the_reference_is_wrong(checkpoint, name):
    """The reference run with one weight changed (transformers keeps the right one) disagrees with it: the
    cross-check above can fail."""
    _, sd, cfg, hf = checkpoint
    tokens = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(5))
    hidden = hf_hidden(hf, tokens)
    _, _, want = chain_against_transformers(sd, cfg, hf, hidden, tokens)
    wrong = dict(sd)
    wrong[name] = sd[name] + 0.3 * torch.randn(sd[name].shape, generator=torch.Generator().manual_seed(6))
    _, logits = reference_mtp_chain(wrong, cfg, hidden, tokens, K)
    assert relative_error(logits, want) > 1e-3


def test_context_and_zero_row_matter(checkpoint):
    """The proposals depend on the context (positions before the anchor) and on the (zeros, t_0) row: a drafter
    that left either out would not pass the tests below (for these tokens)."""
    _, sd, cfg, hf = checkpoint
    tokens = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(7))
    hidden = hf_hidden(hf, tokens)
    _, logits = reference_mtp_chain(sd, cfg, hidden, tokens, K)
    _, shorter = reference_mtp_chain(sd, cfg, hidden[1:], tokens[1:], K)  # no row for t_0
    assert relative_error(shorter, logits) > 1e-3


# ----------------------------------------------------------------------------------- the drafter against the oracle
@pytest.fixture
def mtp_drafter_module():
    import flashdraft.draft.mtp
    return flashdraft.draft.mtp


def margins(logits: torch.Tensor) -> list[float]:
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def assert_proposals(got: torch.Tensor, sd, cfg, hidden, tokens, what: str) -> list[int]:
    proposals, logits = reference_mtp_chain(sd, cfg, hidden, tokens, K)
    # greedy ties would make the comparison depend on rounding: the test's data has none
    assert min(margins(logits)) > 1e-4, ("near tie in the reference's logits: choose other test data", margins(logits))
    assert tuple(got.shape) == (1, K), (what, got.shape)
    assert got[0].tolist() == proposals, (what, got[0].tolist(), proposals)
    return proposals


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("n", [1, 12])
def test_mtp_drafter_proposals_equal_the_reference(mtp_drafter_module, tmp_path, n, tie):
    """The drafter's greedy proposals after observing t_0..t_{n-1} equal the reference's for the anchor t_n
    (and proposing twice from the same state agrees). Then round after round, as speculative decoding commits
    them: the anchor and the first `a` proposals (a = 1, 0, 3, 2, 1, ...; the first round's third token is not
    d_2) are observed at their positions, the next token (not the proposal there) is the new anchor, and the
    proposals equal the reference's over the whole committed sequence: the context carries over between calls
    and no proposal's own rows stay in it."""
    from flashdraft.formats.loader import create_drafter, load_target
    folder = make_qwen35_mtp_folder(tmp_path, seed=3 if tie else 2, tie_word_embeddings=tie)
    sd, cfg = read_folder(folder)
    hf = hf_model(folder)
    g = torch.Generator().manual_seed(100 + n)
    tokens = torch.randint(0, VOCAB, (n + 1,), generator=g)

    target, _, path = load_target(str(folder))
    drafter = create_drafter("mtp", target, params={"draft_n_max": K}, source=path)
    assert tuple(drafter.target_layers) == (cfg["num_hidden_layers"] - 1,), drafter.target_layers
    drafter.setup_cache(window=64, n_slots=1)
    state = target.new_state(1, 64)
    with torch.no_grad():
        _, features = target.forward(tokens[:n][None], torch.arange(n)[None], state, capture=drafter.target_layers,
                                     fresh=True)
        hidden = hf_hidden(hf, tokens)
        # the test's own inputs: the features, final-normed, are transformers' hidden states
        assert relative_error(target.model.norm(features[0]), hidden[:n]) < 1e-4
        drafter.observe(tokens[:n][None], features, torch.arange(n)[None], 0)
        got = drafter.propose(target, anchors=tokens[n:n + 1], positions=torch.tensor([n]), slots=0, k=K)
        proposals = assert_proposals(got, sd, cfg, hidden, tokens, "first round")
        again = drafter.propose(target, anchors=tokens[n:n + 1], positions=torch.tensor([n]), slots=0, k=K)
        assert again[0].tolist() == proposals, "a second propose from the same state differs"

        anchor = n
        for round_, accepted in enumerate([1, 0, 3, 2, 1, 0, 2, 3]):
            # committed: the anchor, d_1..d_a, then a token other than d_{a+1} (the new anchor); in the first
            # round one more, other than d_2, observed as well (the anchor t_{n+3}: observe n..n+2)
            extra = torch.randint(0, VOCAB, (2 if round_ == 0 else 1,), generator=g)
            for i, t in enumerate(extra.tolist()):
                if accepted + i < K and t == proposals[accepted + i]:
                    extra[i] = (t + 1) % VOCAB
            tokens = torch.cat([tokens, torch.tensor(proposals[:accepted], dtype=torch.long), extra])
            new_anchor = len(tokens) - 1
            observed = torch.arange(anchor, new_anchor)
            _, features = target.forward(tokens[observed][None], observed[None], state, capture=drafter.target_layers)
            hidden = hf_hidden(hf, tokens)
            assert relative_error(target.model.norm(features[0]), hidden[observed]) < 1e-4
            drafter.observe(tokens[observed][None], features, observed[None], 0)
            got = drafter.propose(target, anchors=tokens[new_anchor:], positions=torch.tensor([new_anchor]), slots=0,
                                  k=K)
            proposals = assert_proposals(got, sd, cfg, hidden, tokens, f"round {round_ + 1}, anchor {new_anchor}")
            anchor = new_anchor


def test_engine_proposals_equal_the_reference_over_requests_and_slots(tmp_path):
    """Every verify step's proposals through the engine, over several requests in the same slots (each new prompt
    resets its slot: position 0 pairs with zeros again, never with the last request's h) and two slots at once,
    equal the reference chain over the tokens committed before it."""
    import queue

    from flashdraft.engine.config import EngineConfig
    from flashdraft.engine.engine import Completion, Engine, Request
    from flashdraft.engine.sampling import SamplingParams
    folder = make_qwen35_mtp_folder(tmp_path, seed=4)
    sd, cfg = read_folder(folder)
    hf = hf_model(folder)
    engine = Engine.load(EngineConfig(model=str(folder), spec_type="mtp", ctx_size=128, n_slots=2, adaptive=False))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 14, 6, 11)]
    done = [engine.generate(Request(p, params, cache_prompt=False)) for p in prompts[:2]]  # one after the other
    answers: list[queue.Queue] = [queue.Queue() for _ in prompts[2:]]
    with engine._wake:  # two at once
        for p, q in zip(prompts[2:], answers):
            engine.submit(Request(p, params, cache_prompt=False),
                          lambda e, q=q: isinstance(e, (Completion, Exception)) and q.put(e))
    done += [q.get(timeout=600) for q in answers]
    checked = 0
    for prompt, c in zip(prompts, done):
        tokens = torch.tensor(prompt + c.token_ids)
        hidden = hf_hidden(hf, tokens)
        at = len(prompt)  # the anchor of the first verify step: the first token out, sampled after the prompt
        for proposed, accepted in zip(c.spec.draft_steps, c.spec.acceptance_lengths):
            want, _ = reference_mtp_chain(sd, cfg, hidden, tokens[:at + 1], len(proposed))
            assert proposed == want, (prompt, at)
            checked += 1
            at += accepted
    assert checked > 20


def test_observing_twice_reads_the_same_predecessor(tmp_path):
    """A CUDA graph's capture runs observe once before its replay runs it again: the second run must write what
    the first did (the h before its first position is kept, not overwritten by its own last)."""
    from flashdraft.formats.loader import create_drafter, load_target
    folder = make_qwen35_mtp_folder(tmp_path, seed=5)
    target, _, path = load_target(str(folder))
    drafter = create_drafter("mtp", target, source=path)
    drafter.setup_cache(window=64, n_slots=1)
    tokens = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, features = target.forward(tokens[None], torch.arange(12)[None], target.new_state(1, 64),
                                     capture=drafter.target_layers, fresh=True)
        drafter.observe(tokens[None, :7], features[:, :7], torch.arange(7)[None], 0)
        drafter.observe(tokens[None, 7:], features[:, 7:], torch.arange(7, 12)[None], 0)
        once = drafter.state.cache.k.clone()
        drafter.observe(tokens[None, 7:], features[:, 7:], torch.arange(7, 12)[None], torch.tensor([0]))
    assert torch.equal(drafter.state.cache.k, once)
