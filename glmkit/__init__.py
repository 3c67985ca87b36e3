"""glmkit: a bring-up kit for the RL recipe of GLM-5.3-Flash."""

__version__ = "0.1.0"
