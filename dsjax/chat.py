"""A conversation with a model, its prompts built by `deepseek-recipe` (no chat template here).

    chat = Chat(model, thinking=False)
    reply = chat.send("What is the capital of France?", on_delta=print)   # streams, keeps history
    reply.content, reply.reasoning_content, reply.prompt_ids

Each turn is a Chat Completions request body (the history + the new user message) converted
by the recipe (`ChatCompletionRequest.convert`: thinking mode, reasoning effort, sampling
defaults), encoded by `DeepseekV4Encoding` and generated on the engine; the generated ids go
back through the recipe's `StreamProcessor`, which splits reasoning from the answer. The
reply joins the history as an assistant message, and the recipe decides how earlier turns'
reasoning appears in the next prompt.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

import deepseek_recipe as recipe

from dsjax.api import Model
from dsjax.generate import plan
from dsjax.tokenizer import Tokenizer, load_tokenizer

MODEL_NAME = "DeepSeek-V4-Pro"  # a name the recipe maps to the V4 prompt encoding


@dataclasses.dataclass
class Reply:
    content: str
    reasoning_content: str | None
    prompt_ids: list[int]
    ids: list[int]  # generated, the final EOS included
    finish_reason: str | None


def _delta_of(event) -> dict:
    choices = json.loads(event.to_json()).get("choices") or [{}]
    return choices[0].get("delta") or {}


class Chat:
    """The conversation so far (`messages`, Chat Completions form) and how to continue it.

    thinking: the recipe's thinking mode (it then samples at temperature 1.0);
    reasoning_effort: "low" | "high" | "xhigh" | "max" (thinking mode). temperature / top_p /
    seed: None for the recipe's defaults. max_new_tokens bounds each answer."""

    def __init__(self, model: Model, tokenizer: Tokenizer | None = None, *, thinking: bool = False,
                 reasoning_effort: str | None = None, system: str | None = None, max_new_tokens: int = 256,
                 temperature: float | None = None, top_p: float | None = None, seed: int = 0):
        self.model, self.tokenizer = model, tokenizer or load_tokenizer(model)
        self.thinking, self.reasoning_effort = thinking, reasoning_effort
        self.max_new_tokens, self.temperature, self.top_p, self.seed = max_new_tokens, temperature, top_p, seed
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.encoding = recipe.DeepseekV4Encoding().with_tokenizer(self.tokenizer.recipe)

    def request(self, user_text: str):
        """The recipe's ConversationRequest for the history + this user message."""
        body = {"model": MODEL_NAME, "messages": [*self.messages, {"role": "user", "content": user_text}],
                "max_tokens": self.max_new_tokens, "thinking": {"type": "enabled" if self.thinking else "disabled"}}
        for key, value in (("reasoning_effort", self.reasoning_effort), ("temperature", self.temperature),
                           ("top_p", self.top_p), ("seed", self.seed)):
            if value is not None:
                body[key] = value
        return recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions())

    def send(self, user_text: str, on_delta: Callable[[str, str], None] | None = None) -> Reply:
        """Generate the assistant's answer to `user_text` and add both to the history.
        on_delta(kind, text) streams it: kind "reasoning" or "content"."""
        conv = self.request(user_text)
        prompt = self.encoding.encode(conv.conversation)
        opts = conv.inference_options
        max_new = conv.resolve_max_tokens(len(prompt), self.model.config.max_position_embeddings)
        p = plan(self.model, [prompt], max_new, temperature=opts.temperature, top_p=opts.top_p,
                 seed=self.seed if opts.seed is None else opts.seed)
        processor = recipe.StreamProcessor(recipe.ChatCompletionRequest.chunk_generator(conv, "dsjax-chat", MODEL_NAME),
                                           conv.parsing_options, self.tokenizer.recipe)
        parts = {"content": [], "reasoning_content": []}

        def take(events):
            for event in events:
                for key, kind in (("reasoning_content", "reasoning"), ("content", "content")):
                    text = _delta_of(event).get(key)
                    if text:
                        parts[key].append(text)
                        if on_delta is not None:
                            on_delta(kind, text)

        eos = set(self.model.config.eos_token_ids)
        take(processor.push(recipe.InferenceChunk.ready(prompt_usage=recipe.PromptUsage(prompt_tokens=len(prompt)))))

        def on_token(_index, event, _text):
            if not (event.finish_reason == "stop" and event.token in eos):  # the end of turn is not content
                take(processor.push(recipe.InferenceChunk.tokens([event.token])))

        (done,) = p.run_warm(self.model, on_token)
        reasons = recipe.InferenceFinishReason
        reason = reasons.Stop if done.finish_reason == "stop" else reasons.Length
        take(processor.push(recipe.InferenceChunk.finish(reason)))
        take(processor.finish())
        content = "".join(parts["content"])
        reasoning = "".join(parts["reasoning_content"]) if self.thinking else None
        self.messages.append({"role": "user", "content": user_text})
        answer = {"role": "assistant", "content": content}
        if reasoning is not None:
            answer["reasoning_content"] = reasoning
        self.messages.append(answer)
        return Reply(content, reasoning, prompt, done.ids, done.finish_reason)
