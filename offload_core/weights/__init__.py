"""Packing groups of tensors into flat per-dtype host buffers, and splitting a model into units."""

from .plan import split_units
from .unit import UnsupportedTensorError, WeightUnit, nbytes_of, slot_numel

__all__ = ["UnsupportedTensorError", "WeightUnit", "nbytes_of", "slot_numel", "split_units"]
