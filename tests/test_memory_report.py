"""`dsjax memory --quantized resident`: the bytes of the weights as the releases store them,
checked against closed forms written from the specs' tensor tables (deepseek-v41.md §8,
deepseek-v4.md "Weight names"), not against dsjax's own spec trees; and the fit verdict of
`--device-memory` at the bytes the report needs."""

import math

import pytest

from dsjax import cli
from dsjax.config import load_config
from dsjax.param_count import memory_report


def fp8(out, inn, tile):
    """E4M3 bytes + one E8M0 byte per tile."""
    return out * inn + math.ceil(out / tile) * math.ceil(inn / tile)


def fp4(out, inn):
    """MXFP4: two E2M1 codes a byte + one E8M0 byte per 32."""
    return out * inn // 2 + out * inn // 32


def v41_block(d=5120, experts=384, tile=32, wo_a_bf16=True):
    """One V4.1-Flash block without compressor / indexer (§8): attention, norms, mHC, gate, shared and
    routed experts."""
    n = fp8(1280, d, tile) + fp8(32768, 1280, tile) + fp8(512, d, tile) + fp8(d, 8192, tile)
    n += 2 * 8192 * 4096 if wo_a_bf16 else fp8(8192, 4096, tile)  # wo_a: bf16 as the reference keeps it, or as stored
    n += 4 * 64 + 2 * (1280 + 512) + 2 * 2 * d  # attn_sink f32; q_norm, kv_norm, attn_norm, ffn_norm bf16
    n += 2 * 4 * (24 * 4 * d + 24 + 3)  # hc_{attn,ffn}_{fn,base,scale} f32
    n += 2 * experts * d + 2 * 4 * experts  # gate.weight bf16, bias + bias_vl f32
    n += 2 * fp8(2304, d, tile) + fp8(d, 2304, tile)  # shared experts
    n += experts * (2 * fp4(2304, d) + fp4(d, 2304))  # routed experts
    return n


def v41_flash_bytes(wo_a_bf16: bool) -> tuple[int, int]:
    """(backbone + DSpark bytes, Engram table bytes) of V4.1-Flash from §8's table."""
    d, v, tile = 5120, 129280, 32
    n = 40 * v41_block(wo_a_bf16=wo_a_bf16) + 2 * 2 * v * d + 2 * d  # blocks, embed + head, norm (bf16)
    n += 4 * (2 * 512 * d + 2 * 512 + 2 * 128 * 512 + 2 * 128) + 3 * 2 * 512 * d  # KV sources: compressor, indexer.wk
    n += 8 * (fp8(4096, 1280, tile) + 2 * 32 * d)  # index sources: indexer.wq_b, weights_proj
    n += 2 * (fp8(25600, 6144, tile) + 2 * 2 * 4 * d)  # Engram wkv, q_weight, k_weight
    n += 3 * v41_block(experts=128, wo_a_bf16=wo_a_bf16)  # DSpark stages
    n += fp8(d, 3 * d, tile) + 2 * d + 2 * d + 2 * 2 * v * 256 + 2 * (d + 256)  # main_proj, norms, Markov, confidence
    engram = 264 * (384006168 + 384016682)  # 256 E4M3 + 8 E8M0 bytes a row (§5.5)
    return n, engram


def v4_flash_bytes() -> int:
    """V4-Flash's FP8 projections, MXFP4 experts and bf16 embed / head / router (deepseek-v4.md), with the MTP
    layer; compressors, norms and mHC (under 1 %) left out."""
    d, v, tile, e = 4096, 129280, 128, 256

    def block(indexer: bool):
        n = fp8(1024, d, tile) + fp8(64 * 512, 1024, tile) + fp8(512, d, tile) + fp8(8 * 1024, 4096, tile)
        n += fp8(d, 8 * 1024, tile) + 2 * fp8(2048, d, tile) + fp8(d, 2048, tile) + 2 * e * d
        n += e * (2 * fp4(2048, d) + fp4(d, 2048))
        return n + (fp8(64 * 128, 1024, tile) if indexer else 0)

    csa = 21  # compress_ratios [0,0] + [4,128]*20 + [4]: 21 layers of ratio 4 carry an indexer
    return 43 * block(False) + csa * (block(True) - block(False)) + 2 * 2 * v * d + block(False) + 2 * fp8(d, d, tile)


def test_v41_flash_resident_bytes_match_the_spec_table():
    r = memory_report(load_config("v41-flash"), quantized="resident")
    want, engram = v41_flash_bytes(wo_a_bf16=True)
    assert r["engram_host_bytes"] == pytest.approx(engram, rel=1e-9)
    assert r["weights_total_bytes"] == pytest.approx(want, rel=1e-5)  # norms: fp32 in dsjax, bf16 as stored (~1 MB)
    shipped, _ = v41_flash_bytes(wo_a_bf16=False)
    assert abs(shipped + engram - 510e9) < 0.1 * 510e9  # the release's ~510 GB (552 B + 196.6 B Engram values)
    assert abs(r["checkpoint_bytes"] - 510e9) < 0.1 * 510e9


def test_v4_flash_resident_bytes_match_the_spec():
    r = memory_report(load_config("v4-flash"), quantized="resident")
    assert r["weights_total_bytes"] == pytest.approx(v4_flash_bytes(), rel=1e-2)
    assert abs(r["weights_total_bytes"] - 160e9) < 0.1 * 160e9  # ~160 GB as DeepSeek ships it
    assert r["engram_host_bytes"] == 0


def test_per_device_bytes_and_the_kv_budget():
    """On expert=8 each device holds 1/8 of the routed experts; the KV budget's sequences split over the batch
    shards (data x expert), as the engine splits its slots."""
    cfg = load_config("v41-flash")
    one = memory_report(cfg, quantized="resident", kv_seqs=64)
    eight = memory_report(cfg, {"expert": 8}, quantized="resident", kv_seqs=64)
    assert eight["bytes_per_device"]["routed_experts"] * 8 == one["bytes_per_device"]["routed_experts"]
    assert one["kv_budget"]["bytes_per_device"] == 8 * eight["kv_budget"]["bytes_per_device"]
    assert one["kv_budget"]["bytes_per_device"] == 64 * one["kv_budget"]["bytes_per_sequence"]
    with pytest.raises(ValueError, match="kv_tokens must be a positive multiple of 2"):
        memory_report(cfg, kv_tokens=4095)


def test_device_memory_verdict(capsys):
    """Fits at the bytes the report needs, not one MiB below: refused (exit status 2) naming the bytes needed
    and held."""
    r = memory_report(load_config("v4-flash"), quantized="resident")
    need = r["need_per_device"]
    argv = ["memory", "--config", "v4-flash", "--quantized", "resident", "--mesh", ""]
    assert cli.main(argv + ["--device-memory", str((need + 2**20) / 2**30)]) == 0
    assert "fits:" in capsys.readouterr().out
    have = need - 2**20
    assert cli.main(argv + ["--device-memory", str(have / 2**30)]) == 2
    err = capsys.readouterr().err
    assert f"need {need / 2**30:.2f} GiB ({need} B) on each device, but a device holds" in err
