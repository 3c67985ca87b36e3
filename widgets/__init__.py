"""ipywidgets views used by the notebooks (glmkit itself never imports this package)."""

from widgets.parity import (KdaErrorCurve, LogprobHistogram, SiteHeatmap, TopkOverlap, VerdictBanner,
                            figure_png, show)
from widgets.launch import InventoryTable, PreflightTable
from widgets.rollout_data import PositionProfile, RolloutVerdict, SampleTable, TokenTrace
from widgets.training import HealthTable, LiveMetrics

__all__ = ["SiteHeatmap", "LogprobHistogram", "KdaErrorCurve", "TopkOverlap", "VerdictBanner", "LiveMetrics",
           "HealthTable", "InventoryTable", "PreflightTable", "RolloutVerdict", "SampleTable", "TokenTrace",
           "PositionProfile", "show", "figure_png"]
