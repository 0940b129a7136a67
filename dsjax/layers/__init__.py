"""The V4 math, one mechanism per file, as pure functions over pytree dataclasses."""
