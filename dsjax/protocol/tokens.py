"""vLLM's /tokenize, /detokenize and /tokenizer_info."""

from __future__ import annotations

from typing import Any


from dsjax.protocol.fields import APIError, CHAT, Context, field_error
from dsjax.protocol.recipe_apis import prepare_recipe


# --------------------------------------------------------------------------- /tokenize, /detokenize, /tokenizer_info
def _ids_field(value, param: str, ctx: Context) -> list[int]:
    if not (isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
        raise field_error(param, "a list of token ids")
    bad = [t for t in value if not 0 <= t < ctx.tokenizer.vocab_size]
    if bad:
        raise field_error(param, f"token id {bad[0]} is outside the vocabulary [0, {ctx.tokenizer.vocab_size})")
    return value


def tokenize(body: Any, ctx: Context) -> dict:
    """vLLM's /tokenize: {prompt, add_special_tokens (default true: BOS first, as a
    Completions text prompt gets), return_token_strs} or {messages, ...} (the prompt a Chat
    Completions request of them would have) -> {count, max_model_len, tokens, token_strs}."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    special, strs = body.get("add_special_tokens", True), body.get("return_token_strs", False)
    for key, value in (("add_special_tokens", special), ("return_token_strs", strs)):
        if not isinstance(value, bool):
            raise field_error(key, "must be a boolean")
    if "messages" in body:
        chat = {k: v for k, v in body.items() if k not in ("add_special_tokens", "return_token_strs",
                                                             "add_generation_prompt")}
        ids = prepare_recipe(CHAT, {"model": ctx.names[0], **chat}, ctx).choices[0].prompt
    elif isinstance(body.get("prompt"), str):
        bos = [ctx.tokenizer.bos_id] if special and ctx.tokenizer.bos_id is not None else []
        ids = bos + ctx.tokenizer.encode(body["prompt"])
    else:
        raise field_error("prompt", "a string (or messages, a chat to encode)")
    token_strs = [ctx.tokenizer.decode([t], skip_special_tokens=False) for t in ids] if strs else None
    return {"count": len(ids), "max_model_len": ctx.capacity, "tokens": ids, "token_strs": token_strs}


def detokenize(body: Any, ctx: Context) -> dict:
    """vLLM's /detokenize: {tokens} -> {prompt} (special tokens kept: the text of the ids)."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    ids = _ids_field(body.get("tokens"), "tokens", ctx)
    return {"prompt": ctx.tokenizer.decode(ids, skip_special_tokens=False)}


def tokenizer_info(ctx: Context) -> dict:
    """vLLM's /tokenizer_info: what a client needs to tokenize as the server does (lm-eval's
    remote tokenizer reads bos / eos / pad). No chat_template: the recipe encodes chats, and
    /tokenize with messages gives their ids."""
    tok = ctx.tokenizer
    name = lambda i: None if i is None else tok.decode([i], skip_special_tokens=False)  # noqa: E731
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(tok.bos_id), "eos_token": name(tok.eos_id),
            "pad_token": None, "model_max_length": ctx.capacity, "vocab_size": tok.vocab_size,
            "add_bos_token": True, "chat_template": None}
