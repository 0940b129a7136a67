"""The oracle that a GGUF is the same model as dsjax's checkpoint: the same token ids through
llama.cpp (its C API via the sdist's ctypes bindings, `llama_cpp.llama_cpp`, on the libllama
built by build.sh) and through dsjax -> every position's logits compared, and greedy
continuations compared token by token.

    python benchmarks/llamacpp/agree.py --sdist SDIST --lib BIN --checkpoint CKPT --gguf X.gguf [--bf16-weights]

(SDIST: the unpacked llama-cpp-python sdist; BIN: where build.sh put libllama.so.)

`--bf16-weights` compares against dsjax's 16-bit weights (`dsjax.store_weights`), the model a
bf16 GGUF holds (the same matrices rounded to bf16; fp32 compute on both sides).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import types

import numpy as np


def bindings(sdist: str, lib: str):
    """The sdist's ctypes module `llama_cpp.llama_cpp` on `lib`/libllama.so, without the package's
    __init__ (the high-level wrapper and its dependencies are not needed)."""
    os.environ["LLAMA_CPP_LIB_PATH"] = lib
    if "llama_cpp" not in sys.modules:
        pkg = types.ModuleType("llama_cpp")
        pkg.__path__ = [os.path.join(sdist, "llama_cpp")]
        sys.modules["llama_cpp"] = pkg
    import llama_cpp.llama_cpp as ll

    return ll


class LlamaCpp:
    """One llama.cpp context on a GGUF: logits of a prompt's positions, greedy continuations."""

    def __init__(self, ll, gguf: str, n_ctx: int, threads: int = 2):
        self.ll = ll
        ll.llama_backend_init()
        mp = ll.llama_model_default_params()
        self.model = ll.llama_model_load_from_file(gguf.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_ctx, n_ctx
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = ll.llama_init_from_model(self.model, cp)
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))

    def _decode(self, tokens, start: int, all_logits: bool) -> np.ndarray:
        ll = self.ll
        batch = ll.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i] = t
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = all_logits or i == len(tokens) - 1
            batch.n_tokens = len(tokens)
            if ll.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            n = len(tokens) if all_logits else 1
            ptr = ll.llama_get_logits(self.ctx)
            return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                         shape=(n, self.n_vocab)).copy()
        finally:
            ll.llama_batch_free(batch)

    def prompt_logits(self, prompt) -> np.ndarray:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
        return self._decode(prompt, 0, True)

    def greedy(self, prompt, n: int) -> list[int]:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
        logits = self._decode(prompt, 0, False)[-1]
        out = []
        for i in range(n):
            out.append(int(np.argmax(logits)))
            if i + 1 < n:
                logits = self._decode([out[-1]], len(prompt) + i, False)[-1]
        return out

    def close(self):
        self.ll.llama_free(self.ctx)
        self.ll.llama_model_free(self.model)


def compare(llama_logits: np.ndarray, dsjax_logits: np.ndarray) -> dict:
    """Per-position agreement of two [S, vocab] logit arrays."""
    diff = np.abs(llama_logits - dsjax_logits)
    scale = np.abs(dsjax_logits).max(axis=-1)
    top_l, top_d = llama_logits.argmax(-1), dsjax_logits.argmax(-1)
    return {"positions": int(len(top_d)), "max_abs_logit_diff": float(diff.max()),
            "max_rel_logit_diff": float((diff.max(-1) / scale).max()),
            "mean_abs_logit_diff": float(diff.mean()), "max_abs_logit": float(scale.max()),
            "argmax_agreement": float((top_l == top_d).mean())}


def agreement(ll, checkpoint: str, gguf: str, *, bf16_weights: bool, prompt_len: int = 160, new_tokens: int = 32,
              threads: int = 2, seed: int = 1) -> dict:
    """dsjax vs llama.cpp on one random prompt: logits at every prompt position, greedy tokens."""
    import dsjax
    from dsjax.engine.engine import Engine
    from dsjax.engine.sampler import SamplingParams

    model = dsjax.load_model(checkpoint, dtype="float32")
    if bf16_weights:
        model = dsjax.store_weights(model)
    prompt = np.random.default_rng(seed).integers(3, model.config.vocab_size, prompt_len).tolist()
    ref_logits = np.asarray(model.logits([prompt])[0], np.float32)
    capacity = -(-(prompt_len + new_tokens) // 128) * 128
    ref_tokens = Engine(model, max_slots=1, capacity=capacity, prefill_chunk=prompt_len).generate(
        [prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))[0]
    llama = LlamaCpp(ll, gguf, n_ctx=capacity, threads=threads)
    try:
        out = compare(llama.prompt_logits(prompt), ref_logits)
        tokens = llama.greedy(prompt, new_tokens)
    finally:
        llama.close()
    same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
    out.update(prompt_len=prompt_len, greedy_tokens=new_tokens, greedy_tokens_equal_prefix=same,
               greedy_all_equal=tokens == list(ref_tokens), dsjax_weights="bf16" if bf16_weights else "float32")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", required=True)
    ap.add_argument("--lib", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--bf16-weights", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print(json.dumps(agreement(bindings(args.sdist, args.lib), args.checkpoint, args.gguf, bf16_weights=args.bf16_weights,
                               prompt_len=args.prompt_len, new_tokens=args.new_tokens, threads=args.threads)))


if __name__ == "__main__":
    main()
