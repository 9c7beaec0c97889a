"""Forecasting layers: measured truth, local model, Claude, calibration and the selective policy."""
