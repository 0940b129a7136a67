"""The serving loop: OpenAI / Anthropic APIs through deepseek-recipe on top of the engine."""
