"""Guards on the target's features before a drafter trains on them.

Why: peers' users trained for a day on hidden states a hybrid target returned as all zeros; the
loss fell anyway (the drafter learns from the token embeddings alone) and the drafter served at
about 0% acceptance. So the features are checked where they are made, per selected layer, and the
run stops with one line naming the shard, the layer and the statistic:

- finite: no NaN or infinity (checked per row, as each row is computed);
- alive: a row's features are not all zero (per row);
- varying: not one vector repeated across all of a shard's tokens (per shard: a row of one token
  repeated can legitimately give the same output at every position);
- in range: the layer's RMS within ``rms_range`` times the first shard's either way (a shard from
  another model, a broken node, features cast through the wrong dtype).

The per-layer statistics (:class:`FeatureStats`) are kept in each hidden shard's metadata, where
training and the report read them without touching the features.
"""
from __future__ import annotations

import json
from collections.abc import Callable

import torch

STATS_KEY = "feature_stats"  # the hidden shard's metadata entry (JSON) holding its summary
# What a training checks as it draws rows: a few positions of each row (a whole row's features
# would cost about a real step's time on the CPU), and a shard's statistics once this many of its
# rows were drawn where the hidden stage kept none (online; a cache written elsewhere)
GUARD_TOKENS = 16
GUARD_ROWS = 8


class FeatureError(ValueError):
    """The target's features are unusable: not finite, all zero, constant or out of range."""


class FeatureStats:
    """Running per-layer statistics of the features [T, k, H] of one shard's rows."""

    def __init__(self, layer_ids: list[int]):
        self.layer_ids = list(layer_ids)
        k = len(self.layer_ids)
        self.rows = self.tokens = 0
        self.sum_sq = torch.zeros(k, dtype=torch.float64)
        self.max_abs = torch.zeros(k, dtype=torch.float64)
        self.low: torch.Tensor | None = None  # [k, H] the smallest value of each feature so far
        self.high: torch.Tensor | None = None

    def add_row(self, feats: torch.Tensor, where: Callable[[], str]) -> None:
        """Add one row's features [T, k, H], stopping first if that row's are not finite or all zero
        in a layer; ``where()`` names the row (shard and record) in the error."""
        x = feats.detach().float()
        finite = torch.isfinite(x).flatten(2).all(-1).all(0)  # [k]
        max_abs = x.abs().flatten(2).amax(-1).amax(0)
        bad_finite, dead = (~finite).tolist(), (max_abs == 0).tolist()
        for j, layer in enumerate(self.layer_ids):
            if bad_finite[j]:
                count = int((~torch.isfinite(x[:, j])).sum())
                raise FeatureError(f"{where()}: target layer {layer}: {count} feature values are NaN or infinite: the "
                                   f"target's forward overflowed or the model is broken; check the target (a bfloat16 "
                                   f"model loaded in float16?) before training on it")
            if dead[j]:
                raise FeatureError(f"{where()}: target layer {layer}: the features are all zero (rms 0): the layer's "
                                   f"output was not captured (a hybrid target's kernels, a hook on the wrong module); "
                                   f"check target_layer_ids and the model before training on it")
        self.rows += 1
        self.tokens += x.shape[0]
        self.sum_sq += x.square().sum(dim=(0, 2)).double().cpu()
        self.max_abs = torch.maximum(self.max_abs, max_abs.double().cpu())
        low, high = x.amin(0).cpu(), x.amax(0).cpu()
        self.low = low if self.low is None else torch.minimum(self.low, low)
        self.high = high if self.high is None else torch.maximum(self.high, high)

    def summary(self) -> dict:
        """Per layer: ``rms``, ``max_abs`` and ``spread`` (the largest range of one feature across the
        tokens: 0 when every token has the same vector), and the tokens they cover."""
        H = self.low.shape[-1] if self.low is not None else 1
        rms = (self.sum_sq / max(self.tokens * H, 1)).sqrt()
        spread = (self.high - self.low).amax(-1) if self.low is not None else torch.zeros(len(self.layer_ids))
        return {"tokens": self.tokens, "layers": [
            {"layer": layer, "rms": float(rms[j]), "max_abs": float(self.max_abs[j]), "spread": float(spread[j])}
            for j, layer in enumerate(self.layer_ids)]}


def check_summary(summary: dict, where: str, reference: dict | None, rms_range: float,
                  reference_name: str = "") -> None:
    """Stop on a shard whose features are one vector repeated across its tokens, or whose RMS in a
    layer is more than ``rms_range`` times off ``reference``'s (another shard's summary; None: the
    shard is the reference)."""
    if summary["tokens"] < 2:
        return
    ref = {s["layer"]: s for s in reference["layers"]} if reference else {}
    for s in summary["layers"]:
        layer, rms = s["layer"], s["rms"]
        if s["spread"] <= 1e-6 * s["max_abs"]:
            raise FeatureError(f"{where}: target layer {layer}: the features are constant across "
                               f"{summary['tokens']} tokens (spread {s['spread']:.3g}, rms {rms:.3g}): the layer's "
                               f"output does not depend on the input; check the target and target_layer_ids")
        if rms_range and layer in ref and ref[layer]["rms"] > 0:
            ratio = rms / ref[layer]["rms"]
            if not 1 / rms_range <= ratio <= rms_range:
                raise FeatureError(f"{where}: target layer {layer}: rms {rms:.4g}, {ratio:.3g}x that of "
                                   f"{reference_name} ({ref[layer]['rms']:.4g}), outside train.feature_rms_range "
                                   f"({rms_range:g}): features of another model, or from a broken node? Rebuild "
                                   f"this shard's hidden states, or raise train.feature_rms_range if the data "
                                   f"really differ this much")


def summary_from_metadata(metadata: dict | None) -> dict | None:
    """A hidden shard's feature summary, None for a cache written before the guards."""
    text = (metadata or {}).get(STATS_KEY)
    return json.loads(text) if text else None


def layer_ranges(summaries: list[dict]) -> dict | None:
    """Shards' summaries in one, per layer: the lowest and highest RMS, the largest magnitude, the
    smallest spread (what a report shows; None without any)."""
    if not summaries:
        return None
    layers = {}
    for summary in summaries:
        for s in summary["layers"]:
            layer = layers.setdefault(s["layer"], {"layer": s["layer"], "rms_min": s["rms"], "rms_max": s["rms"],
                                                   "max_abs": s["max_abs"], "spread_min": s["spread"]})
            layer["rms_min"], layer["rms_max"] = min(layer["rms_min"], s["rms"]), max(layer["rms_max"], s["rms"])
            layer["max_abs"] = max(layer["max_abs"], s["max_abs"])
            layer["spread_min"] = min(layer["spread_min"], s["spread"])
    return {"shards": len(summaries), "tokens": sum(s["tokens"] for s in summaries), "layers": list(layers.values())}


class FeatureGuard:
    """A training's checks of the features it reads, shard by shard: each shard's statistics
    against the first shard's (the hidden stage's, before any step; or, where it kept none, those of
    the rows drawn so far), and every drawn row at ``GUARD_TOKENS`` positions."""

    def __init__(self, layer_ids: list[int], rms_range: float):
        self.layer_ids, self.rms_range = list(layer_ids), rms_range
        self.names: list[str] = []
        self.rows: list[int] = []
        self.captured: list[dict | None] = []
        self.drawn: list[FeatureStats] = []
        self.checked: list[bool] = []
        self.reference: tuple[dict, str] | None = None

    def add_shard(self, name: str, rows: int, captured: dict | None) -> None:
        """A shard of ``rows`` rows; ``captured``: the hidden stage's statistics of it, if kept."""
        self.names.append(name)
        self.rows.append(rows)
        self.captured.append(captured)
        self.drawn.append(FeatureStats(self.layer_ids))
        self.checked.append(False)
        if captured is not None:
            self._check(len(self.names) - 1, name, captured)

    def add_row(self, shard: int, feats: torch.Tensor, where: Callable[[], str]) -> None:
        at = torch.linspace(0, len(feats) - 1, min(len(feats), GUARD_TOKENS)).long().to(feats.device)
        drawn = self.drawn[shard]
        drawn.add_row(feats[at], where)
        if not self.checked[shard] and drawn.rows >= min(GUARD_ROWS, self.rows[shard]):
            self._check(shard, f"{self.names[shard]} (the first {drawn.rows} rows drawn)", drawn.summary())

    def _check(self, shard: int, where: str, summary: dict) -> None:
        if self.reference is None:
            self.reference = (summary, where)
        check_summary(summary, where, self.reference[0], self.rms_range, self.reference[1])
        self.checked[shard] = True

    def summary(self) -> dict | None:
        """Per target layer over the shards (``layer_ranges``): the hidden stage's statistics where it
        kept them, else those of the positions drawn."""
        summaries = [captured or drawn.summary() for captured, drawn in zip(self.captured, self.drawn)]
        return layer_ranges([s for s in summaries if s["tokens"]])
