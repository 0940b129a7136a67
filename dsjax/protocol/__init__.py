"""API requests -> engine requests -> API events. deepseek-recipe owns every conversion of
the Chat Completions, Responses and Anthropic Messages APIs: request -> conversation ->
prompt ids (its V4 encoding), and generated ids -> events (reasoning, DSML tool calls, JSON
output, stop sequences, finish reasons, usage). Nothing here renders a chat template or
parses model output; the legacy Completions API (a raw prompt, no conversation) is the one
shape written here, over `dsjax.output.TextRun` (stop strings, logprobs).

    job = prepare(CHAT, body, ctx)                 # APIError(status, message) on bad input
    job.choices[i]: prompt ids, SamplingParams, output constraint, a Translator
    translator.start() / .push(events) / .finish(reason) -> [(sse event name | None, json str)]
    translator.stopped: a stop sequence ended the answer (cancel the engine request)
    job.response([...translators]) -> the non-streaming JSON body
"""

from __future__ import annotations

from typing import Any

from dsjax.protocol.field_table import check_fields
from dsjax.protocol.completions import CompletionTranslator, prepare_completions
from dsjax.protocol.fields import (API, CHAT, COMPLETIONS, MESSAGES, MODEL_VERSIONS, RESPONSES, APIError, Choice,
                                  Context, Job, Limits, field_error)
from dsjax.protocol.recipe_apis import RecipeTranslator, callers_constraint, convert, count_tokens, prepare_recipe
from dsjax.protocol.tokens import detokenize, tokenize, tokenizer_info

__all__ = ["API", "CHAT", "COMPLETIONS", "MESSAGES", "MODEL_VERSIONS", "RESPONSES", "APIError", "Choice", "Context",
           "CompletionTranslator", "Job", "Limits", "RecipeTranslator", "callers_constraint", "convert",
           "count_tokens", "detokenize", "prepare", "tokenize", "tokenizer_info"]


def prepare(api: API, body: Any, ctx: Context) -> Job:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    if api is not COMPLETIONS and body.get("prompt_logprobs") is not None:  # never accepted and ignored
        raise field_error("prompt_logprobs", f"prompt_logprobs is served on /v1/completions only, not {api.path}")
    check_fields(api, body)  # every field honoured or refused by name (docs/api-fields.md)
    return prepare_completions(body, ctx) if api is COMPLETIONS else prepare_recipe(api, body, ctx)
