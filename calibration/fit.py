"""Fit a FittedCostModel to profiled steps with non-negative least squares.

Input rows carry the batch features of engine.core.batch_features (as in the engine's step log)
and the measured step time. Non-negativity keeps every term physical (more work never makes a
step faster) and the hinge terms give the token term its roofline shape: flat while the step is
bound by reading weights, then rising once GEMMs become compute-bound.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import nnls

from sim.cost_model import FittedCostModel

# Hinges at 2, 4 and 8 let a CPU step's token term stay flat from 2 to 4 decodes and then rise
# (measured on a quiet Xeon: 52.5 / 56.3 / 55.6 / 69.6 / 90.3 ms at 1 / 2 / 4 / 8 / 16 decodes);
# with the first hinge at 16 the fit ran 3 to 6 decodes 2-7% slow. nnls leaves unused ones at 0.
DEFAULT_KNOTS = (2, 4, 8, 16, 64, 128, 256, 512, 1024, 2048, 4096)
# Caps of the saturating terms min(tokens, cap): the concave start of a CPU step's token term
# (one token: matrix-vector kernels; a few: packed GEMMs whose cost grows slowly at first).
DEFAULT_CAPS = (2, 4, 8, 16, 32)
FEATURES = ("num_reqs", "num_tokens", "num_prefill_reqs", "prefill_attn_pairs",
            "prefill_context_tokens", "decode_context_tokens")


def design_matrix(rows: Sequence[dict], knots: Sequence[float], caps: Sequence[float] = ()) -> np.ndarray:
    cols = {k: np.asarray([r[k] for r in rows], dtype=float) for k in FEATURES}
    tok = cols["num_tokens"]
    X = [np.ones_like(tok), cols["num_reqs"], tok]
    X += [np.maximum(0.0, tok - k) for k in knots]
    X += [np.minimum(tok, c) for c in caps]
    X += [cols["num_prefill_reqs"], cols["prefill_attn_pairs"], cols["prefill_context_tokens"],
          cols["decode_context_tokens"]]
    return np.stack(X, axis=1)


def _solve(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error, then every coefficient times one factor so
    that the predictions of the rows add up to their measured sum (sum_scale)."""
    return _solve_scaled(X, y)[0]


def _solve_scaled(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """_solve's coefficients and the sum_scale factor they were multiplied by."""
    coef = _solve_relative(X, y)
    factor = sum_scale(X @ coef, y)
    return coef * factor, factor


def _solve_relative(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    # Relative error matters (a 2 ms step and a 200 ms step should both fit well): weight rows
    # by 1/y; scale columns so nnls is well conditioned.
    w = 1.0 / np.maximum(y, 1e-9)
    scale = np.maximum(np.abs(X).max(axis=0), 1e-12)
    coef, _ = nnls((X / scale) * w[:, None], y * w, maxiter=50 * X.shape[1])
    return coef / scale


def sum_scale(pred: np.ndarray, y: np.ndarray) -> float:
    """The factor that makes predictions unbiased as a sum: measured sum over predicted sum.

    A fit on relative error is short as a sum of step times: minimising sum((p / y - 1)^2) over
    noisy y lands below the typical y (a step measured slow weighs less than one measured fast),
    and what a simulation adds up is time. On a 2-core VM's calibration the relative fit summed
    to 0.966 of the measured time of its own decode-only steps and 0.958 of its steps with a
    prefill chunk (docs/reports/2026-12-04-whatif-settings.md), and in that VM's validations the
    simulated steps with a prefill chunk came out 5.0% short on average. One factor for all
    coefficients keeps each term non-negative and each step's shape (how time grows with tokens,
    requests and context) as the fit found it."""
    p = float(np.sum(pred))
    return float(np.sum(y)) / p if p > 0 else 1.0


def _model(coef: np.ndarray, knots: Sequence[float], metadata: dict | None = None,
           caps: Sequence[float] = ()) -> FittedCostModel:
    nk, nc = len(knots), len(caps)
    rest = coef[3 + nk + nc:]
    return FittedCostModel(
        intercept_s=float(coef[0]), per_req_s=float(coef[1]), per_token_s=float(coef[2]),
        hinges=[(float(k), float(s)) for k, s in zip(knots, coef[3:3 + nk]) if s > 0],
        saturations=[(float(c), float(s)) for c, s in zip(caps, coef[3 + nk:3 + nk + nc]) if s > 0],
        per_prefill_req_s=float(rest[0]), per_prefill_pair_s=float(rest[1]),
        per_prefill_ctx_s=float(rest[2]), per_decode_ctx_s=float(rest[3]),
        metadata=dict(metadata or {}))


def _terms(rows, knots, caps) -> tuple[list, list]:
    """The hinge knots and saturation caps below the largest step of the rows (unless given)."""
    max_tok = max(r["num_tokens"] for r in rows)
    knots = [k for k in DEFAULT_KNOTS if k < max_tok] if knots is None else list(knots)
    caps = [c for c in DEFAULT_CAPS if c < max_tok] if caps is None else list(caps)
    return knots, caps


def fit_plain(rows: Sequence[dict], times_s: Sequence[float]) -> FittedCostModel:
    """The same least-squares fit as fit_cost_model, without its cross-validation and residuals
    (a fit used only to predict, e.g. on held-out settings)."""
    knots, caps = _terms(rows, None, None)
    return _model(_solve(design_matrix(rows, knots, caps), np.asarray(times_s, dtype=float)), knots, None, caps)


def fit_cost_model(rows: Sequence[dict], times_s: Sequence[float], knots: Sequence[float] | None = None,
                   metadata: dict | None = None, folds: int = 5, seed: int = 0,
                   groups: Sequence | None = None, caps: Sequence[float] | None = None) -> FittedCostModel:
    """Fit, then report cross-validated error and out-of-sample residual quantiles in the model.

    With `groups` (one label per row: the sweep group a step came from), cross-validation leaves
    one group out at a time, so a held-out step never has near-duplicates (its neighbours of the
    same batch shape) in the training data: this is the error a step of an unseen composition
    should expect, and it exposes overfitting that random k-fold over near-duplicate steps hides.
    Without groups, contiguous blocks of rows are held out (blocked k-fold).

    `residual_quantiles` are quantiles of the out-of-sample relative residuals (prediction /
    measurement - 1), `residual_quantiles_by_kind` the same for steps with a prefill chunk
    ("prefill") and decode-only steps ("decode"), each kind with at least MIN_KIND_RESIDUALS
    steps; metadata["cv"] says how they were obtained, and metadata["cv_group_bias"]
    lists each held-out group's mean relative residual (the spread of systematic error between
    regimes, which prediction intervals use). With `groups`, `noise_quantiles` and
    `noise_quantiles_by_kind` are the same residuals with each group's mean (per kind of step)
    taken out: the scatter of one step around its regime, which simulated steps draw from.
    """
    y = np.asarray(times_s, dtype=float)
    if len(rows) != len(y) or len(y) < 8:
        raise ValueError(f"fit_cost_model: need >= 8 rows with one time each, got {len(rows)} rows, {len(y)} times")
    knots, caps = _terms(rows, knots, caps)
    X = design_matrix(rows, knots, caps)
    coef, scaled_by = _solve_scaled(X, y)
    model = _model(coef, knots, metadata, caps)
    pred = X @ _coef_vector(model, knots, caps)
    rel = (pred - y) / y

    if groups is not None:
        if len(groups) != len(y):
            raise ValueError(f"fit_cost_model: {len(groups)} group labels for {len(y)} rows")
        labels = np.asarray([str(g) for g in groups])
        held = [labels == g for g in dict.fromkeys(labels)]
        how = f"leave-one-group-out over {len(held)} sweep groups"
    else:
        blocks = np.array_split(np.arange(len(y)), folds)
        held = [np.isin(np.arange(len(y)), b) for b in blocks]
        how = f"blocked {folds}-fold (contiguous rows held out)"
    cv_rel = np.full_like(y, np.nan)
    group_bias = []
    for test in held:
        train = ~test
        if train.sum() < X.shape[1] or not test.any():
            continue
        c = _solve(X[train], y[train])
        cv_rel[test] = (X[test] @ c - y[test]) / y[test]
        group_bias.append(float(np.mean(cv_rel[test])))
    ok = ~np.isnan(cv_rel)
    prefill = np.asarray([r["num_prefill_reqs"] > 0 for r in rows])[ok]
    cv_rel = cv_rel[ok]
    model.residual_quantiles = _quantiles(cv_rel)
    # Per kind of step: a prefill chunk's time scatters less around the fit than a small decode
    # step's (and the mean ratio measured/predicted differs with it), so a simulated step draws
    # its noise from its own kind's residuals where the sweep has enough of them.
    model.residual_quantiles_by_kind = _quantiles_by_kind(cv_rel, prefill)
    # A step's noise, apart from its regime's systematic error: the same out-of-sample residuals,
    # each step's ratio measured/predicted divided by the mean ratio of its group's steps of its
    # kind. The residuals mix the two, and a simulated step that draws from them repeats its
    # regime's error as random scatter, which widens latency tails and, through the mean of the
    # ratio, lengthens every step; the regimes' error is in the intervals (cv_group_bias).
    noise = _within_group_residuals(cv_rel, labels[ok] if groups is not None else None, prefill)
    noise_scale = None
    if noise is not None:
        model.noise_quantiles = _quantiles(noise[~np.isnan(noise)])
        model.noise_quantiles_by_kind = _quantiles_by_kind(noise, prefill)
        noise_scale = sum_unbiased_noise(model, pred[ok], y[ok], prefill)
    model.metadata.update({
        "num_samples": int(len(y)),
        "fit_mape": float(np.mean(np.abs(rel))),
        "cv": how,
        "cv_mape": float(np.mean(np.abs(cv_rel))),
        "cv_p95_abs_rel_error": float(np.quantile(np.abs(cv_rel), 0.95)),
        "cv_group_bias": group_bias,
        "residual_quantiles_are": "out-of-sample (cross-validated) relative residuals, prediction/measured - 1",
        "sum_scale": scaled_by,
        "fit_is": "non-negative least squares on relative error, every coefficient then scaled so the "
                  "fitted steps' predicted time adds up to their measured time (calibration.fit.sum_scale)",
    })
    if noise is not None:
        model.metadata["noise_quantiles_are"] = (
            "per-step noise: the out-of-sample residuals with each (sweep group, step kind)'s mean "
            f"ratio measured/predicted divided out (cells of >= {MIN_CELL_STEPS} steps), then each "
            "kind's ratio scaled by noise_sum_scale so that the fitted steps of the kind, predicted "
            "times the noise's mean, add up to their measured time")
        model.metadata["noise_sum_scale"] = noise_scale
    return model


def sum_unbiased_noise(model: FittedCostModel, pred: np.ndarray, y: np.ndarray, prefill: np.ndarray) -> dict:
    """Scale the noise quantiles of each kind of step (and the pooled ones) so that the fitted
    steps of that kind, each predicted times the mean ratio its noise draws, add up to their
    measured time. Returns the factors applied ({"prefill": c, "decode": c, "pooled": c}).

    The one factor of sum_scale leaves the kinds apart: on a 2-core VM's calibration the decode-
    only steps summed to 0.971 of their measured time and the steps with a prefill chunk to 1.009.
    A simulation adds up steps of both kinds, and validate's in-situ speed is read from the
    decode-only ones (a shortfall there reads as a slower machine and lengthens every other step
    by as much), so each kind's expected time must add up on its own."""
    from sim.intervals import quantiles_mean_ratio

    def rescaled(q: dict, sel: np.ndarray) -> tuple[dict, float]:
        expected = float(np.sum(pred[sel])) * quantiles_mean_ratio(q)
        c = float(np.sum(y[sel])) / expected if expected > 0 else 1.0
        return {k: (1.0 + r) / c - 1.0 for k, r in q.items()}, c

    factors = {}
    by_kind = dict(model.noise_quantiles_by_kind)
    for kind, sel in (("prefill", prefill), ("decode", ~prefill)):
        if kind in by_kind:
            by_kind[kind], factors[kind] = rescaled(by_kind[kind], sel)
    model.noise_quantiles_by_kind = by_kind
    model.noise_quantiles, factors["pooled"] = rescaled(model.noise_quantiles, np.ones_like(prefill, dtype=bool))
    return factors


MIN_CELL_STEPS = 5  # a (group, kind) cell with fewer steps has no mean to remove: left out of the noise


def _within_group_residuals(cv_rel: np.ndarray, labels, prefill: np.ndarray):
    """cv_rel (prediction/measured - 1) with each (group, kind) cell's mean ratio
    measured/predicted divided out: pred x mean / measured - 1, so that the ratio
    measured/predicted has mean 1 in every cell; NaN in cells of fewer than MIN_CELL_STEPS."""
    if labels is None:
        return None
    ratio = 1.0 / (1.0 + cv_rel)
    out = np.full_like(cv_rel, np.nan)
    for g in dict.fromkeys(labels):
        for kind in (True, False):
            sel = (labels == g) & (prefill == kind)
            if sel.sum() >= MIN_CELL_STEPS:
                out[sel] = np.mean(ratio[sel]) / ratio[sel] - 1.0
    return out if (~np.isnan(out)).sum() >= MIN_KIND_RESIDUALS else None


MIN_KIND_RESIDUALS = 20  # fewer steps of a kind: its steps draw from the pooled residuals


def _quantiles_by_kind(rel: np.ndarray, prefill: np.ndarray) -> dict[str, dict[str, float]]:
    """Quantiles of rel (NaN left out) for steps with a prefill chunk and decode-only steps, each
    kind with at least MIN_KIND_RESIDUALS values."""
    known = ~np.isnan(rel)
    return {k: _quantiles(rel[known & sel]) for k, sel in (("prefill", prefill), ("decode", ~prefill))
            if (known & sel).sum() >= MIN_KIND_RESIDUALS}


# Percent levels of the stored quantiles: every 5, and every 1 in the outer 5% at each end. A
# simulated step draws its ratio by interpolating between levels, so with p00 (the sweep's one
# most extreme step) next to p05 the outer 5% of draws spread evenly up to that extreme: on a
# quiet machine, 2.5% of simulated decode steps ran 1.5-2x long where 0.5% of the engine's did,
# which lifted ITL p90 at 60% load by 10-60% and the mean step by 2%.
QUANTILE_LEVELS = (0, 1, 2, 3, 4) + tuple(range(5, 96, 5)) + (96, 97, 98, 99, 100)


def _quantiles(rel: np.ndarray) -> dict[str, float]:
    return {f"p{q:02d}": float(np.quantile(rel, q / 100)) for q in QUANTILE_LEVELS}


def _coef_vector(m: FittedCostModel, knots: Sequence[float], caps: Sequence[float] = ()) -> np.ndarray:
    slopes, rises = dict(m.hinges), dict(m.saturations)
    return np.array([m.intercept_s, m.per_req_s, m.per_token_s] + [slopes.get(float(k), 0.0) for k in knots]
                    + [rises.get(float(c), 0.0) for c in caps]
                    + [m.per_prefill_req_s, m.per_prefill_pair_s, m.per_prefill_ctx_s, m.per_decode_ctx_s])
