"""Packing groups of tensors into flat per-dtype host buffers, and splitting a model into units."""

from ..base.errors import UnsupportedTensorError
from .split import split_units
from .layout import nbytes_of
from .unit import WeightUnit

__all__ = ["UnsupportedTensorError", "WeightUnit", "nbytes_of", "split_units"]
