"""Every request field of the four generation APIs and what dsjax does with it, in one table:

    honoured   it does what the API says (the row names the test in tests/ that shows it)
    refused    a 400 naming it, unless its value asks for nothing (the API's default)
    metadata   accepted; it describes the request and changes no token (user ids, tags)

A field no row names is refused as unknown, so nothing is accepted and silently ignored.
docs/api-fields.md is this table rendered (`python -m dsjax.protocol > docs/api-fields.md`;
tests/test_serving_fields.py checks it is current, and checks every row).
"""

from __future__ import annotations

import dataclasses
import json

from dsjax.protocol.fields import API, CHAT, COMPLETIONS, MESSAGES, RESPONSES, field_error

HONOURED, REFUSED, METADATA = "honoured", "refused", "metadata"


@dataclasses.dataclass(frozen=True)
class Field:
    status: str
    note: str
    test: str = ""  # honoured: "file::function" of the test that shows it
    probe: object = None  # refused: a value that asks for something (the tests send it); metadata: a sample value
    benign: tuple = (None,)  # refused: values that ask for nothing and pass


def _h(note: str, test: str) -> Field:
    return Field(HONOURED, note, test)


def _r(note: str, probe, benign: tuple = (None,)) -> Field:
    return Field(REFUSED, note, probe=probe, benign=benign)


def _m(note: str, probe) -> Field:
    return Field(METADATA, note, probe=probe)


S, F = "test_serving.py::", "test_serving_fields.py::"
CONVERSION = "deepseek-recipe's conversion into the prompt"
SAMPLING = F + "test_sampling_fields_reach_the_engine"
VLLM = " (vLLM's extension)"

_COMMON_OPENAI = {
    "model": _h("the served name (`--served-model-name`); another is a 404", S + "test_bad_requests_get_the_right_json_error"),
    "stream": _h("server-sent events in the API's chunk shape", S + "test_chat_stream_equals_non_stream_and_seeds_repeat"),
    "temperature": _h("0 is greedy in any mode; thinking mode otherwise samples at 1.0 (the recipe)", SAMPLING),
    "top_p": _h("nucleus sampling", SAMPLING),
    "seed": _h("per request: the same seed, the same tokens whatever else runs", S + "test_seeded_sampling_is_independent_of_other_traffic"),
    "presence_penalty": _h("OpenAI's form, on generated tokens", SAMPLING),
    "frequency_penalty": _h("OpenAI's form, on generated tokens", SAMPLING),
    "logit_bias": _h("added to the logits in the jitted sampler (at most 300 tokens)", S + "test_logit_bias_bans_and_forces_tokens"),
    "n": _h("samples per prompt; choice k is the request with seed + k", S + "test_n_samples_share_the_prefill_and_each_is_its_seeds_request"),
    "stream_options": _h("include_usage: a last chunk with the usage", S + "test_n_samples_share_the_prefill_and_each_is_its_seeds_request"),
    "top_k": _h("top-k sampling" + VLLM, SAMPLING),
    "min_p": _h("min-p sampling" + VLLM, SAMPLING),
    "repetition_penalty": _h("HF / CTRL form, on prompt and generated tokens" + VLLM, SAMPLING),
    "user": _m("an end-user id for the caller's own records", "user-1"),
    "service_tier": _m("one tier here: every request is served alike", "default"),
}

_OPENAI_METADATA = {  # Chat Completions and Responses alike
    "metadata": _m("tags for the caller's own records", {"team": "eval"}),
    "safety_identifier": _m("an end-user id for the caller's own records", "u-1"),
    "prompt_cache_key": _m("a routing hint; the prefix cache needs none (it matches prompts itself)", "k-1"),
}
_SEED_EXTENSION = _h("dsjax's extension, as on Chat Completions: the same seed, the same tokens", SAMPLING)

TABLE: dict[str, dict[str, Field]] = {
    CHAT.name: {
        **_COMMON_OPENAI,
        "messages": _h(CONVERSION + " (V4 / V4.1 encoding)", S + "test_chat_greedy_equals_generate_on_recipe_ids"),
        "max_tokens": _h("the most tokens to generate; default: what the context leaves", S + "test_chat_greedy_equals_generate_on_recipe_ids"),
        "max_completion_tokens": _h("the same as max_tokens (both: they must agree)", S + "test_max_completion_tokens_is_max_tokens"),
        "stop": _h("stop strings, cut from the text (the recipe's stream processor)", F + "test_stop_strings_end_the_answer"),
        "logprobs": _h("raw-distribution logprobs (servers started with --max-logprobs)", S + "test_chat_logprobs"),
        "top_logprobs": _h("the top n per token", S + "test_chat_logprobs"),
        "response_format": _h("json_schema / json_object / regex: compiled from the caller's schema", S + "test_json_object_is_an_object"),
        "tools": _h(CONVERSION + "; calls parsed back (DSML)", S + "test_tool_conversation_round_trip"),
        "tool_choice": _h("none / auto / required / a named function: a grammar over the calls", S + "test_tool_call_round_trip_with_strict_tools"),
        "parallel_tool_calls": _h("false: at most one call", S + "test_tool_call_round_trip_with_strict_tools"),
        "thinking": _h("DeepSeek's {type: enabled | disabled}; default --thinking-default", S + "test_thinking_splits_reasoning_from_content"),
        "reasoning_effort": _h(CONVERSION + " (thinking mode and its effort)", F + "test_reasoning_effort_reaches_the_prompt"),
        **_OPENAI_METADATA,
        "prediction": _m("a latency hint (predicted output); the tokens are the same without it",
                         {"type": "content", "content": "x"}),
        "store": _r("this server stores no completions", True, (None, False)),
        "audio": _r("audio output is not supported", {"voice": "alloy", "format": "wav"}),
        "modalities": _r("text output only", ["text", "audio"], (None, ["text"])),
        "web_search_options": _r("web search is not supported", {}),
        "verbosity": _r("not supported (ask for brevity in the prompt)", "low", (None, "medium")),
        "functions": _r("deprecated by OpenAI: send `tools`", [{"name": "f", "parameters": {"type": "object"}}]),
        "function_call": _r("deprecated by OpenAI: send `tool_choice`", "auto"),
        "ignore_eos": _r("a chat turn ends at its end-of-turn token (use /v1/completions)", True, (None, False)),
        "stop_token_ids": _r("chat answers end at stop strings (`stop`); token ids on /v1/completions", [5], (None, [])),
    },
    COMPLETIONS.name: {
        **_COMMON_OPENAI,
        "prompt": _h("a string, token ids, or a list of either (one choice each)", S + "test_completions_text_ids_stop_and_batch"),
        "max_tokens": _h("the most tokens to generate (default 16); 0 with echo / prompt_logprobs", S + "test_completions_text_ids_stop_and_batch"),
        "stop": _h("stop strings, cut from the text", S + "test_completions_text_ids_stop_and_batch"),
        "logprobs": _h("the top n per token (servers started with --max-logprobs)", S + "test_completions_echo_returns_the_prompt_logprobs"),
        "echo": _h("the prompt before the answer (with logprobs: its tokens' too)", S + "test_completions_echo_returns_the_prompt_logprobs"),
        "prompt_logprobs": _h("each prompt token's logprob, rank and top n" + VLLM, S + "test_completions_echo_returns_the_prompt_logprobs"),
        "ignore_eos": _h("generate past EOS" + VLLM, SAMPLING),
        "stop_token_ids": _h("ids that end the answer" + VLLM, SAMPLING),
        "best_of": _r("only best_of = 1 (sample n and rank them by their logprobs)", 2, (None, 1)),
        "suffix": _r("fill in the middle is not supported", "x", (None, "")),
    },
    RESPONSES.name: {
        "model": _COMMON_OPENAI["model"],
        "stream": _h("server-sent events (response.* events)", S + "test_responses_api"),
        "temperature": _COMMON_OPENAI["temperature"], "top_p": _COMMON_OPENAI["top_p"],
        "seed": _SEED_EXTENSION,
        "input": _h(CONVERSION, S + "test_responses_api"),
        "instructions": _h(CONVERSION + " (a system message)", F + "test_instructions_and_system_reach_the_prompt"),
        "max_output_tokens": _h("the most tokens to generate", S + "test_responses_api"),
        "reasoning": _h("effort (\"none\": thinking off)", S + "test_responses_api"),
        "tools": _h(CONVERSION + "; calls parsed back", F + "test_responses_tools_reach_the_prompt"),
        "tool_choice": _h("none / auto / required / a named function", F + "test_responses_tools_reach_the_prompt"),
        "parallel_tool_calls": _h("false: at most one call", F + "test_responses_tools_reach_the_prompt"),
        "text": _h("format: json_schema / json_object, compiled from the caller's schema", S + "test_the_grammar_is_compiled_from_the_callers_schema"),
        "top_logprobs": _r("logprobs are served on Chat Completions and Completions", 2, (None, 0)),
        "user": _COMMON_OPENAI["user"], "service_tier": _COMMON_OPENAI["service_tier"],
        **_OPENAI_METADATA,
        "truncation": _r("the context is never truncated (a long input is a 400)", "auto", (None, "disabled")),
        "previous_response_id": _r("this server stores no responses (send the conversation in `input`)", "resp_1"),
        "conversation": _r("this server stores no conversations (send them in `input`)", "conv_1"),
        "store": _r("this server stores no responses", True, (None, False)),
        "background": _r("no background responses (stream instead)", True, (None, False)),
        "include": _r("no extra outputs to include", ["reasoning.encrypted_content"], (None, [])),
        "max_tool_calls": _r("not supported (end the loop on your side)", 3),
        "prompt": _r("stored prompt templates are not supported", {"id": "pmpt_1"}),
        "stream_options": _r("no stream options on this API here", {"include_obfuscation": False}),
    },
    MESSAGES.name: {
        "model": _COMMON_OPENAI["model"],
        "messages": _h(CONVERSION, S + "test_anthropic_messages"),
        "system": _h(CONVERSION + " (the system prompt)", F + "test_instructions_and_system_reach_the_prompt"),
        "max_tokens": _h("required: the most tokens to generate", S + "test_anthropic_messages"),
        "stream": _h("server-sent events (message_* events)", S + "test_anthropic_messages"),
        "temperature": _COMMON_OPENAI["temperature"], "top_p": _COMMON_OPENAI["top_p"],
        "top_k": _h("top-k sampling", SAMPLING),
        "seed": _SEED_EXTENSION,
        "stop_sequences": _h("stop strings, cut from the text (stop_reason stop_sequence)", F + "test_stop_strings_end_the_answer"),
        "thinking": _h("enabled / disabled; budget_tokens bounds reasoning before a constrained answer", S + "test_reasoning_budget_leaves_the_answer_tokens"),
        "tools": _h(CONVERSION + "; tool_use blocks parsed back", S + "test_anthropic_tool_choice_any_calls_a_tool"),
        "tool_choice": _h("auto / any / tool / none; disable_parallel_tool_use", S + "test_anthropic_tool_choice_any_calls_a_tool"),
        "metadata": _m("user_id for the caller's own records", {"user_id": "u-1"}),
        "service_tier": _m("one tier here: every request is served alike", "auto"),
        "container": _r("no code-execution containers", "c-1"),
        "mcp_servers": _r("no MCP servers are called", [{"type": "url", "url": "http://x", "name": "x"}], (None, [])),
        "context_management": _r("the context is never edited", {"edits": []}),
    },
}


def check_fields(api: API, body: dict) -> None:
    """Refuse (400, by name) a field the table does not know, or a refused one that asks for
    something."""
    table = TABLE[api.name]
    for key, value in body.items():
        row = table.get(key)
        if row is None:
            raise field_error(key, f"not a field of the {api.path} API as this server implements it "
                                   f"(docs/api-fields.md lists them)")
        if row.status == REFUSED and value not in row.benign:
            raise field_error(key, row.note)


def markdown() -> str:
    """docs/api-fields.md: the table, one section per API."""
    out = ["# API fields", "", "Every request field of the generation endpoints and what `dsjax serve` does with it",
           "(rendered from `dsjax/protocol/field_table.py`; a field not listed is a 400 naming it).", "",
           "- honoured: it does what the API says; the test that shows it is named.",
           "- refused: a 400 naming the field, unless its value asks for nothing (shown).",
           "- metadata: accepted; it changes no token.", ""]
    for api in (CHAT, COMPLETIONS, RESPONSES, MESSAGES):
        out += [f"## `{api.path}`", "", "| field | | what dsjax does |", "|---|---|---|"]
        for key, row in sorted(TABLE[api.name].items()):
            what = row.note
            if row.status == HONOURED:
                what += f" (`{row.test.split('::')[1]}`)"
            elif row.status == REFUSED and row.benign != (None,):
                what += "; passes: " + ", ".join(json.dumps(b) for b in row.benign)
            out.append(f"| `{key}` | {row.status} | {what.replace('|', '/')} |")
        out.append("")
    return "\n".join(out)

