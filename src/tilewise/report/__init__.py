"""HTML report of a tilewise run: plan, tile layout, error heatmap and figures, measured cost, and the
cost instrument of seed 000 (y = a·x²), all in one self-contained page."""

from .builder import build_html, build_report, cost_series
from .instrument import CAVEAT, INITIAL_A, INITIAL_X, PLAY_LIMIT, STEP_INCREMENT, instrument_html

__all__ = ["build_report", "build_html", "cost_series", "instrument_html", "CAVEAT", "INITIAL_A",
           "INITIAL_X", "STEP_INCREMENT", "PLAY_LIMIT"]
