"""An independent float64 numpy oracle of DeepSeek-V4.1's forward (optionally with the spec's round trips),
written from the spec text (/work/shared/spec/deepseek-v41.md), not from dsjax's implementation:
§1.3 steps 2-4, §2.1-2.10 for a prefill from position 0 (`forward`) and for the reference's
one-token decode after it (`decode_step`: the ring, the ratio-2 compressor's open group, the
published-index-key rule of §2.7, top-k k = min(index_topk, ⌊end_pos/r⌋)), §3 (mHC with the
one-sublayer lag), §4 (gate and MoE) and §5.6 (Engram fusion, given the rows).

Loops run per token / per query / per head where that makes a rule of the spec visible (windows,
visibility ⌊(t+1)/r⌋, candidate blocks, top-k ties, the sink softmax); speed is not a goal.

Inputs use the reference's names, not dsjax's, so a test maps one onto the other explicitly:
`hp` is the HF `text_config` dict (configs/tiny-v41.json), and `weights` is

    {"embed": [V, D], "head": [V, D], "norm": [D],
     "layers": [per layer {"attn_norm", "ffn_norm": [D],
                           "hc_attn", "hc_ffn": (fn [(2+N)N, ND], base [(2+N)N], scale [3]),
                           "attn": {"wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b", "attn_sink",
                                    optional "compressor": {"wkv", "norm", "wgate" (r = 2)},
                                    optional "indexer": {"wk", "k_norm"} and/or {"wq_b", "weights_proj"}},
                           "ffn": {"gate", "bias", "w1", "w2", "w3", "shared_w1", "shared_w2", "shared_w3"}}],
     optional "engram": {layer: {"wkv": [(N+1)D, n_hash·hd_e], "q_weight", "k_weight": [N, D],
                                 "rows": [B, S, n_hash, hd_e]}}}

Linear weights are [out, in] (y = W x). MoE w1/w3 [E, I, D], w2 [E, D, I].

`forward(..., round_trips=True)` adds the spec's FP8 / FP4 round trips (tests/v41_rounding.py: every
Lin8 / Lin4 activation, window rows, stored latents, index keys and queries) and the roundings it
names: the bf16 index scores (§2.6), the bf16 pooled sum (§2.4), p in bf16 before PV (§2.9); not
the bf16 storage of other activations (a float32 run with round trips keeps those in fp32).
"""

from __future__ import annotations

import math

import numpy as np

from v41_rounding import Rounding

F = np.float64


# ----------------------------------------------------------------------------- conventions (§0)
def rms_norm(x, w, eps):
    x = np.asarray(x, F)
    return np.asarray(w, F) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    """torch's softplus (β = 1): linear above 20."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def silu(x):
    return x * sigmoid(x)


def top_indices(scores, k):
    """The k largest entries, ties broken by the lower index (order: score desc, index asc)."""
    order = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
    return order[:k]


EXACT = Rounding(False)


# ----------------------------------------------------------------------------- schedule (§1.2)
class Schedule:
    """Per-layer roles from the config's lists, as §1.2 states them."""

    def __init__(self, hp):
        n = hp["num_hidden_layers"]
        self.ratio = list(hp["compress_ratios"][:n])
        self.kv_sources = list(hp["kv_source_layer_ids"])
        self.index_sources = list(hp["index_source_layer_ids"])
        self.candidate_source = hp.get("candidate_source_layer_id")

    def kv_from(self, l):  # the most recent KV source at or before l
        return max(k for k in self.kv_sources if k <= l)

    def topk_from(self, l):  # the most recent index source at or before l
        return max(k for k in self.index_sources if k <= l)

    def restricted(self, l):
        """An index source that is not a KV source, after the candidate source (§2.8)."""
        c = self.candidate_source
        return l in self.index_sources and l not in self.kv_sources and c is not None and c < l


# ----------------------------------------------------------------------------- RoPE (§2.1)
def rope_freqs(hp, compressed: bool):
    d_r = hp["qk_rope_head_dim"]
    i = np.arange(d_r // 2, dtype=F)
    if not compressed:  # r = 0 layers: θ = rope_theta, no scaling
        return hp["rope_theta"] ** (-2.0 * i / d_r)
    theta = hp["compress_rope_theta"]
    sc = hp["rope_scaling"]
    f = theta ** (-2.0 * i / d_r)
    orig = sc["original_max_position_embeddings"]

    def c(beta):
        return d_r * math.log(orig / (2 * math.pi * beta)) / (2 * math.log(theta))

    lo = max(math.floor(c(sc["beta_fast"])), 0)
    hi = min(math.ceil(c(sc["beta_slow"])), d_r - 1)
    rho = np.clip((i - lo) / max(hi - lo, 1e-3), 0.0, 1.0)
    return f * (1 - rho) + (f / sc["factor"]) * rho


def rope(x, pos, freqs, inverse=False):
    """Rotate adjacent pairs (x_{2i}, x_{2i+1}) of the last 2·len(freqs) channels by pos·f_i."""
    x = np.array(x, F)
    d_r = 2 * len(freqs)
    ang = pos * freqs * (-1.0 if inverse else 1.0)
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = x[..., -d_r::2].copy(), x[..., -d_r + 1::2].copy()
    x[..., -d_r::2] = a * cos - b * sin
    x[..., -d_r + 1::2] = a * sin + b * cos
    return x


# ----------------------------------------------------------------------------- mHC (§3)
def mixes(X, hc, hp):
    """X [N, D] -> (pre [N], post [N], C [N, N])."""
    fn, base, scale = (np.asarray(a, F) for a in hc)
    n, eps, hc_eps = hp["hc_mult"], hp["rms_norm_eps"], hp["hc_eps"]
    v = X.reshape(-1)
    m = (fn @ v) / np.sqrt(np.mean(v * v) + eps)
    pre = sigmoid(m[:n] * scale[0] + base[:n]) + hc_eps
    post = 2 * sigmoid(m[n:2 * n] * scale[1] + base[n:2 * n])
    c0 = (m[2 * n:] * scale[2] + base[2 * n:]).reshape(n, n)  # C0[i, j] = m[2n + n i + j]...
    c = np.exp(c0 - c0.max(axis=1, keepdims=True))
    c = c / c.sum(axis=1, keepdims=True) + hc_eps  # softmax over j, row-wise
    c = c / (c.sum(axis=0, keepdims=True) + hc_eps)  # column sums Σ_i C[i, j]
    for _ in range(hp["hc_sinkhorn_iters"] - 1):
        c = c / (c.sum(axis=1, keepdims=True) + hc_eps)
        c = c / (c.sum(axis=0, keepdims=True) + hc_eps)
    return pre, post, c


def collapse(X, pi):
    return np.einsum("n,nd->d", pi, X)


def expand(y, X, post, C):
    """X'_j = post_j y + Σ_i C[i, j] X_i."""
    return post[:, None] * y[None, :] + np.einsum("ij,id->jd", C, X)


# ----------------------------------------------------------------------------- attention (§2)
def compress(cp, x, r, eps, rt=EXACT):
    """§2.4: x [S, D] -> pre-RoPE latents C [⌊S/r⌋, hd]."""
    a = x @ np.asarray(cp["wkv"], F).T
    if r == 1:
        return rms_norm(a, cp["norm"], eps)
    z = x @ np.asarray(cp["wgate"], F).T
    out = []
    for j in range(len(x) // r):
        grp = slice(j * r, (j + 1) * r)
        w = np.exp(z[grp] - z[grp].max(axis=0))
        w = w / w.sum(axis=0)  # softmax over the group's tokens, per channel
        out.append(rms_norm(rt.bf16((w * a[grp]).sum(axis=0)), cp["norm"], eps))
    return np.stack(out) if out else np.zeros((0, a.shape[1]))


def candidate_mask(scores_t, vis, bs, k_blocks):
    """§2.8: scores_t [E] (causally masked) -> bool [E], the kept blocks' entries."""
    e = len(scores_t)
    n_blocks = -(-e // bs)
    padded = np.full(n_blocks * bs, -np.inf)
    padded[:e] = scores_t
    beta = [padded[b * bs:(b + 1) * bs].max() for b in range(n_blocks)]
    if vis > 0:
        beta[(vis - 1) // bs] = np.inf  # the newest visible entry's block is pinned
    kept = [b for b in top_indices(beta, min(k_blocks, n_blocks)) if beta[b] != -np.inf]
    mask = np.zeros(e, bool)
    for b in kept:
        mask[b * bs:(b + 1) * bs] = True
    return mask[:e]


def index_score(q_t, omega_t, key, rt=EXACT):
    """§2.6: s = Σ_h ω_h · ReLU(q_h · k) for one query q_t [H_I, d_I] and one key [d_I]; with
    round trips bf16(Σ_h bf16(ReLU(bf16(q_h · k)) ω_h)), the head sum in fp32 from h = 0."""
    if not rt.on:
        return sum(omega_t[h] * max(q_t[h] @ key, 0.0) for h in range(len(omega_t)))
    total = np.float32(0.0)
    for h in range(len(omega_t)):  # FP4 operands: the dots are exact, every rounding below is decided
        term = rt.decided(max(rt.decided(q_t[h] @ key), 0.0) * omega_t[h])
        total = np.float32(total + np.float32(term))
    return float(rt.decided(total))


def attend(q_t, rows, sink, rt=EXACT, block=64):
    """§2.9 for one query q_t [H, hd] over K = V = rows [n, hd] (index-list order: window, then
    compressed ascending), with the per-head sink -> [H, hd], as the vendor's online softmax:
    blocks of 64 rows, running max M from -1e30, M_b = max(M_{b-1}, max ℓ of block b), block b's
    e_i = e^{ℓ_i - M_b} and p_i = e_i (bf16(e_i) with round trips) into acc = Σ p_i KV_i and
    l = Σ e_i, both rescaled by e^{M_{b-1} - M_b}; o = acc / (l + e^{σ - M}). Exactly the one-max
    form Σ_i p_i KV_i / (Σ_i e_i + e^{σ - m}) when the max does not rise after the first block
    (always when n <= 64). The spec does not say where an index list's -1 entries sit; the rows
    here are the valid ones, consecutive (tiny-v41: window 16 + top-k 16, one block either way)."""
    kv = np.stack(rows)
    out = np.zeros(q_t.shape)
    for h in range(len(q_t)):
        logits = kv @ q_t[h] * q_t.shape[-1] ** -0.5
        m, l, acc = -1e30, 0.0, np.zeros(kv.shape[-1])
        for start in range(0, len(kv), block):
            m_new = max(m, logits[start:start + block].max())
            e = np.exp(logits[start:start + block] - m_new)
            l = l * np.exp(m - m_new) + e.sum()
            acc = acc * np.exp(m - m_new) + rt.bf16(e) @ kv[start:start + block]
            m = m_new
        out[h] = acc / (l + np.exp(sink[h] - m))
    return out


def out_proj(p, o_t, hp, rt=EXACT):
    """§2.10 after the inverse RoPE: grouped wo_a, then wo_b. o_t [H, hd] -> [D]."""
    H, G, r_o = hp["num_attention_heads"], hp["o_groups"], hp["o_lora_rank"]
    wo_a, wo_b = np.asarray(p["wo_a"], F), np.asarray(p["wo_b"], F)
    z = [wo_a[g * r_o:(g + 1) * r_o] @ o_t[g * H // G:(g + 1) * H // G].reshape(-1) for g in range(G)]
    return wo_b @ rt.fp8(np.concatenate(z))


def attention(l, p, x, hp, sched, pub, rt=EXACT):
    """One layer's attention over a sequence x [S, D] (already attn-normed), from position 0.
    `pub` holds what earlier layers published: latents / index keys per KV source, top-k lists
    per index source, candidate masks of the candidate source. It also receives the decode
    state this prefill leaves (see `decode_step`): the ring, a ratio-2 compressor's open group
    and which owner published index keys last."""
    S = len(x)
    eps = hp["rms_norm_eps"]
    H, hd = hp["num_attention_heads"], hp["head_dim"]
    r = sched.ratio[l]
    freqs = rope_freqs(hp, compressed=r > 0)
    W = hp["sliding_window"]

    x8 = rt.fp8(x)  # every Lin8 input makes the FP8 round trip
    cq = rms_norm(x8 @ np.asarray(p["wq_a"], F).T, p["q_norm"], eps)  # [S, r_q]
    q = (rt.fp8(cq) @ np.asarray(p["wq_b"], F).T).reshape(S, H, hd)
    q = np.stack([rope(q[t], t, freqs) for t in range(S)])
    k = rms_norm(x8 @ np.asarray(p["wkv"], F).T, p["kv_norm"], eps)  # [S, hd], K = V
    k = rt.fp8(np.stack([rope(k[t], t, freqs) for t in range(S)]))  # §2.3: all hd channels
    pub["ring", l] = {t % W: (t, k[t]) for t in range(max(0, S - W), S)}  # §2.3: the last min(S, W) rows

    selected = [[] for _ in range(S)]  # per query: compressed rows it attends
    if r > 0:
        E = S // r
        if l in sched.kv_sources:  # own compressor; the indexer uses the pre-RoPE latents
            C = compress(p["compressor"], x, r, eps, rt)
            if r > 1:  # §2.4: the open group's tokens stay in their slots (t mod r) as fp32 (a, z)
                cp = p["compressor"]
                pub["tail", l] = {t % r: (np.asarray(cp["wkv"], F) @ x[t], np.asarray(cp["wgate"], F) @ x[t])
                                  for t in range(E * r, S)}
            if l in sched.index_sources:
                ix = p["indexer"]
                kI = rms_norm(C @ np.asarray(ix["wk"], F).T, ix["k_norm"], eps)
                pub["index_keys", l] = [rt.fp4_e8m0(rope(kI[j], j * r, freqs)) for j in range(E)]
                if E:
                    pub["published"] = l  # §2.7: an owner that produced entries publishes its keys
            pub["latents", l] = [rt.fp4_e4m3(rope(C[j], j * r, freqs)) for j in range(E)]
        if l in sched.index_sources and E > 0:
            ix = p["indexer"]
            HI, dI = hp["index_n_heads"], hp["index_head_dim"]
            keys = pub["index_keys", l if l in sched.kv_sources else sched.kv_from(l)]
            qI = (rt.fp8(cq) @ np.asarray(ix["wq_b"], F).T).reshape(S, HI, dI)
            omega = rt.bf16(rt.bf16(x @ np.asarray(ix["weights_proj"], F).T) * (dI ** -0.5 * HI ** -0.5))
            kk = min(hp["index_topk"], E)
            lists = []
            for t in range(S):
                vis = (t + 1) // r
                qt = rt.fp4_e8m0(rope(qI[t], t, freqs))
                s = np.full(E, -np.inf)
                for j in range(vis):
                    s[j] = index_score(qt, omega[t], keys[j], rt)
                if l == sched.candidate_source:
                    pub["candidates", t] = candidate_mask(s, vis, hp["candidate_block_size"],
                                                          hp["candidate_topk_blocks"])
                elif sched.restricted(l):
                    s = np.where(pub["candidates", t], s, -np.inf)
                # sorted ascending; an entry is valid iff it is visible (a candidate-masked pick stays valid)
                lists.append([j for j in sorted(top_indices(list(s), kk)) if j < vis])
            pub["topk", l] = lists
        src = sched.topk_from(l)
        if ("topk", src) in pub:
            latents = pub["latents", sched.kv_from(l)]
            selected = [[latents[j] for j in pub["topk", src][t]] for t in range(S)]

    sink = np.asarray(p["attn_sink"], F)
    y = np.zeros((S, hp["hidden_size"]))
    for t in range(S):
        o = attend(q[t], [k[i] for i in range(max(0, t - W + 1), t + 1)] + selected[t], sink, rt)
        y[t] = out_proj(p, rope(o, t, freqs, inverse=True), hp, rt)
    return y


def attention_decode(l, p, x, t, hp, sched, st, call, from_owner=False):
    """One layer's attention for one token x [D] (attn-normed) at position t, as the reference's
    one-token decode runs it (§2.3-2.8). `st`: this sequence's decode state (left by `attention`
    over the prefill, then updated here); `call`: what earlier layers published in this call
    (top-k lists, the candidate mask). from_owner: ratio-2 sources score their own owner's keys
    (`index_keys_from_owner=True`) instead of the last published ones (§2.7)."""
    eps = hp["rms_norm_eps"]
    H, hd = hp["num_attention_heads"], hp["head_dim"]
    r = sched.ratio[l]
    freqs = rope_freqs(hp, compressed=r > 0)
    W = hp["sliding_window"]

    cq = rms_norm(np.asarray(p["wq_a"], F) @ x, p["q_norm"], eps)
    q = rope((np.asarray(p["wq_b"], F) @ cq).reshape(H, hd), t, freqs)
    k = rope(rms_norm(np.asarray(p["wkv"], F) @ x, p["kv_norm"], eps), t, freqs)
    ring = st["ring", l]
    ring[t % W] = (t, k)
    window = [row for pos, row in sorted(ring.values(), key=lambda e: e[0]) if t - W < pos <= t]

    selected = []
    if r > 0:
        vis = (t + 1) // r  # = ⌊end_pos/r⌋: the key slice is exactly the visible entries
        if l in sched.kv_sources:
            cp = p["compressor"]
            C = None
            if r == 1:
                C = rms_norm(np.asarray(cp["wkv"], F) @ x, cp["norm"], eps)
            else:  # slot t mod r; the group is pooled when its last token arrives
                tail = st.setdefault(("tail", l), {})
                tail[t % r] = (np.asarray(cp["wkv"], F) @ x, np.asarray(cp["wgate"], F) @ x)
                if (t + 1) % r == 0:
                    a = np.stack([tail[i][0] for i in range(r)])
                    z = np.stack([tail[i][1] for i in range(r)])
                    w = np.exp(z - z.max(axis=0))
                    C = rms_norm(((w / w.sum(axis=0)) * a).sum(axis=0), cp["norm"], eps)
            if C is not None:
                j = t // r
                assert len(st["latents", l]) == j
                if l in sched.index_sources:
                    ix = p["indexer"]
                    kI = rms_norm(np.asarray(ix["wk"], F) @ C, ix["k_norm"], eps)
                    st["index_keys", l].append(rope(kI, j * r, freqs))
                    st["published"] = l  # §2.7: reassigned only when an owner produced an entry
                st["latents", l].append(rope(C, j * r, freqs))
        if l in sched.index_sources and vis > 0:
            ix = p["indexer"]
            HI, dI = hp["index_n_heads"], hp["index_head_dim"]
            qI = rope((np.asarray(ix["wq_b"], F) @ cq).reshape(HI, dI), t, freqs)
            omega = (np.asarray(ix["weights_proj"], F) @ x) * (dI ** -0.5 * HI ** -0.5)
            owner = l if l in sched.kv_sources else sched.kv_from(l)
            kk = min(hp["index_topk"], vis)

            def select(keys):
                s = np.array([index_score(qI, omega, keys[j]) for j in range(vis)])
                if l == sched.candidate_source:
                    call["candidates"] = candidate_mask(s, vis, hp["candidate_block_size"],
                                                        hp["candidate_topk_blocks"])
                elif sched.restricted(l):
                    s = np.where(call["candidates"], s, -np.inf)
                return sorted(top_indices(list(s), kk))  # every entry is visible: all valid

            published = st["index_keys", owner if from_owner else st["published"]]
            call["topk", l] = select(published[:vis])
            call["own_topk", l] = select(st["index_keys", owner][:vis])  # for tests: the list without §2.7
            call["published_by", l] = owner if from_owner else st["published"]
        src = sched.topk_from(l)
        if ("topk", src) in call:
            latents = st["latents", sched.kv_from(l)]
            selected = [latents[j] for j in call["topk", src]]

    o = attend(q, window + selected, np.asarray(p["attn_sink"], F))
    return out_proj(p, rope(o, t, freqs, inverse=True), hp)


# ----------------------------------------------------------------------------- MoE (§4)
def moe(p, u, hp, routes=None, rt=EXACT):
    """u [D] -> y [D] for one token. `routes` (a list) collects (chosen, chosen without the bias).
    Round trips: FP8 inputs of W1 / W3 and of W2, the routing weight applied before W2's (§4)."""
    L, k = hp["swiglu_limit"], hp["num_experts_per_tok"]
    s = np.sqrt(softplus(np.asarray(p["gate"], F) @ u))
    idx = top_indices(list(s + np.asarray(p["bias"], F)), k)  # the bias only selects
    if routes is not None:
        routes.append((sorted(idx), sorted(top_indices(list(s), k))))
    w = s[idx]
    if k > 1:
        w = w / (w.sum() + 1e-20)
    w = w * hp["routed_scaling_factor"]

    u8 = rt.fp8(u)

    def ffn(w1, w3, w2, weight):
        gamma = np.minimum(np.asarray(w1, F) @ u8, L)
        upsilon = np.clip(np.asarray(w3, F) @ u8, -L, L)
        return np.asarray(w2, F) @ rt.fp8(silu(gamma) * upsilon * weight)

    y = sum(ffn(p["w1"][e], p["w3"][e], p["w2"][e], we) for e, we in zip(idx, w))
    return y + ffn(p["shared_w1"], p["shared_w3"], p["shared_w2"], 1.0)


# ----------------------------------------------------------------------------- Engram (§5.6)
def engram(e, X, rows, hp, kv_round=None):
    """X [N, D], rows [n_hash, hd_e] for one token -> X. `kv_round` (optional) rounds κv, e.g. to
    the bf16 that §5.6 writes for it."""
    n, D, eps = hp["hc_mult"], hp["hidden_size"], hp["rms_norm_eps"]
    kv = np.asarray(e["wkv"], F) @ np.asarray(rows, F).reshape(-1)
    if kv_round is not None:
        kv = kv_round(kv)
    K, V = kv[:n * D].reshape(n, D), kv[n * D:]
    w = np.asarray(e["q_weight"], F) * np.asarray(e["k_weight"], F)
    out = X.copy()
    for j in range(n):
        rms_x = np.sqrt(np.mean(X[j] ** 2) + eps)
        rms_k = np.sqrt(np.mean(K[j] ** 2) + eps)
        delta = np.sum(X[j] * w[j] * K[j]) / rms_x / rms_k / math.sqrt(D)
        sign = 1.0 if delta >= 0 else -1.0
        out[j] = X[j] + sigmoid(sign * math.sqrt(max(abs(delta), 1e-6))) * V
    return out


# ----------------------------------------------------------------------------- model (§1.3, §3.2)
def block(lw, X, pi, hp, attn, routes=None, rt=EXACT):
    """Block ℓ with the mHC lag (§3.2) over X [S, N, D], π [S, N]; attn(x [S, D]) -> y [S, D]."""
    S, eps = len(X), hp["rms_norm_eps"]
    a = [mixes(X[t], lw["hc_attn"], hp) for t in range(S)]
    x = np.stack([rms_norm(collapse(X[t], pi[t]), lw["attn_norm"], eps) for t in range(S)])
    y = attn(x)
    X1 = np.stack([expand(y[t], X[t], a[t][1], a[t][2]) for t in range(S)])
    f = [mixes(X1[t], lw["hc_ffn"], hp) for t in range(S)]
    u = [rms_norm(collapse(X1[t], a[t][0]), lw["ffn_norm"], eps) for t in range(S)]
    X = np.stack([expand(moe(lw["ffn"], u[t], hp, routes, rt), X1[t], f[t][1], f[t][2]) for t in range(S)])
    return X, np.stack([f[t][0] for t in range(S)])


def backbone(weights, ids, positions, b, hp, attn_of, engram_kv_round=None, routes=None, rt=EXACT):
    """§1.3 steps 2-4 for one sequence's tokens ids [S] at `positions`; attn_of(l) -> the layer's
    attention over [S, D]. b: the batch row (for the Engram rows). -> (logits [S, V], main_hidden)."""
    n, eps = hp["hc_mult"], hp["rms_norm_eps"]
    targets = list(hp.get("dspark_target_layer_ids", []))
    eng = weights.get("engram") or {}
    X = np.repeat(np.asarray(weights["embed"], F)[ids][:, None, :], n, axis=1)  # [S, N, D]
    pi = np.zeros((len(ids), n))
    pi[:, 0] = 1.0
    taps = {}
    for l, lw in enumerate(weights["layers"]):
        if l in eng:
            X = np.stack([engram(eng[l], X[i], eng[l]["rows"][b, t], hp, engram_kv_round)
                          for i, t in enumerate(positions)])
        if l in targets:
            taps[l] = X.mean(axis=1)
        X, pi = block(lw, X, pi, hp, attn_of(l), routes, rt)
    h = np.stack([rms_norm(collapse(X[i], pi[i]), weights["norm"], eps) for i in range(len(ids))])
    hidden = np.concatenate([taps[l] for l in targets], axis=-1) if targets else None
    return h @ np.asarray(weights["head"], F).T, hidden


def forward(weights, tokens, hp, engram_kv_round=None, trace=None, round_trips=False):
    """tokens [B, S] -> (logits [B, S, V], main_hidden [B, S, len(targets)·D]): a prefill from
    position 0. engram_kv_round: an optional rounding of Engram's κv (see `engram`); exact by default.
    Engram rows ([B, ≥S, n_hash, hd_e]) are indexed by position.
    trace (a dict) receives what each batch row published ("published": [B] dicts keyed
    ("topk", layer) / ("candidates", t) / ...; each is also that row's decode state, see
    `decode_step`) and the routing ("routes": (chosen, chosen without the bias) per token and
    layer), so a test can check which rules its data exercises. round_trips: a bool or a
    v41_rounding.Rounding (see the module docstring; Engram's are not modelled)."""
    tokens = np.asarray(tokens)
    B, S = tokens.shape
    sched = Schedule(hp)
    rt = round_trips if isinstance(round_trips, Rounding) else Rounding(round_trips)
    routes = trace.setdefault("routes", []) if trace is not None else None
    logits, main_hidden = [], []
    for b in range(B):
        pub = {}
        if trace is not None:
            trace.setdefault("published", []).append(pub)

        def attn_of(l):
            return lambda x: attention(l, weights["layers"][l]["attn"], x, hp, sched, pub, rt)
        lg, hid = backbone(weights, tokens[b], range(S), b, hp, attn_of, engram_kv_round, routes, rt)
        logits.append(lg)
        main_hidden.append(hid)
    return np.stack(logits), (np.stack(main_hidden) if main_hidden[0] is not None else None)


def decode_step(weights, states, tokens, t, hp, from_owner=False, engram_kv_round=None, trace=None):
    """One-token decode at position t (the reference's start_pos = t) for tokens [B], continuing
    `states` ([B] per-row decode states, as `forward`'s trace["published"] leaves them after a
    prefill of t tokens; updated in place) -> (logits [B, V], main_hidden [B, ·]).
    from_owner: `index_keys_from_owner=True` (§2.7's clean reading). trace (a dict) receives
    per row what this call published ("calls": [B] dicts keyed ("topk", layer),
    ("own_topk", layer), ("published_by", layer), "candidates")."""
    sched = Schedule(hp)
    logits, main_hidden = [], []
    for b, st in enumerate(states):
        call = {}
        if trace is not None:
            trace.setdefault("calls", []).append(call)

        def attn_of(l):
            p = weights["layers"][l]["attn"]
            return lambda x: attention_decode(l, p, x[0], t, hp, sched, st, call, from_owner)[None]
        lg, hid = backbone(weights, np.asarray(tokens)[b:b + 1], [t], b, hp, attn_of, engram_kv_round)
        logits.append(lg[0])
        main_hidden.append(None if hid is None else hid[0])
    return np.stack(logits), (np.stack(main_hidden) if main_hidden[0] is not None else None)
