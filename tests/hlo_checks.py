"""Reading a compiled program's HLO text in tests."""


def widened_outside(compiled, shape: tuple[int, ...]) -> list[str]:
    """The lines of a compiled program's top level (its ENTRY computation, outside any loop or
    conditional) that make a new fp32 array of `shape`: a stored (bf16) weight widened whole,
    where the program should read it inside its product. Parameters of that shape (an fp32
    argument) are not counted."""
    hlo = compiled.as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    text = "= f32[" + ",".join(map(str, shape)) + "]"
    return [line for line in entry.splitlines() if text in line and " parameter(" not in line]
