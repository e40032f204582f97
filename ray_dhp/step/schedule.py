"""Micro-batch schedules between the vision and the text group, as data.

A schedule is the order of four phases per micro-batch ``k``:

* ``vision_fwd``    vision ranks: forward of micro-batch k on local tokens (keeps its graph)
* ``send_features`` vision ranks post k's features (non-blocking point-to-point sends); text ranks
                    receive them (vision -> text layout)
* ``text_fwd_bwd``  text ranks: forward + backward of k, yielding the feature gradients
* ``return_grads``  text ranks send the feature gradients back (the exact adjoint), vision ranks
                    receive them, then run the vision backward of k

Every rank walks the same order and each boundary phase is one exchange posted by the rule of
`ray_dhp.parallel.boundary.exchange_order`, so the messages of each pair of ranks match in order,
also under NCCL (a pair's k-th operations are a send and its receive). Results do not
depend on the schedule (gradients accumulate per micro-batch in the same order); only timing does.

``sequential``: V0 S0 T0 R0 V1 S1 T1 R1 ... — in a disjoint placement each group idles while the
other works.

``pipelined`` (1F1B-like between the groups): V0 S0 | T0 · V1 S1 | R0 T1 · V2 S2 | R1 ... — text
ranks run T(k) while vision ranks run V(k+1); at most two micro-batches of vision activations are
alive at once. In a collocated placement both groups are the same processes, so it only reorders.
"""

from __future__ import annotations

PHASES = ("vision_fwd", "send_features", "text_fwd_bwd", "return_grads")


def sequential_order(num_micro_batches: int) -> list:
    return [(phase, k) for k in range(num_micro_batches) for phase in PHASES]


def pipelined_order(num_micro_batches: int) -> list:
    m = num_micro_batches
    order = [("vision_fwd", 0), ("send_features", 0)]
    for k in range(m):
        order.append(("text_fwd_bwd", k))
        if k + 1 < m:
            order += [("vision_fwd", k + 1), ("send_features", k + 1)]
        order.append(("return_grads", k))
    return order


SCHEDULES = {"sequential": sequential_order, "pipelined": pipelined_order}


def order_for(schedule: str, num_micro_batches: int) -> list:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: use one of {sorted(SCHEDULES)}")
    order = SCHEDULES[schedule](num_micro_batches)
    assert sorted(order) == sorted(sequential_order(num_micro_batches))
    return order
