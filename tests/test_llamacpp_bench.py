"""benchmarks/llamacpp's parsing and config derivation, and benchmarks/machine.py's CPU record:
pure functions on canned text (the llama.cpp build and runs are never part of the suite)."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module(name, path):
    sys.path[:0] = [str(ROOT / "benchmarks")]
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16
processor\t: 1
model name\t: AMD EPYC 9R14
flags\t\t: fpu
"""


def test_cpu_info_names_the_model_and_its_features():
    machine = _module("bench_machine", "benchmarks/machine.py")
    info = machine.cpu_info(CPUINFO)
    assert info["model"] == "AMD EPYC 9R14"
    assert info["features"] == {"avx2": True, "fma": True, "avx512f": True, "avx512_bf16": True,
                                "amx_tile": False, "amx_bf16": False}
    assert set(machine.cpu_info()["features"]) == set(machine.FEATURES)  # this machine's, whatever it is


def test_llama_bench_and_batched_bench_outputs_parse():
    bench = _module("llamacpp_bench", "benchmarks/llamacpp/bench.py")
    text = json.dumps([{"n_prompt": 128, "n_gen": 0, "n_depth": 0, "avg_ts": 3000.5, "samples_ts": [3000.5],
                        "type_k": "f16"},
                       {"n_prompt": 0, "n_gen": 64, "n_depth": 128, "avg_ts": 200.0, "samples_ts": [190, 210]}])
    tests = bench.parse_llama_bench(text)
    assert [t["test"] for t in tests] == ["pp128", "tg64@d128"]
    assert tests[0]["tokens_per_s"] == 3000.5 and tests[1]["samples"] == [190.0, 210.0]
    lines = ("main: n_kv_max = 1536\n"
             '{"pp": 128, "tg": 64, "pl": 1, "speed_pp": 2000.0, "speed_tg": 210.5}\n'
             '{"pp": 128, "tg": 64, "pl": 8, "speed_pp": 3300.0, "speed_tg": 540.0}\n')
    assert [(r["pl"], r["speed_tg"]) for r in bench.parse_batched_bench(lines)] == [(1, 210.5), (8, 540.0)]


def test_release_config_derives_the_converter_keys():
    convert = _module("llamacpp_convert", "benchmarks/llamacpp/convert.py")
    hf = {"layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                          "heavily_compressed_attention"],
          "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
          "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
          "rope_parameters": {"main": {"rope_theta": 10000.0},
                              "compress": {"rope_theta": 160000.0, "factor": 16.0, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "original_max_position_embeddings": 65536}}}
    out = convert.release_config(hf)
    assert out["compress_ratios"] == [0, 0, 4, 128] and out["num_hash_layers"] == 2
    assert out["rope_scaling"]["type"] == "yarn" and out["rope_scaling"]["factor"] == 16.0
    assert out["compress_rope_theta"] == 160000.0 and out["rope_theta"] == 10000.0
    assert convert.release_name("model.layers.3.attn.norm.weight") == "layers.3.attn.kv_norm.weight"
    assert convert.release_name("model.hc_head.hc_fn") == "hc_head_fn"
    assert convert.release_name("model.layers.3.attn.compressor.norm.weight") == "layers.3.attn.compressor.norm.weight"
