"""How often SparseVLM's official random tie-break in DPC-kNN and ficoco's lowest-index rule cluster apart.

    python benchmarks/sparsevlm_ties.py                   # the tie example, then 16 tokens into 2 clusters
    python benchmarks/sparsevlm_ties.py --draws 20000 --tokens 16 --clusters 2 --width 4096

The official v1.5 `cluster_and_merge` (Gumpest/SparseVLMs 56bef80, llava/model/language_model/utils.py
L247-270) takes the density over the `k = clusters` nearest tokens (the token itself included) and adds
``1e-6 * rand`` to it "to ensure no tokens have the same density"; a token's parent distance is to the nearest
*strictly* denser token. With ``k = 2`` (two clusters: the 64 row's second stage on LLaVA-1.5 recycles 16 tokens
into 2) the two tokens of every mutually nearest pair have exactly the same density, so the noise alone decides
which of them ranks first. ficoco ranks the earlier token first (the official list order: pruned tokens by
descending rater score).

This draws the official rule many times on the same tokens (each draw its own noise, as every call of the
official code is) and counts how often its clusters - the members of each, in the order the clusters are placed
after the kept tokens - differ from ficoco's, and from the rule that keeps ties. It runs the official rule in
float32 and in float16 (the official scripts run LLaVA in float16, where ``1e-6`` is below the density's
resolution and the noise never moves it).
Nothing is timed; nothing here is imported by ficoco.
"""

from __future__ import annotations

import argparse

import torch

from ficoco.methods.sparsevlm.ops import dpc_knn_clusters


def official_clusters(x: torch.Tensor, clusters: int, draws: int, generator: torch.Generator, noise: float = 1e-6
                      ) -> list[tuple[frozenset, ...]]:
    """The official DPC-kNN on ``(P, D)`` tokens in their own dtype, `draws` times, each with its own noise: every
    draw's clusters (member indices) in centre order (the official rule, re-stated; ``noise=0``: ties kept). The
    distances do not depend on the noise: they are computed once."""
    count, width = x.shape
    dist = (x.unsqueeze(1) - x.unsqueeze(0)).norm(dim=-1, p=2) / width ** 0.5
    nearest = torch.topk(dist, k=clusters, dim=-1, largest=False).values
    density = (-(nearest ** 2).mean(dim=-1)).exp().expand(draws, -1)
    noise_draw = torch.rand(density.shape, generator=generator, dtype=torch.float32).to(density.dtype)
    density = density + noise_draw * noise
    dist = dist.expand(draws, -1, -1)
    denser = (density[:, None, :] > density[:, :, None]).to(x.dtype)
    farthest = dist.flatten(1).max(dim=-1).values[:, None, None]
    parent = (dist * denser + farthest * (1 - denser)).min(dim=-1).values
    centres = torch.topk(parent * density, k=clusters, dim=-1).indices
    to_centre = torch.gather(dist, 2, centres.unsqueeze(1).expand(-1, count, -1))
    assign = to_centre.argmin(dim=-1)
    assign.scatter_(1, centres, torch.arange(clusters).expand(draws, -1).contiguous())
    found: dict[tuple[int, ...], tuple[frozenset, ...]] = {}
    out = []
    for row in map(tuple, assign.tolist()):
        if row not in found:
            found[row] = tuple(frozenset(i for i, c in enumerate(row) if c == k) for k in range(clusters))
        out.append(found[row])
    return out


def ficoco_clusters(x: torch.Tensor, clusters: int) -> tuple[frozenset, ...]:
    """ficoco's clusters of ``(P, D)`` tokens (member indices), in centre order."""
    assign = dpc_knn_clusters(x.unsqueeze(0).float(), clusters)[0]
    return tuple(frozenset(torch.nonzero(assign == c).flatten().tolist()) for c in range(clusters))


def rate(x: torch.Tensor, clusters: int, draws: int, dtype: torch.dtype, seed: int,
         reference: tuple[frozenset, ...] | None = None) -> float:
    """The share of official draws (in `dtype`) on tokens `x` ``(P, D)`` whose clusters differ from
    `reference` (ficoco's by default)."""
    generator = torch.Generator().manual_seed(seed)
    ours = ficoco_clusters(x, clusters) if reference is None else reference
    theirs = official_clusters(x.to(dtype), clusters, draws, generator)
    return sum(t != ours for t in theirs) / draws


def ties_kept(x: torch.Tensor, clusters: int) -> tuple[frozenset, ...]:
    """The official rule without its noise (in float32): tied tokens all rank first (ficoco's rule before it
    took the lowest index)."""
    return official_clusters(x.float(), clusters, 1, torch.Generator(), noise=0.0)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=2000, help="official draws per token set")
    parser.add_argument("--sets", type=int, default=200, help="random token sets")
    parser.add_argument("--tokens", type=int, default=16, help="recycled tokens per set (the 64 row's stage 2)")
    parser.add_argument("--clusters", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    example = torch.tensor([[0.0, 0.0], [0.1, 0.0], [1.0, 0.0], [3.0, 0.0]])
    print(f"tie example, 2 clusters: ficoco {[sorted(c) for c in ficoco_clusters(example, 2)]}, "
          f"ties kept {[sorted(c) for c in ties_kept(example, 2)]}")
    for dtype in (torch.float32, torch.float16):
        print(f"  official in {dtype}: differs from ficoco in {rate(example, 2, args.draws * 10, dtype, 0):.1%} of "
              f"draws, from ties kept in {rate(example, 2, args.draws * 10, dtype, 0, ties_kept(example, 2)):.1%}")
    generator = torch.Generator().manual_seed(1)
    sets = [torch.randn(args.tokens, args.width, generator=generator) for _ in range(args.sets)]
    print(f"{args.sets} random sets of {args.tokens} Gaussian tokens of width {args.width} into {args.clusters} "
          f"clusters, {args.draws} draws each:")
    for dtype in (torch.float32, torch.float16):
        ficoco = [rate(x, args.clusters, args.draws, dtype, s) for s, x in enumerate(sets)]
        kept = [rate(x, args.clusters, args.draws, dtype, s, ties_kept(x, args.clusters)) for s, x in enumerate(sets)]
        print(f"  official in {dtype}: differs from ficoco in {sum(ficoco) / len(ficoco):.1%} of draws "
              f"(sets never differing: {sum(f == 0 for f in ficoco)}), from ties kept in {sum(kept) / len(kept):.1%}")


if __name__ == "__main__":
    main()
