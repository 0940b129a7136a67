"""An independent float64 numpy oracle of DeepSeek-V4.1's DSpark draft head (spec deepseek-v41.md
§6.1-6.6), written from the spec text, not from dsjax: no quantisation round trips, greedy
sampling. It reuses the backbone oracle's conventions (tests/v41_oracle.py: RMSNorm, RoPE
tables, mHC mixes / collapse / expand, the MoE of §4).

It keeps no ring: `keys[s]` maps every main position ever seeded to stage s's rho, and a draft
reads positions max(0, t-W+1)..t from it, so a ring that loses or keeps the wrong rows in dsjax
shows up as a mismatch. Names are the reference's: `weights` is

    {"embed": [V, D], "head": [V, D], "main_proj": [D, 3D], "main_norm": [D], "norm": [D],
     "markov_embed", "markov_head": [V, rank], "confidence": [D + rank],
     "stages": [per stage a v41_oracle layer dict: attn_norm, ffn_norm, hc_attn, hc_ffn,
                attn {wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink}, ffn {...}]}
"""

from __future__ import annotations

import numpy as np

from v41_oracle import F, collapse, expand, mixes, moe, rms_norm, rope, rope_freqs


def stage_hp(hp):
    """A stage's MoE is DSpark's size (§4: E = 128, k = 3 at full size)."""
    return dict(hp, n_routed_experts=hp["dspark_n_routed_experts"],
                num_experts_per_tok=hp["dspark_num_experts_per_tok"])


def mu(weights, main_hidden, hp):
    """§6.1: main_hidden [..., 3D] -> μ [..., D]."""
    return rms_norm(np.asarray(main_hidden, F) @ weights["main_proj"].T, weights["main_norm"], hp["rms_norm_eps"])


def ring_key(stage, m, pos, hp):
    """§6.4: ρ_pos = RoPE_pos(RMSNorm_kv_norm(W_kv μ_pos)), θ = rope_theta without YaRN."""
    a = stage["attn"]
    k = rms_norm(a["wkv"] @ m, a["kv_norm"], hp["rms_norm_eps"])
    return rope(k, pos, rope_freqs(hp, compressed=False))


def seed(weights, keys, main_hidden, positions, hp):
    """§6.6 / §6.7 step 3: ρ for each (position, main_hidden row) into every stage's table."""
    for h, p in zip(main_hidden, positions):
        m = mu(weights, h, hp)
        for s, stage in enumerate(weights["stages"]):
            keys[s][int(p)] = ring_key(stage, m, int(p), hp)


def attention(a, x, t, ring, hp):
    """§6.4 for one stage: x [K, D] (attn-normed) at positions P..P+K-1 (P = t+1); every query
    attends ring positions max(0, t-W+1)..t and all K block keys, with the sink."""
    K, eps = len(x), hp["rms_norm_eps"]
    H, hd, W = hp["num_attention_heads"], hp["head_dim"], hp["sliding_window"]
    freqs = rope_freqs(hp, compressed=False)
    pos = [t + 1 + k for k in range(K)]
    cq = rms_norm(x @ a["wq_a"].T, a["q_norm"], eps)
    q = np.stack([rope(v.reshape(H, hd), p, freqs) for v, p in zip(cq @ a["wq_b"].T, pos)])  # [K, H, hd]
    beta = np.stack([rope(v, p, freqs) for v, p in zip(rms_norm(x @ a["wkv"].T, a["kv_norm"], eps), pos)])
    kv = np.stack([ring[p] for p in range(max(0, t - W + 1), t + 1)] + list(beta))
    out = np.zeros((K, H, hd))
    for k in range(K):
        for h in range(H):
            logits = kv @ q[k, h] * hd ** -0.5
            m = logits.max()
            e = np.exp(logits - m)
            o = (e @ kv) / (e.sum() + np.exp(a["attn_sink"][h] - m))
            out[k, h] = rope(o, pos[k], freqs, inverse=True)
    G, r_o = hp["o_groups"], hp["o_lora_rank"]
    y = np.zeros((K, hp["hidden_size"]))
    for k in range(K):
        z = [a["wo_a"][g * r_o:(g + 1) * r_o] @ out[k, g * H // G:(g + 1) * H // G].reshape(-1) for g in range(G)]
        y[k] = a["wo_b"] @ np.concatenate(z)
    return y


def draft(weights, keys, anchor, main_hidden_t, t, hp, markov=True):
    """One decode call (§6.6): write ρ_t, run the stages over [a, noise x (K-1)] at t+1..t+K, the
    head with the sequential Markov correction (greedy). markov=False leaves the correction out
    (to show that it matters). -> (drafts o_1..o_K, corrected logits [K, V], confidences [K],
    the streams' collapse h [K, D])."""
    seed(weights, keys, [main_hidden_t], [t], hp)
    n, eps, K = hp["hc_mult"], hp["rms_norm_eps"], hp["dspark_block_size"]
    shp = stage_hp(hp)
    ids = [int(anchor)] + [hp["dspark_noise_token_id"]] * (K - 1)
    X = np.repeat(weights["embed"][ids][:, None, :], n, axis=1)  # [K, N, D]
    pi = np.zeros((K, n))
    pi[:, 0] = 1.0
    for s, lw in enumerate(weights["stages"]):  # §3.2, the block with the lag
        a = [mixes(X[k], lw["hc_attn"], hp) for k in range(K)]
        x = np.stack([rms_norm(collapse(X[k], pi[k]), lw["attn_norm"], eps) for k in range(K)])
        y = attention(lw["attn"], x, t, keys[s], hp)
        X1 = np.stack([expand(y[k], X[k], a[k][1], a[k][2]) for k in range(K)])
        f = [mixes(X1[k], lw["hc_ffn"], hp) for k in range(K)]
        u = [rms_norm(collapse(X1[k], a[k][0]), lw["ffn_norm"], eps) for k in range(K)]
        X = np.stack([expand(moe(lw["ffn"], u[k], shp), X1[k], f[k][1], f[k][2]) for k in range(K)])
        pi = np.stack([f[k][0] for k in range(K)])
    h = np.stack([collapse(X[k], pi[k]) for k in range(K)])  # un-normed
    logits = rms_norm(h, weights["norm"], eps) @ weights["head"].T  # [K, V]
    drafts, conf, o = [], [], int(anchor)
    for k in range(K):
        e = weights["markov_embed"][o]
        if markov:
            logits[k] = logits[k] + weights["markov_head"] @ e
        o = int(np.argmax(logits[k]))  # the first maximum
        drafts.append(o)
        conf.append(weights["confidence"] @ np.concatenate([h[k], e]))
    return np.array(drafts), logits, np.array(conf), h
