"""ipywidgets views used by the notebooks (glmkit itself never imports this package)."""
