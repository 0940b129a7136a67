"""The layer schedule: what each decoder layer is (`LayerSpec`, with V4.1's cross-layer
`Sharing`) and the plan the decoder stores and scans (`LayerRun`s from `layer_runs`: a
period of layers repeated, each period position possibly an inner run of alike layers).
`ModelConfig.layers` / `.layer_runs` (dsjax/config/schema.py) build these from a config.
"""

from __future__ import annotations

import dataclasses

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
TOPK_MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, TOPK_MOE)

class ConfigError(ValueError):
    """A config field is missing, has the wrong type, or an inconsistent value."""


@dataclasses.dataclass(frozen=True)
class Sharing:
    """V4.1's cross-layer sharing for one compressed layer: the layers whose state it reads
    (its own index where it owns that part). Spec deepseek-v41.md §1.2."""

    kv_from: int  # whose compressed KV it attends (own: a KV source, with a compressor)
    topk_from: int  # whose top-k entry list it uses (own: an index source, with an indexer)
    index_keys_from: int  # whose index keys its indexer scores (own: it has wk / k_norm)
    candidates_from: int | None = None  # a restricted index source: the candidate source masking its scores
    publishes_candidates: bool = False  # the candidate source (V4.1: layer 20)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer is. V4 layers own all their state; a V4.1 compressed layer
    carries `sharing` (what it reads from earlier layers) and `engram` (an Engram update of
    the streams runs before the block)."""

    index: int
    attention: str  # SLIDING | CSA | HCA
    compress_ratio: int  # 0 for window-only layers
    mlp: str  # HASH_MOE | TOPK_MOE
    sharing: Sharing | None = None
    engram: bool = False

    @property
    def rope(self) -> str:
        return "main" if self.attention == SLIDING else "compress"

    @property
    def overlap(self) -> bool:  # V4's CSA pools overlapping windows (2m slots, stride m); V4.1 never overlaps
        return self.attention == CSA and self.sharing is None

    @property
    def has_indexer(self) -> bool:
        if self.sharing is not None:
            return self.sharing.topk_from == self.index
        return self.attention == CSA

    @property
    def has_compressor(self) -> bool:
        return self.compress_ratio > 0 and (self.sharing is None or self.sharing.kv_from == self.index)

    @property
    def has_index_keys(self) -> bool:
        """Owns index-key weights (V4: its indexer's own compressor; V4.1: wk / k_norm on the
        KV source's latents)."""
        if self.sharing is not None:
            return self.has_indexer and self.sharing.index_keys_from == self.index
        return self.has_indexer

    @property
    def role(self) -> tuple:
        """What the layer does with shared state, independent of where it sits: layers of the
        same kind and role have the same weights and cache shapes."""
        s = self.sharing
        if s is None:
            return ()
        return (s.kv_from == self.index, s.topk_from == self.index, s.index_keys_from == self.index,
                s.candidates_from is not None, s.publishes_candidates)


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """`repeats` consecutive copies of a period of layers. Period position j is `inner[j]`
    consecutive alike layers (`layers[j]`: the first copy's first one), so V4.1's
    [KV source, 5 consumers] is a period of two positions, inner (1, 5). The decoder stores
    each position's weights and cache with a leading [repeats * inner[j]] axis (repeat-major)
    and `lax.scan`s over it, so a program holds one body per position, not every layer."""

    layers: tuple[LayerSpec, ...]
    repeats: int
    inner: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.inner:
            object.__setattr__(self, "inner", (1,) * len(self.layers))

    @property
    def first(self) -> int:
        return self.layers[0].index

    @property
    def period(self) -> int:
        """Layers in one copy of the period."""
        return sum(self.inner)

    def __len__(self) -> int:
        return self.period * self.repeats

    def _offset(self, j: int) -> int:
        return sum(self.inner[:j])

    def index_of(self, r: int, j: int, i: int = 0) -> int:
        """The layer index of repeat r, period position j, inner copy i."""
        return self.first + r * self.period + self._offset(j) + i

    def layer(self, r: int, j: int, i: int = 0) -> LayerSpec:
        """The spec of repeat r, period position j, inner copy i (with its own index and the
        sharing indices of that copy: an in-period source moves with the copy, a source in an
        earlier run does not)."""
        spec, index = self.layers[j], self.index_of(r, j, i)
        if spec.sharing is None:
            return dataclasses.replace(spec, index=index)

        def moved(src):
            return src + r * self.period if src is not None and src >= self.first else src
        s = spec.sharing
        return dataclasses.replace(spec, index=index, sharing=dataclasses.replace(
            s, kv_from=moved(s.kv_from), topk_from=moved(s.topk_from), index_keys_from=moved(s.index_keys_from),
            candidates_from=moved(s.candidates_from)))

    def slot(self, index: int) -> tuple[int, int] | None:
        """(period position j, position along its stacked axis) of layer `index`, or None."""
        offset = index - self.first
        if not 0 <= offset < len(self):
            return None
        r, within = divmod(offset, self.period)
        for j, n in enumerate(self.inner):
            if within < n:
                return j, r * n + within
            within -= n
        raise AssertionError("unreachable")

    @property
    def indices(self) -> tuple[tuple[int, ...], ...]:
        """Per period position j, the layer indices it stacks (repeat-major)."""
        return tuple(tuple(self.index_of(r, j, i) for r in range(self.repeats) for i in range(self.inner[j]))
                     for j in range(len(self.layers)))


def _kind(layer: LayerSpec):
    return layer.attention, layer.mlp, layer.compress_ratio, layer.role


def _units(layers: tuple[LayerSpec, ...], merge: bool) -> list[tuple[LayerSpec, int]]:
    """Consecutive alike layers reading the same sources as (first spec, count) (merge=False:
    every layer its own). An Engram layer always starts a unit."""
    units: list[tuple[LayerSpec, int]] = []
    for layer in layers:
        prev = units[-1][0] if units else None
        if (merge and prev is not None and not layer.engram and _kind(prev) == _kind(layer)
                and layer.sharing is not None and not layer.has_compressor and not layer.has_indexer
                and layer.sharing == prev.sharing):
            units[-1] = (prev, units[-1][1] + 1)
        else:
            units.append((layer, 1))
    return units


def _unit_key(unit: tuple[LayerSpec, int], copy_start: int, run_start: int):
    """What must match between copies of a period: kind, inner count, Engram, and each
    source as an offset within the copy, or an absolute layer before the run (None: the
    source lies in an earlier copy of the same run, which a scan cannot pass)."""
    spec, count = unit
    sources = ()
    if spec.sharing is not None:
        s = spec.sharing
        for src in (s.kv_from, s.topk_from, s.index_keys_from, s.candidates_from):
            if src is None or src == spec.index:
                sources += ("own" if src is not None else None,)
            elif src >= copy_start:
                sources += (("in-copy", src - copy_start),)
            elif src < run_start:
                sources += (("before", src),)
            else:
                return None
    return _kind(spec), count, spec.engram, sources


def layer_runs(layers: tuple[LayerSpec, ...], max_period: int = 4, merge_alike: bool = False) -> tuple[LayerRun, ...]:
    """Greedy over units (merge_alike: runs of consecutive alike layers reading the same
    sources, each a period position with an inner count; else single layers): at each
    position the period p in 1..max_period whose repetition covers the most layers with
    repeats >= 2 (ties: the shorter period); else a single unit. Copies must match in kind
    (attention, mlp, ratio, sharing role: same weights and cache shapes) and in where their
    shared state comes from (earlier in the same copy, or a layer before the run: what the
    scanned decoder can pass). An Engram layer never sits inside a repeated period."""
    units = _units(layers, merge_alike)
    starts = [u[0].index for u in units]

    def keys(i, p, run_start):
        out = [_unit_key(u, starts[i], run_start) for u in units[i:i + p]]
        return None if None in out or any(u[0].engram for u in units[i:i + p]) else out

    runs, i, n = [], 0, len(units)
    while i < n:
        best_p, best_r = 1, 1
        for p in range(1, max_period + 1):
            if i + p > n:
                break
            kinds = keys(i, p, starts[i])
            r = 1
            while kinds is not None and i + (r + 1) * p <= n and keys(i + r * p, p, starts[i]) == kinds:
                r += 1
            covered = r * sum(u[1] for u in units[i:i + p])
            if r >= 2 and covered > best_r * sum(u[1] for u in units[i:i + best_p]):
                best_p, best_r = p, r
        period = units[i:i + best_p]
        runs.append(LayerRun(tuple(u[0] for u in period), best_r, tuple(u[1] for u in period)))
        i += best_p * best_r
    _check_sharing(tuple(runs), layers)
    return tuple(runs)


def _check_sharing(runs: tuple[LayerRun, ...], layers: tuple[LayerSpec, ...]) -> None:
    """Every stacked copy of a period position is exactly the layer it stands for."""
    for run in runs:
        for r in range(run.repeats):
            for j in range(len(run.layers)):
                for i in range(run.inner[j]):
                    spec = run.layer(r, j, i)
                    if spec != layers[spec.index]:
                        raise ConfigError(f"layer {spec.index}'s sharing cannot be scanned in the layer plan "
                                          f"(planned as {spec}, is {layers[spec.index]})")
