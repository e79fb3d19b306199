"""Bucket-set choice by measured cost: pick k buckets minimising the total cost of serving the requests.

The costs come from `profiler.profile_buckets` (or any bucket -> seconds per request mapping); the
choice reports logical work (tokens, padded tokens) beside them.

numpy is imported inside the functions that use it, so that `import tilewise.buckets` imports no numpy, PIL or
torch.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .assign import Size, aspect_error
from .planner import BucketPlanner, _check_size, _positive_int
from .profiler import BucketProfile


@dataclass
class BucketChoice:
    """The chosen bucket set, each request's bucket, and logical work beside measured cost."""

    buckets: list[Size]
    total_cost: float
    exact: bool
    method: str
    policy: str
    assignment: dict[Size, Size]  # request (w, h) -> bucket (w, h)
    counts: dict[Size, int]  # request (w, h) -> how many times it occurs
    costs: dict[Size, float] = field(repr=False)
    latent_factor: int = 8
    batch_size: int = 1  # short batches are charged as full ones

    def rows(self) -> list[dict[str, Any]]:
        """Per chosen bucket: requests, tokens, padded tokens, padding fraction, cost per request, total."""
        f2 = self.latent_factor**2
        out = []
        for b in self.buckets:
            reqs = [(r, c) for r, c in self.counts.items() if self.assignment[r] == b]
            n = sum(c for _, c in reqs)
            tokens = n * b[0] * b[1] / f2
            content = sum(c * min(r[0], b[0]) * min(r[1], b[1]) for r, c in reqs) / f2
            out.append(
                {
                    "bucket": b,
                    "requests": n,
                    "tokens": tokens,
                    "padded_tokens": tokens - content,
                    "padding_fraction": (tokens - content) / tokens if tokens else 0.0,
                    "cost_per_request": self.costs[b],
                    "batches": math.ceil(n / self.batch_size),
                    "total_cost": math.ceil(n / self.batch_size) * self.batch_size * self.costs[b],
                }
            )
        return out

    @property
    def padding_fraction(self) -> float:
        """Padded tokens / processed tokens over all requests."""
        rows = self.rows()
        tokens = sum(r["tokens"] for r in rows)
        return sum(r["padded_tokens"] for r in rows) / tokens if tokens else 0.0

    def table(self) -> str:
        """Markdown: logical work (tokens, padded tokens) beside measured cost, per bucket and in total."""
        lines = [
            "| bucket (w x h) | requests | batches | tokens | padded tokens | padding | ms/request "
            "| total ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in self.rows():
            b = r["bucket"]
            lines.append(
                f"| {b[0]}x{b[1]} | {r['requests']} | {r['batches']} | {r['tokens']:.0f} | "
                f"{r['padded_tokens']:.0f} | "
                f"{r['padding_fraction']:.1%} | {r['cost_per_request'] * 1e3:.2f} | "
                f"{r['total_cost'] * 1e3:.1f} |"
            )
        lines.append(
            f"| **total** | {sum(self.counts.values())} | {sum(r['batches'] for r in self.rows())} | | | "
            f"{self.padding_fraction:.1%} | | "
            f"{self.total_cost * 1e3:.1f} |"
        )
        return "\n".join(lines)

    def planner(self, **kwargs: Any) -> BucketPlanner:
        """A BucketPlanner over the chosen buckets and their measured costs (kwargs go to BucketPlanner)."""
        kwargs.setdefault("latent_factor", self.latent_factor)
        return BucketPlanner(buckets=self.buckets, costs={b: self.costs[b] for b in self.buckets}, **kwargs)


def feasible(
    request: Size, bucket: Size, policy: str, max_aspect_error: float, max_area_error: float
) -> bool:
    """Can `bucket` take `request` under `policy`? pad: covers it; resize: aspect and area within bounds."""
    if policy == "pad":
        return bucket[0] >= request[0] and bucket[1] >= request[1]
    area = abs(math.log(bucket[0] * bucket[1] / (request[0] * request[1])))
    return aspect_error(request, bucket) <= max_aspect_error and area <= math.log1p(max_area_error)


def choose_buckets(
    request_sizes: Sequence[Size] | Mapping[Size, int],
    costs: Mapping[Size, float] | BucketProfile,
    k: int,
    policy: str = "pad",
    *,
    max_aspect_error: float = 0.1,
    max_area_error: float = 0.25,
    method: str = "auto",
    max_combinations: int = 200_000,
    batch_size: int = 1,
    latent_factor: int = 8,
) -> BucketChoice:
    """Pick k of the costed buckets minimising sum over requests of the cheapest feasible bucket's cost.

    Objective (a k-median / facility-location problem): total = sum_r count_r * min_{b in S, feasible}
    cost_b, costs being seconds per request at full batches. With ``batch_size`` > 1 a bucket serving
    n requests is charged ceil(n / batch_size) full batches, so short batches are paid in full (requests
    still go to their cheapest feasible bucket).

    ``method="exhaustive"`` enumerates all C(n, k) sets (exact); ``"greedy"`` adds the bucket that
    lowers the total most, then applies single-swap local search until no swap improves (not guaranteed
    optimal; the result is 1-swap optimal); ``"auto"`` is exhaustive when C(n, k) <= max_combinations.
    Feasibility: ``pad`` needs the bucket to cover the request; ``resize`` needs aspect error <=
    max_aspect_error and |log(area ratio)| <= log(1 + max_area_error).
    """
    import numpy as np

    # 1. the inputs: how often each request occurs, each candidate bucket's seconds per request, options
    counts = _request_counts(request_sizes)
    costs = _bucket_costs(costs)
    k = _positive_int("k", k)
    _check_options(policy, method)
    cands = sorted(costs)
    if k > len(cands):
        raise ValueError(f"k={k} exceeds the {len(cands)} costed candidate buckets")
    # 2. M[request, bucket]: the bucket's cost where it can take the request, inf where it cannot
    reqs = list(counts)
    M = _cost_matrix(reqs, cands, costs, policy, max_aspect_error, max_area_error)
    _check_coverage(reqs, M, policy)
    w = np.array([counts[r] for r in reqs], dtype=np.float64)
    c = np.array([costs[b] for b in cands])
    B = _positive_int("batch_size", batch_size)
    # 3. the k columns: every k-subset when there are few enough, else greedy additions and single swaps
    exhaustive = method == "exhaustive" or (method == "auto" and math.comb(len(cands), k) <= max_combinations)
    chosen = _exhaustive(M, c, w, k, B) if exhaustive else _greedy_swap(M, c, w, k, B)
    unserved, total = (float(v[0]) for v in _set_costs(M, c, w, np.array([chosen]), B))
    if unserved > 0:
        raise ValueError(f"no set of k={k} buckets serves every request under policy='{policy}'; raise k")
    # 4. each request to its cheapest chosen bucket
    sub = M[:, chosen]
    assignment = {r: cands[chosen[int(np.argmin(sub[i]))]] for i, r in enumerate(reqs)}
    picked = sorted(cands[j] for j in chosen)
    method_used = "exhaustive" if exhaustive else "greedy+swap"
    return BucketChoice(picked, float(total), exhaustive, method_used, policy, assignment, counts, costs,
                        latent_factor, B)


def _bucket_costs(costs: Mapping[Size, float] | BucketProfile) -> dict[Size, float]:
    """Seconds per request of each candidate bucket, from a profile or a bucket -> cost mapping."""
    if isinstance(costs, BucketProfile):
        return costs.costs()
    return {_check_size("bucket", b): float(c) for b, c in costs.items()}


def _check_options(policy: str, method: str) -> None:
    if policy not in ("pad", "resize"):
        raise ValueError(f"choose_buckets policy must be 'pad' or 'resize', got {policy!r}")
    if method not in ("auto", "exhaustive", "greedy"):
        raise ValueError(f"method must be 'auto', 'exhaustive' or 'greedy', got {method!r}")


def _cost_matrix(reqs: list[Size], cands: list[Size], costs: dict[Size, float], policy: str,
                 max_aspect_error: float, max_area_error: float) -> Any:
    """(requests, buckets) float array: the bucket's cost where `feasible`, inf elsewhere."""
    import numpy as np

    return np.array(
        [
            [costs[b] if feasible(r, b, policy, max_aspect_error, max_area_error) else np.inf for b in cands]
            for r in reqs
        ]
    )


def _request_counts(request_sizes: Sequence[Size] | Mapping[Size, int]) -> dict[Size, int]:
    """Multiplicity of each (width, height) request."""
    if isinstance(request_sizes, Mapping):
        counts = {
            _check_size("request", r): _positive_int(f"count of {r}", c) for r, c in request_sizes.items()
        }
    else:
        counts = dict(Counter(_check_size("request", r) for r in request_sizes))
    if not counts:
        raise ValueError("request_sizes is empty")
    return counts


def _check_coverage(reqs: list[Size], M: Any, policy: str) -> None:
    """Raise ValueError naming requests that no candidate bucket can take."""
    import numpy as np

    orphans = [r for r, row in zip(reqs, M, strict=True) if not np.isfinite(row).any()]
    if orphans:
        raise ValueError(f"no candidate bucket can take requests {orphans[:10]} under policy='{policy}'")


def _set_costs(M: Any, c: Any, w: Any, block: Any, B: int) -> tuple[Any, Any]:
    """For each k-subset (rows of block): unserved weight, and sum_b ceil(n_b / B) * B * c_b.

    Each request goes to its cheapest feasible bucket in the subset (first on ties); n_b counts them.
    With B = 1 this is sum_r w_r * min_{b in S} M[r, b]; with B > 1 short batches are paid in full.
    """
    import numpy as np

    sub = M[:, block]  # (requests, subsets, k)
    m = sub.min(axis=2)
    served = np.isfinite(m)
    unserved = ((~served) * w[:, None]).sum(axis=0)
    onehot = (sub.argmin(axis=2)[..., None] == np.arange(block.shape[1])) & served[..., None]
    n = (onehot * w[:, None, None]).sum(axis=0)  # (subsets, k): requests per chosen bucket
    return unserved, (np.ceil(n / B) * B * c[block]).sum(axis=1)


def _exhaustive(M: Any, c: Any, w: Any, k: int, B: int) -> list[int]:
    """Exact: evaluate every k-subset of columns in vectorised chunks; first minimum in lexical order."""
    import numpy as np

    best, best_cost = None, math.inf
    chunk = max(1, 1_000_000 // (M.shape[0] * k))  # bounds the (requests, chunk, k) arrays to ~8 MB each
    combos = itertools.combinations(range(M.shape[1]), k)
    while True:
        block = np.array(list(itertools.islice(combos, chunk)), dtype=np.int64)
        if block.size == 0:
            break
        unserved, cost = _set_costs(M, c, w, block, B)
        tot = np.where(unserved > 0, np.inf, cost)
        i = int(np.argmin(tot))
        if tot[i] < best_cost:
            best, best_cost = block[i].tolist(), float(tot[i])
    return best if best is not None else list(range(k))


def _greedy_swap(M: Any, c: Any, w: Any, k: int, B: int) -> list[int]:
    """Greedy forward selection on (unserved weight, cost), then first-improvement single swaps."""
    import numpy as np

    def key(cols: list[int]) -> tuple[float, float]:
        unserved, cost = _set_costs(M, c, w, np.array([cols]), B)
        return float(unserved[0]), float(cost[0])

    chosen: list[int] = []
    for _ in range(k):
        rest = [j for j in range(M.shape[1]) if j not in chosen]
        chosen.append(min(rest, key=lambda j: key(chosen + [j])))
    improved = True
    while improved:
        improved = False
        current = key(chosen)
        for pos in range(k):
            for j in range(M.shape[1]):
                if j in chosen:
                    continue
                trial = chosen[:pos] + [j] + chosen[pos + 1 :]
                if key(trial) < current:
                    chosen, current, improved = trial, key(trial), True
    return sorted(chosen)
