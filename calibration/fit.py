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

DEFAULT_KNOTS = (16, 64, 128, 256, 512, 1024, 2048, 4096)
FEATURES = ("num_reqs", "num_tokens", "num_prefill_reqs", "prefill_attn_pairs",
            "prefill_context_tokens", "decode_context_tokens")


def design_matrix(rows: Sequence[dict], knots: Sequence[float]) -> np.ndarray:
    cols = {k: np.asarray([r[k] for r in rows], dtype=float) for k in FEATURES}
    tok = cols["num_tokens"]
    X = [np.ones_like(tok), cols["num_reqs"], tok]
    X += [np.maximum(0.0, tok - k) for k in knots]
    X += [cols["num_prefill_reqs"], cols["prefill_attn_pairs"], cols["prefill_context_tokens"],
          cols["decode_context_tokens"]]
    return np.stack(X, axis=1)


def _solve(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    # Relative error matters (a 2 ms step and a 200 ms step should both fit well): weight rows
    # by 1/y; scale columns so nnls is well conditioned.
    w = 1.0 / np.maximum(y, 1e-9)
    scale = np.maximum(np.abs(X).max(axis=0), 1e-12)
    coef, _ = nnls((X / scale) * w[:, None], y * w, maxiter=50 * X.shape[1])
    return coef / scale


def _model(coef: np.ndarray, knots: Sequence[float], metadata: dict | None = None) -> FittedCostModel:
    nk = len(knots)
    return FittedCostModel(
        intercept_s=float(coef[0]), per_req_s=float(coef[1]), per_token_s=float(coef[2]),
        hinges=[(float(k), float(s)) for k, s in zip(knots, coef[3:3 + nk]) if s > 0],
        per_prefill_req_s=float(coef[3 + nk]), per_prefill_pair_s=float(coef[4 + nk]),
        per_prefill_ctx_s=float(coef[5 + nk]), per_decode_ctx_s=float(coef[6 + nk]),
        metadata=dict(metadata or {}))


def fit_cost_model(rows: Sequence[dict], times_s: Sequence[float], knots: Sequence[float] | None = None,
                   metadata: dict | None = None, folds: int = 5, seed: int = 0) -> FittedCostModel:
    """Fit, then report k-fold cross-validated error and residual quantiles in the model."""
    y = np.asarray(times_s, dtype=float)
    if len(rows) != len(y) or len(y) < 8:
        raise ValueError(f"fit_cost_model: need >= 8 rows with one time each, got {len(rows)} rows, {len(y)} times")
    if knots is None:
        max_tok = max(r["num_tokens"] for r in rows)
        knots = [k for k in DEFAULT_KNOTS if k < max_tok]
    X = design_matrix(rows, knots)
    model = _model(_solve(X, y), knots, metadata)
    pred = X @ _coef_vector(model, knots)
    rel = (pred - y) / y

    # Cross-validation: the error a new step should expect.
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(y))
    cv_rel = np.empty_like(y)
    for f in range(folds):
        test = idx[f::folds]
        train = np.setdiff1d(idx, test)
        c = _solve(X[train], y[train])
        cv_rel[test] = (X[test] @ c - y[test]) / y[test]
    model.residual_quantiles = {f"p{q:02d}": float(np.quantile(rel, q / 100)) for q in (5, 25, 50, 75, 95)}
    model.metadata.update({
        "num_samples": int(len(y)),
        "fit_mape": float(np.mean(np.abs(rel))),
        "cv_mape": float(np.mean(np.abs(cv_rel))),
        "cv_p95_abs_rel_error": float(np.quantile(np.abs(cv_rel), 0.95)),
    })
    return model


def _coef_vector(m: FittedCostModel, knots: Sequence[float]) -> np.ndarray:
    slopes = dict(m.hinges)
    return np.array([m.intercept_s, m.per_req_s, m.per_token_s] + [slopes.get(float(k), 0.0) for k in knots]
                    + [m.per_prefill_req_s, m.per_prefill_pair_s, m.per_prefill_ctx_s, m.per_decode_ctx_s])
