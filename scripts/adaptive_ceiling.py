"""How much any per-step budget choice could gain on a trace (issue #27's >= 1.05x criterion).

A trace (scripts/adaptive_bench.py trace) holds, at every position of every prompt's greedy
continuation, each choice's raw expected acceptance E (what a policy sees) and the drafts it would
accept (what happens). Against a step-time table this module bounds what choosing per step can
give over the best fixed choice:

- oracle: the choice made knowing each step's realised acceptance. At batch 1 the exact optimum
  (a dynamic program over positions: the least time from each position to the end); at larger
  batches the better of two greedy rules at each batch step (the most realised tokens per ms over
  the active rows; the most progress per ms of the row with the most positions left, which sets the
  batch's end), strong policies rather than a proven optimum.
- calibrated: the choice from E alone, with a calibration fitted on the same trace (realised
  acceptance averaged over quantile bins of E, per choice): what a policy reading only the
  drafter's distributions gets when its calibration is as good as the data allows (in-sample, so
  optimistic).
- calibrated_outside: the same calibration fitted, for each batch, on the trace's rows outside it
  (other prompts): what the calibration gives on text it has not seen.
- knn_e_outside / knn_e+target_outside (with knn > 0): the k nearest positions of the rows outside
  the batch in a richer view of the step, their mean realised acceptance per choice: every
  choice's E at once, and with it the target's confidence in the step's root (its top-1
  probability and entropy, which a policy knows before choosing; traces since 2026-12-04 hold them).

Both use simulate's step costs (a step costs its choice's table time at the active rows' mean
committed length) and walk the positions as simulate does (a step advances a row by 1 + accepted).
"""

from __future__ import annotations

import numpy as np


def _rows(tr: dict, rows: list[dict], names: list[str]):
    cols = [tr["choices"].index(n) for n in names]
    e = [np.asarray(r["e"], np.float64)[:, cols] for r in rows]
    acc = [np.asarray(r["accepted"], np.int64)[:, cols] for r in rows]
    end = np.asarray([r["positions"] for r in rows], np.int64)
    return e, acc, end


def oracle_single(acc: np.ndarray, end: int, step_ms) -> float:
    """The least time to walk one row's `end` positions choosing per step with the realised
    acceptance known: T(p) = min_c ms_c(p) + T(p + 1 + acc[p, c]), T(end) = 0. step_ms(c, p) is
    choice c's step time at position p."""
    t = np.zeros(end + 1)
    for p in range(end - 1, -1, -1):
        t[p] = min(step_ms(c, p) + t[min(p + 1 + int(acc[p, c]), end)] for c in range(acc.shape[1]))
    return float(t[0])


def run_batch(rows_e, rows_acc, end, base, contexts, table, score=None, fixed: int | None = None,
              rule: str = "rate"):
    """One generation of a batch: each step takes `fixed`, or the choice with the most
    (1 + score(E)) per ms of its step (score None: the realised acceptance, the oracle), summed over
    the active rows (rule "rate") or of the row with the most positions left (rule "slowest", ties
    to the sum). Returns (tokens, ms, steps per choice index)."""
    pos = np.zeros(len(end), np.int64)
    total, steps = 0.0, {}
    while np.any(pos < end):
        active = pos < end
        ctx = float(np.mean((base + pos)[active]))
        ms = np.asarray([np.interp(ctx, contexts, t) for t in table])
        realised = np.stack([a[min(p, len(a) - 1)] for a, p in zip(rows_acc, pos)])  # [B, C]
        if fixed is not None:
            c = fixed
        else:
            seen = realised if score is None else np.stack(
                [score(e[min(p, len(e) - 1)]) for e, p in zip(rows_e, pos)])
            rate = np.sum((1.0 + seen) * active[:, None], axis=0) / ms
            if rule == "slowest":
                slow = int(np.argmax(np.where(active, end - pos, -1)))
                rate = (1.0 + seen[slow]) / ms + 1e-9 * rate
            c = int(np.argmax(rate))
        total += ms[c]
        steps[c] = steps.get(c, 0) + 1
        pos = pos + np.where(active, 1 + realised[:, c], 0)
    return int(np.sum(end + 1)), total, steps


FEATURES = ("e", "e+target")


def row_features(row: dict, cols: list[int], which: str) -> np.ndarray:
    """What a policy sees at each position of a trace row, [positions, F]: log(1 + E) of the choices
    at cols; with "e+target" also the target's top-1 probability and entropy of the distribution
    that chose the position's root (the first position has none: it takes the row's mean)."""
    f = np.log1p(np.asarray(row["e"], np.float64)[:, cols])
    if which == "e":
        return f
    if "root_top1" not in row:
        raise ValueError("features 'e+target' need a trace with root_top1 / root_entropy (adaptive_bench trace "
                         "since 2026-12-04)")
    n = f.shape[0]
    extra = []
    for key in ("root_top1", "root_entropy"):
        v = np.asarray([np.nan if x is None else x for x in row[key][:n]], np.float64)
        extra.append(np.where(np.isnan(v), np.nanmean(v) if np.any(~np.isnan(v)) else 0.0, v))
    return np.c_[f, np.stack(extra, axis=1)]


def knn_calibration(rows_f, rows_acc, k: int):
    """features [F] -> the mean realised acceptance [C] of the k training positions nearest to it
    (features standardised over the training positions)."""
    f = np.concatenate(rows_f)
    a = np.concatenate(rows_acc).astype(np.float64)
    mu, sd = f.mean(axis=0), f.std(axis=0) + 1e-9
    z = (f - mu) / sd
    k = min(k, len(z))

    def score(x):
        d = np.sum((z - (x - mu) / sd) ** 2, axis=1)
        return a[np.argpartition(d, k - 1)[:k]].mean(axis=0)

    return score


def binned_calibration(rows_e, rows_acc, bins: int = 12):
    """E [C] -> the realised acceptance's mean over the trace's positions whose E for that choice
    fell in the same quantile bin (per choice; a choice whose E never varies maps to its mean)."""
    e = np.concatenate(rows_e)
    a = np.concatenate(rows_acc)
    edges, means = [], []
    for c in range(e.shape[1]):
        q = np.unique(np.quantile(e[:, c], np.linspace(0.0, 1.0, bins + 1)))
        idx = np.clip(np.searchsorted(q, e[:, c], side="right") - 1, 0, max(len(q) - 2, 0))
        m = np.asarray([a[idx == b, c].mean() if np.any(idx == b) else 0.0 for b in range(max(len(q) - 1, 1))])
        edges.append(q)
        means.append(m)

    def score(ec):
        out = np.empty(len(ec))
        for c, x in enumerate(ec):
            b = np.clip(np.searchsorted(edges[c], x, side="right") - 1, 0, len(means[c]) - 1)
            out[c] = means[c][b]
        return out

    return score


def ceiling(tr: dict, tables: dict, batches: list[int], context: float | None, batches_of, bins: int = 12,
            knn: int = 0) -> dict:
    """Per batch size: tokens/s of every fixed choice, the oracle and the per-step choices of this
    module's docstring (the knn ones with knn > 0; "e+target" where the trace has the target's
    figures), and each one's ratio to the best fixed choice. The choices fitted outside a batch are
    left out where a batch holds every row. tables: as adaptive_simulate.tables_from_files;
    batches_of: how the benchmark groups the trace's rows."""
    out = {}
    rows = tr["rows"]
    feature_sets = [w for w in FEATURES if w == "e" or all("root_top1" in r for r in rows)] if knn > 0 else []
    for b in batches:
        contexts, ms, _ = tables[b]
        names = [n for n in tr["choices"] if n in ms]
        cols = [tr["choices"].index(n) for n in names]
        table = [ms[n] for n in names]
        rules = ("rate",) if b == 1 else ("rate", "slowest")  # one rule at batch 1, where both are the same
        groups = batches_of(rows, b)
        outside = [[r for r in rows if all(r is not g for g in group)] for group in groups]
        fitted_outside = all(outside)
        all_e, all_acc, _ = _rows(tr, rows, names)
        insample = binned_calibration(all_e, all_acc, bins)
        # key -> (the view of a row its score reads, the score of group i)
        policies = {"oracle": (None, lambda i: None), "calibrated": (None, lambda i: insample)}
        if fitted_outside:
            def binned_outside(i):
                e, a, _ = _rows(tr, outside[i], names)
                return binned_calibration(e, a, bins)
            policies["calibrated_outside"] = (None, binned_outside)
            for which in feature_sets:
                def knn_outside(i, which=which):
                    _, a, _ = _rows(tr, outside[i], names)
                    return knn_calibration([row_features(r, cols, which) for r in outside[i]], a, knn)
                policies[f"knn_{which}_outside"] = (which, knn_outside)
        per_step = [(key, rule) for key in policies for rule in rules]
        tok = {k: 0 for k in names + per_step}
        time = {k: 0.0 for k in tok}
        steps = {k: {} for k in per_step}
        for i, group in enumerate(groups):
            e, acc, end = _rows(tr, group, names)
            base = np.asarray([context if context is not None else r["prompt_len"] for r in group], np.float64)
            for c, n in enumerate(names):
                n_tok, t, _ = run_batch(e, acc, end, base, contexts, table, fixed=c)
                tok[n] += n_tok
                time[n] += t
            for key, (which, score_of) in policies.items():
                seen = e if which is None else [row_features(r, cols, which) for r in group]
                score = score_of(i)
                for rule in rules:
                    n_tok, t, st = run_batch(seen, acc, end, base, contexts, table, score=score, rule=rule)
                    tok[(key, rule)] += n_tok
                    time[(key, rule)] += t
                    for c, v in st.items():
                        steps[(key, rule)][names[c]] = steps[(key, rule)].get(names[c], 0) + v
        for key in policies:  # each with its better rule over the whole run
            rule = min(rules, key=lambda r, key=key: time[(key, r)] / tok[(key, r)])
            tok[key], time[key] = tok[(key, rule)], time[(key, rule)]
            steps[key] = steps[(key, rule)] | {"rule": rule}
        for k in per_step:
            del tok[k], time[k], steps[k]
        if b == 1:  # the exact optimum, row by row
            exact = 0.0
            for r in tr["rows"]:
                [e], [acc], [end] = _rows(tr, [r], names)
                base = context if context is not None else r["prompt_len"]
                exact += oracle_single(acc, int(end),
                                       lambda c, p, base=base: float(np.interp(base + p, contexts, table[c])))
            tok["oracle_exact"] = tok[names[0]]
            time["oracle_exact"] = exact
        tps = {k: 1000.0 * tok[k] / time[k] for k in tok}
        fixed = {n: tps[n] for n in names}
        best = max(fixed, key=fixed.get)
        out[str(b)] = {"tokens_per_s": tps, "best_fixed": best,
                       "over_best": {k: tps[k] / fixed[best] for k in tps if k not in names},
                       "steps": steps}
    return out
