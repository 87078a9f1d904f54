"""Will it fit? One training step's device memory, estimated under fake tensors (``tbp estimate``)."""

from lightning_tbp.estimate.config import EstimateConfigError, estimate_config
from lightning_tbp.estimate.device import CPU, CUDA, DeviceModel
from lightning_tbp.estimate.layout import Layout
from lightning_tbp.estimate.lightning import lightning_step
from lightning_tbp.estimate.measure import MeasuredStep, measure_step
from lightning_tbp.estimate.report import estimate_dict, format_estimate
from lightning_tbp.estimate.step import PlanFit, StepEstimate, StepNeedsValuesError, TrainingStep, estimate_step

__all__ = [
    "CPU",
    "CUDA",
    "DeviceModel",
    "EstimateConfigError",
    "Layout",
    "MeasuredStep",
    "PlanFit",
    "StepEstimate",
    "StepNeedsValuesError",
    "TrainingStep",
    "estimate_config",
    "estimate_dict",
    "estimate_step",
    "format_estimate",
    "lightning_step",
    "measure_step",
]
