"""Would a per-channel equalisation of K, or a rotation of each head vector, (one scale per RoPE channel pair, from the first 32 keys) cut q8_0's error
in a model's attention scores? Captures every layer's queries and keys over one 1024-token context (f32 cache),
then compares the scores over q8_0 keys, plain and equalised, with the exact ones.

  python benchmarks/kernels/kv_equalise.py MODEL.gguf
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))  # benchmarks/, for its shared modules
from kv_quality import texts  # noqa: E402
import flashdraft.models.llama as L  # noqa: E402
from flashdraft.formats.loader import load_target  # noqa: E402
from flashdraft.layers import attention as A  # noqa: E402
from flashdraft.layers.kv_quant import kv_codecs, rotate  # noqa: E402

target, tok, _ = load_target(sys.argv[1], "cpu", torch.float32)
ids = torch.tensor(tok.encode(texts(1, 10)[0])[:1024])
caught = []
orig = A.attend_cache
def spy(q, cache, length, mask, spec):
    keys, _ = cache.read(length, q.dtype)
    caught.append((q[0].clone(), keys.reshape(-1, *keys.shape[-2:]).clone()))  # q [T, H, D]; keys [KV, L, D]
    return orig(q, cache, length, mask, spec)
L.attend_cache = spy
state = target.new_state(1, len(ids) + 8, ("f32", "f32"))
with torch.inference_mode():
    target(ids[None], torch.arange(len(ids))[None], state, 0, attn_len=len(ids))
codec = kv_codecs(("q8_0", "q8_0"), torch.float32)[0]
codec.prepare("cpu", caught[0][1].shape[-1])
def q8(x):
    return codec.decode(codec.encode(x), torch.float32)
tot = {"plain": [], "equalised": [], "alpha.5": [], "rotated": []}
for layer, (q, k) in enumerate(caught):
    KV, Lk, D = k.shape
    G = q.shape[1] // KV
    qg = q.reshape(q.shape[0], KV, G, D)
    ref = torch.einsum("tkgd,kld->tkgl", qg, k)
    amax = k[:, :32].abs().amax(1)  # [KV, D] from the first 32 keys
    pair = torch.maximum(amax[:, : D // 2], amax[:, D // 2:])
    pair = torch.cat([pair, pair], -1)
    for name, s in (("plain", torch.ones_like(pair)), ("equalised", pair / pair.median(-1, keepdim=True).values),
                    ("alpha.5", (pair / pair.median(-1, keepdim=True).values).sqrt())):
        s = s.clamp(min=1.0)
        kq = q8((k / s[:, None, :]).transpose(0, 1)[None]).reshape(Lk, KV, D).transpose(0, 1) * s[:, None, :]
        got = torch.einsum("tkgd,kld->tkgl", qg, kq)
        tot[name].append(float((got - ref).norm() / ref.norm()))
    # the keys and queries of each head rotated (randomised Hadamard, as the turbo types): q.k unchanged, the keys'
    # outlier channels spread over the block before q8_0 rounds them
    kr = q8(rotate(k).transpose(0, 1)[None]).reshape(Lk, KV, D).transpose(0, 1)
    got = torch.einsum("tkgd,kld->tkgl", rotate(qg), kr)
    tot["rotated"].append(float((got - ref).norm() / ref.norm()))
for name, v in tot.items():
    print(name, "mean relative score error over layers", sum(v) / len(v), "max", max(v))
