"""`python -m dsjax.protocol > docs/api-fields.md`: the field table, rendered."""

from dsjax.protocol.field_table import markdown

print(markdown(), end="")
