"""Fitting the step model to measurements of real servers (``inference-lab calibrate``)."""
