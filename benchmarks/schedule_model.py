"""The schedule part of the cost model (`ray_dhp.planning.recommend.schedule_time`) against measurement.

Input: a ``benchmarks/schedules.py`` result (disjoint 1 vision + 1 text rank, sequential and
pipelined, same processes). Nothing is fitted: the per-module times come from the *sequential*
row only, the pipelined time is predicted from them and compared with the measured one.

From the sequential row (step ``S``, idle fractions ``i_v``, ``i_t`` = time blocked in the
boundary exchanges, see ``benchmarks/schedules.py``): in the sequential order the vision rank
waits while text computes and vice versa, so with ``c`` the boundary transfer time of the step
and ``O`` the work both ranks do outside the micro-batch phases (gradient reduction, global norm,
optimizer, planning):

    i_v * S = T + c      i_t * S = V + c      S = V + T + c + O

three equations in four unknowns; the prediction takes ``c = 0`` (a few KiB of features over
gloo shared memory) and reports the sensitivity to the upper bound the pipelined row gives
(its vision idle time contains every transfer). The vision time splits 1 : 2 into forward and
backward (backward = two matmuls per forward one); per micro-batch ``v = V / M``, ``t = T / M``.

    python -m benchmarks.schedule_model [RESULT.json]
"""

from __future__ import annotations

import json
import os
import sys

from ray_dhp.planning.recommend import schedule_time

DEFAULT = os.path.join(os.path.dirname(__file__), "results", "schedules-vitheavy-cpu2-2026-11-30.json")


def _rows(result: dict) -> tuple:
    rows = result["rows"]
    seq = next(v for k, v in rows.items() if k.startswith("disjoint") and "sequential" in k)
    pip = next(v for k, v in rows.items() if k.startswith("disjoint") and "pipelined" in k)
    return seq, pip


def predict(result: dict, boundary_s: float = 0.0) -> dict:
    """Per-module times from the sequential row and the predicted pipelined/sequential ratio."""
    seq, pip = _rows(result)
    m, s = result["micro_batches"], seq["step_s"]
    iv, it = seq["idle_fraction"]["vision"], seq["idle_fraction"]["text"]
    vision, text = it * s - boundary_s, iv * s - boundary_s
    other = s - vision - text - boundary_s
    v, t, c = vision / m, text / m, boundary_s / (2 * m)
    pred_seq = schedule_time("sequential", m, v / 3, 2 * v / 3, t, c) + other
    pred_pip = schedule_time("pipelined", m, v / 3, 2 * v / 3, t, c) + other
    measured_pip = pip["step_s"]
    return {
        "micro_batches": m, "vision_s": vision, "text_s": text, "other_s": other,
        "predicted_sequential_s": pred_seq, "measured_sequential_s": s,
        "predicted_pipelined_s": pred_pip, "measured_pipelined_s": measured_pip,
        "predicted_ratio": pred_pip / pred_seq, "measured_ratio": measured_pip / s,
        # busy time of the vision rank when it runs beside the text rank (pipelined) vs alone
        "vision_busy_sequential_s": (1 - iv) * s,
        "vision_busy_pipelined_s": (1 - pip["idle_fraction"]["vision"]) * measured_pip,
        "boundary_upper_bound_s": pip["idle_fraction"]["vision"] * measured_pip,
    }


def with_contention(p: dict) -> float:
    """The predicted ratio with the vision rank's measured slow-down beside a busy text rank
    added: on 2 shared CPU cores the ranks are not independent devices (on GPUs they are). The
    pipelined run is vision-bound, so the extra vision busy time adds to its step directly."""
    extra = p["vision_busy_pipelined_s"] - p["vision_busy_sequential_s"]
    return (p["predicted_pipelined_s"] + extra) / p["predicted_sequential_s"]


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0] if argv else DEFAULT) as f:
        result = json.load(f)
    out = predict(result)
    hi = predict(result, boundary_s=out["boundary_upper_bound_s"])
    out["predicted_ratio_at_boundary_bound"] = hi["predicted_ratio"]
    out["predicted_ratio_with_measured_contention"] = with_contention(out)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}, indent=2))
    return out


if __name__ == "__main__":
    main()
