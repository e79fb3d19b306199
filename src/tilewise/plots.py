"""Pictures people would rather look at than read: tile layouts (matplotlib, imported on use: ~0.5 s)."""

from __future__ import annotations

from .atomic import atomic_path


def _save(fig, path: str) -> None:
    """Save a figure atomically (temporary name in the same folder, then rename)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=fig.dpi, bbox_inches="tight")


def draw_grid(grid, path: str | None = None, image=None, scale: float = 1.0, owner=None):
    """Draw a TileGrid: cores filled, windows dashed, read boxes dotted, visit order numbered.

    `image` (HxW or HxWxC array in the grid's coordinates times `scale`) is drawn underneath. `owner`
    (tile index -> rank) colours the cores by the rank that runs them. Returns the matplotlib figure;
    writes a PNG when `path` is given.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    H, W = grid.height * scale, grid.width * scale
    aspect = H / W
    fig_w = 8.0
    fig, ax = plt.subplots(figsize=(fig_w, max(1.5, min(fig_w * aspect, 16))), dpi=100)
    if image is not None:
        ax.imshow(image, extent=(0, W, H, 0))
    colors = plt.get_cmap("tab10" if owner else "tab20")
    for t in grid:
        c = colors(owner[t.index] % 10) if owner else colors(t.index % 20)
        y0, y1, x0, x1 = (v * scale for v in t.core)
        ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, facecolor=c, alpha=0.35, edgecolor="none"))
        wy0, wy1, wx0, wx1 = (v * scale for v in t.window)
        ax.add_patch(Rectangle((wx0, wy0), wx1 - wx0, wy1 - wy0, fill=False, edgecolor=c, ls="--", lw=1))
        ry0, ry1, rx0, rx1 = (v * scale for v in t.read)
        if (ry0, ry1, rx0, rx1) != (wy0, wy1, wx0, wx1):
            ax.add_patch(Rectangle((rx0, ry0), rx1 - rx0, ry1 - ry0, fill=False, edgecolor=c, ls=":", lw=1))
        if len(grid) <= 400:
            ax.text((x0 + x1) / 2, (y0 + y1) / 2, str(t.index), ha="center", va="center", fontsize=7)
    ax.set_xlim(min(0, *(t.read[2] * scale for t in grid)), max(W, *(t.read[3] * scale for t in grid)))
    ax.set_ylim(max(H, *(t.read[1] * scale for t in grid)), min(0, *(t.read[0] * scale for t in grid)))
    ax.add_patch(Rectangle((0, 0), W, H, fill=False, edgecolor="black", lw=1.5))
    ax.set_aspect("equal")
    by = f"cores filled by rank ({len(set(owner.values()))} ranks)" if owner else "cores filled"
    ax.set_title(
        f"{grid.rows}x{grid.cols} tiles ({grid.order}); {by}, windows dashed, reads dotted; "
        f"overhead {grid.overhead():+.1%}",
        fontsize=9,
    )
    if owner:
        from matplotlib.patches import Patch

        ranks = sorted(set(owner.values()))
        ax.legend(handles=[Patch(color=colors(r % 10), alpha=0.5, label=f"rank {r}") for r in ranks],
                  fontsize=7, loc="upper right")
    if path is not None:
        _save(fig, path)
    return fig
